"""The engine process (``workers.engine_process``) as a way to fail: killed, frozen, and where the model lives.

Real workers on the test database: the engine process a worker started is
found by its command line among the processes of the worker's session, and
killed (SIGKILL, as the out-of-memory killer does) or frozen (SIGSTOP, a
process that no longer runs) in the middle of generations. Each task it held
must end by its ``on_restart`` policy, a ``resume`` task token for token as
an uninterrupted run; the worker itself goes on, with a new engine process.
"""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path
from typing import Any

import pytest

from tasks_app.models import Task, TaskEvent
from tests.support.lab import Lab
from tests.support.waiting import wait_until
from tests.support.worker import WorkerProcess

TERMINAL = {"succeeded", "failed", "cancelled"}
TOKENS = 400
SEEDED = {"temperature": 1.0, "top_p": 0.95, "seed": 777}
ENGINE_COMMAND = "workers.engine_process.host"


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def _session(pid: int) -> int | None:
    try:
        return os.getsid(pid)
    except OSError:
        return None


def engine_processes(worker: WorkerProcess) -> list[int]:
    """The engine processes running in ``worker``'s session (its pool processes' children)."""
    pids = [int(name) for name in os.listdir("/proc") if name.isdigit()]
    return sorted(pid for pid in pids if ENGINE_COMMAND in _cmdline(pid) and _session(pid) == worker.proc.pid)


def the_engine_process(worker: WorkerProcess) -> int:
    return wait_until(lambda: (found := engine_processes(worker)) and found[0], what="no engine process", timeout=60)


def text_of(task_id: str) -> str:
    rows = TaskEvent.objects.filter(task_id=task_id, type="response.output_text.delta").order_by("sequence_number")
    return "".join(json.loads(row.payload)["delta"] for row in rows)


def wait_for_deltas(task_id: str, worker: WorkerProcess, count: int = 3) -> None:
    def probe() -> bool:
        return TaskEvent.objects.filter(task_id=task_id, type="response.output_text.delta").count() >= count

    wait_until(probe, what=lambda: f"task {task_id} produced no deltas:\n{worker.log()[-3000:]}", timeout=60)


def final_text(body: dict[str, Any]) -> str:
    return body["response"]["output"][0]["content"][0]["text"]


def test_an_engine_process_killed_mid_generation_hands_each_task_back_by_its_policy(lab: Lab):
    # A slowed device (the fault is armed in the engine process, where the model calls are): the kill must
    # land mid-generation on a loaded machine too.
    with lab.worker("engine", LMSP_FAULT_MODEL_CALL_SECONDS="0.004", concurrency=2, pool="threads") as worker:
        reference_id = lab.create("fail", tokens=TOKENS, **SEEDED)
        reference = lab.wait_for(reference_id, TERMINAL, worker)
        assert reference["status"] == "succeeded"
        first_engine = the_engine_process(worker)

        resumed_id = lab.create("resume", tokens=TOKENS, **SEEDED)
        failed_id = lab.create("fail", tokens=TOKENS, **SEEDED)
        wait_for_deltas(resumed_id, worker)
        wait_for_deltas(failed_id, worker)
        os.kill(first_engine, signal.SIGKILL)

        resumed = lab.wait_for(resumed_id, TERMINAL, worker)
        failed = lab.wait_for(failed_id, TERMINAL, worker)
        # The worker went on: a new engine process runs its next task.
        after_id = lab.create("fail", tokens=8)
        assert lab.wait_for(after_id, TERMINAL, worker)["status"] == "succeeded"
        second_engine = the_engine_process(worker)
        log = worker.log()

    assert worker.proc.returncode is not None  # stopped by the block, not before
    assert second_engine != first_engine
    assert f"engine process {first_engine} was killed (signal 9)" in log
    # resume: the same item, token for token as the uninterrupted run, in a second attempt.
    assert resumed["status"] == "succeeded"
    assert final_text(resumed) == final_text(reference) == text_of(resumed_id)
    assert resumed["response"]["usage"] == reference["response"]["usage"]
    assert Task.objects.get(pk=resumed_id).attempts == 2
    # fail: failed, saying why.
    assert failed["status"] == "failed"
    assert failed["error"]["code"] == "server_restarted"
    assert "engine process was killed (signal 9)" in failed["error"]["message"]


# The frozen process's watch and where the model is mapped are the worker's and the engine's own, the same
# over either database; the hand-back they end in is tested on both (above, and tests/test_recovery.py).
@pytest.mark.sqlite_pass
def test_a_frozen_engine_process_is_noticed_killed_and_its_tasks_handed_back(lab: Lab):
    with lab.worker(
        "frozen", LMSP_FAULT_MODEL_CALL_SECONDS="0.004", LMSP_ENGINE_SILENCE_SECONDS="1.5", pool="threads"
    ) as worker:
        task_id = lab.create("resume", tokens=TOKENS, **SEEDED)
        wait_for_deltas(task_id, worker)
        engine = the_engine_process(worker)
        os.kill(engine, signal.SIGSTOP)

        done = lab.wait_for(task_id, TERMINAL, worker)
        log = worker.log()
        assert engine not in engine_processes(worker)  # killed, not left stopped holding the device

    assert done["status"] == "succeeded"
    assert f"engine process {engine} stopped answering" in log
    assert final_text(done) == text_of(task_id)
    assert done["response"]["usage"]["output_tokens"] == TOKENS
    assert Task.objects.get(pk=task_id).attempts == 2


def _maps(pid: int) -> str:
    return Path(f"/proc/{pid}/maps").read_text()


@pytest.mark.sqlite_pass
def test_the_model_is_loaded_in_the_engine_process_only(lab: Lab):
    with lab.worker("where", pool="threads") as worker:
        task_id = lab.create("fail", tokens=8)
        assert lab.wait_for(task_id, TERMINAL, worker)["status"] == "succeeded"
        engine = the_engine_process(worker)
        worker_maps, engine_maps = _maps(worker.proc.pid), _maps(engine)

    assert "libonnxruntime" in engine_maps
    assert "libonnxruntime" not in worker_maps
