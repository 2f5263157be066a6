"""SIGTERM to a batched worker (the threads pool), as honcho and the compose images' tini send it.

No pool process dies: Celery's warm shutdown waits for its task threads, and
the engine decides how long they go on (``LMSP_DRAIN_SECONDS``). Whatever
has not finished by then is handed back by its ``on_restart`` policy, one log
line per task, and the worker exits 0. The generations run on the ``small``
demo size without its EOS head (a few ms a token, so 8,000 tokens outlast
every wait here by far), with one ONNX Runtime thread per worker.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
from contextlib import AbstractContextManager
from pathlib import Path

import pytest

from tasks_app.models import Task, TaskEvent
from tasks_app.registry.scan import model_scan
from tests.support.lab import Lab
from tests.support.queues import queued_ids
from tests.support.waiting import wait_until
from tests.support.worker import WorkerProcess

pytestmark = pytest.mark.slow

SLOW_MODEL = "slow"
LONG = 8000
# The events every run commits before its first delta (in_progress, output_item.added, content_part.added).
OPENING_SEQUENCE = 3


@pytest.fixture(scope="module")
def slow_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``slow``: the ``small`` demo size without its EOS head, built once for the module."""
    from fixture_models.demo import build_demo_model

    folder = tmp_path_factory.mktemp("drain-models") / SLOW_MODEL
    build_demo_model(folder, size="small", endless=True)
    return folder


@pytest.fixture
def slow_lab(lab: Lab, slow_model_dir: Path) -> Lab:
    """The recovery tests' lab (tests/support/lab.py) with the ``slow`` model beside the demo ones."""
    shutil.copytree(slow_model_dir, lab.models / SLOW_MODEL)
    model_scan(models_dir=lab.models)
    lab.env["LMSP_INTRA_OP_THREADS"] = "1"
    return lab


def batched_worker(lab: Lab, *, threads: int, drain_seconds: float) -> AbstractContextManager[WorkerProcess]:
    """The Procfile's worker: the threads pool, as many threads as the engine batches."""
    return lab.worker(
        "drain",
        concurrency=threads,
        pool="threads",
        LMSP_MAX_BATCH=str(threads),
        LMSP_DRAIN_SECONDS=str(drain_seconds),
    )


def generating(worker: WorkerProcess, *task_ids: str) -> None:
    """Wait until every task is running and has committed text: mid-generation."""

    def probe() -> bool:
        if worker.proc.poll() is not None:
            raise RuntimeError(f"the worker exited ({worker.proc.returncode}):\n{worker.log()[-4000:]}")
        rows = Task.objects.filter(pk__in=task_ids, status="running", last_sequence__gt=OPENING_SEQUENCE)
        return rows.count() == len(task_ids)

    wait_until(probe, what=lambda: f"not all of {task_ids} are generating:\n{worker.log()[-4000:]}", timeout=120)


def sigterm(worker: WorkerProcess) -> None:
    """SIGTERM to the process group, as honcho and ``tini -g`` send it."""
    os.killpg(worker.proc.pid, signal.SIGTERM)


def exit_status(worker: WorkerProcess) -> int:
    try:
        return worker.proc.wait(timeout=90)
    except subprocess.TimeoutExpired:
        raise AssertionError(
            f"the worker's warm shutdown still waits for its task threads 90 s after SIGTERM:\n{worker.log()[-6000:]}"
        ) from None


def interrupted_lines(log: str, task_id: str) -> list[str]:
    return [line for line in log.splitlines() if f"task {task_id} interrupted by shutdown; " in line]


def test_sigterm_hands_every_running_task_back_by_its_policy_and_the_worker_exits_0(slow_lab: Lab):
    lab = slow_lab
    # A thread to spare: the hand-backs' own messages may reach this worker while it stops.
    with batched_worker(lab, threads=4, drain_seconds=0) as worker:
        tasks = {policy: lab.create(policy, model=SLOW_MODEL, tokens=LONG) for policy in ("fail", "retry", "resume")}
        generating(worker, *tasks.values())

        sigterm(worker)
        assert exit_status(worker) == 0

    rows = {policy: Task.objects.get(pk=task_id) for policy, task_id in tasks.items()}
    failed, retried, resumed = rows["fail"], rows["retry"], rows["resume"]
    assert (failed.status, failed.error["code"]) == ("failed", "server_restarted")
    assert (retried.status, retried.worker, retried.attempts) == ("queued", "", 1)
    assert (resumed.status, resumed.worker) == ("running", "")
    # Stopped, not finished: none of them reached its token limit.
    assert all(row.output_tokens < LONG for row in (failed, resumed))
    # The resumed task continues from what it committed: its deltas are all there for the next worker.
    assert TaskEvent.objects.filter(task_id=resumed.id, type="response.output_text.delta").exists()
    # Not taken again by the stopping worker: their messages wait in the queue for the next one.
    assert {retried.id, resumed.id} <= set(queued_ids(lab.queue))
    log = worker.log()
    assert "Traceback" not in log, log[-6000:]
    outcomes = {
        "fail": "on_restart=fail: it failed (server_restarted)",
        "retry": "on_restart=retry: it is queued again and runs anew at the next start (or on another running worker)",
        "resume": "on_restart=resume: it resumes at the next start (or on another running worker)",
    }
    for policy, task_id in tasks.items():
        lines = interrupted_lines(log, task_id)
        assert len(lines) == 1, (policy, lines, log[-6000:])
        assert lines[0].endswith(f"task {task_id} interrupted by shutdown; {outcomes[policy]}"), lines


def test_a_drain_lets_a_task_finish_within_its_grace_and_hands_back_the_one_that_cannot(slow_lab: Lab):
    lab = slow_lab
    with batched_worker(lab, threads=2, drain_seconds=8) as worker:
        long_task = lab.create("retry", model=SLOW_MODEL, tokens=LONG)
        generating(worker, long_task)
        short_task = lab.create("fail", model=SLOW_MODEL, tokens=300)
        generating(worker, short_task)
        at_sigterm = Task.objects.get(pk=long_task).last_sequence

        sigterm(worker)
        # Sent while the worker drains: it takes no new task.
        late_task = lab.create("fail", model=SLOW_MODEL, tokens=10)
        assert exit_status(worker) == 0

    short, long, late = (Task.objects.get(pk=task_id) for task_id in (short_task, long_task, late_task))
    assert (short.status, short.output_tokens) == ("succeeded", 300)
    # The long task generated through the drain, then went back to the queue by its policy.
    assert TaskEvent.objects.filter(task_id=long_task, sequence_number__gt=at_sigterm + 10).exists()
    assert (long.status, long.worker, long.attempts) == ("queued", "", 1)
    assert (late.status, late.worker, late.attempts) == ("queued", "", 0)
    log = worker.log()
    assert "Traceback" not in log, log[-6000:]
    assert interrupted_lines(log, short_task) == []
    assert len(interrupted_lines(log, long_task)) == 1, log[-6000:]


def test_a_prefork_worker_of_one_process_still_hands_its_task_back_on_sigterm(slow_lab: Lab):
    """``--pool prefork --concurrency 1``, the special case: the group's SIGTERM reaches the pool
    process too, which drains its engine as the threads pool does (never a SystemExit inside a
    commit), hands its task back by its policy and says so in the same line."""
    lab = slow_lab
    with lab.worker("prefork", concurrency=1, LMSP_MAX_BATCH="1") as worker:
        task_id = lab.create("retry", model=SLOW_MODEL, tokens=LONG)
        generating(worker, task_id)
        sigterm(worker)
        assert exit_status(worker) == 0

    row = Task.objects.get(pk=task_id)
    assert (row.status, row.worker, row.attempts) == ("queued", "", 1)
    log = worker.log()
    assert "Traceback" not in log, log[-6000:]
    (line,) = interrupted_lines(log, task_id)
    assert line.endswith(
        f"task {task_id} interrupted by shutdown; on_restart=retry: it is queued again and runs anew "
        "at the next start (or on another running worker)"
    )
