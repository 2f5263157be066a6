"""Recovery with real crashes: workers killed with SIGKILL, then ``lmsp_recover`` or the reaper.

Every cell of chapter 11.3's table is produced for real: a task is left
``queued`` by a worker that never started, ``loading`` by a worker killed
while it was stuck reading its model (the model's config is a FIFO nobody
writes: storage that hangs), ``running`` by a worker killed mid-generation,
``cancelling`` by a cancel sent after its worker was killed.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from tasks_app.models import Response, Task, TaskAttempt, TaskEvent, TaskSnapshot
from tasks_app.states import AttemptEnd, RestartPolicy, TaskStatus
from tests.support.demo import ENDLESS_MODEL
from tests.support.lab import Lab
from tests.support.server import REPO, uvicorn_process
from tests.support.sse import call, open_stream
from tests.support.waiting import wait_until
from tests.support.worker import WorkerProcess, kill_process_group

TERMINAL = {"succeeded", "failed", "cancelled"}
LONG = 3000
KILLED_TOKENS = 4000


@contextmanager
def stalled_model(lab: Lab) -> Iterator[None]:
    """Loading model "stall" blocks until the block ends: its config.json is a FIFO with no writer."""
    config = lab.models / "stall" / "config.json"
    saved = config.with_name("config.json.saved")
    os.replace(config, saved)
    os.mkfifo(config)
    try:
        yield
    finally:
        os.unlink(config)
        os.replace(saved, config)


def events(task_id: str) -> list[dict[str, Any]]:
    rows = TaskEvent.objects.filter(task_id=task_id).order_by("sequence_number")
    return [json.loads(row.payload) for row in rows]


def types(task_id: str) -> list[str]:
    return [event["type"] for event in events(task_id)]


def deltas(log: list[dict[str, Any]]) -> str:
    return "".join(e["delta"] for e in log if e["type"] == "response.output_text.delta")


def reference_output_call_id(log: list[dict[str, Any]]) -> str:
    """The call id the stream opened the call with (a resumed run keeps it)."""
    return next(e["item"]["call_id"] for e in log if e["type"] == "response.output_item.added")


def assert_contiguous_with_one_terminal(log: list[dict[str, Any]]) -> None:
    assert [e["sequence_number"] for e in log] == list(range(len(log)))
    terminal = [e for e in log if e["type"] in {"response.completed", "response.incomplete", "response.failed"}]
    terminal += [e for e in log if e["type"] == "response.cancelled"]
    assert len(terminal) == 1 and terminal[0] is log[-1]


def wait_for_deltas(task_id: str, count: int, worker: WorkerProcess) -> None:
    def probe() -> bool:
        return TaskEvent.objects.filter(task_id=task_id, type="response.output_text.delta").count() >= count

    wait_until(probe, what=lambda: f"task {task_id} produced no deltas:\n{worker.log()[-3000:]}", timeout=60)


def summary_counts(output: str) -> dict[str, int]:
    counts = {}
    for line in output.splitlines():
        label, _, number = line.removeprefix("lmsp_recover: ").rpartition(": ")
        if number.isdigit():
            counts[label] = int(number)
    return counts


# --------------------------------------------------------------------------- #
# The 12 cells of chapter 11.3
# --------------------------------------------------------------------------- #


def test_queued_tasks_fail_or_stay_queued_and_then_run(lab: Lab):
    ids = {policy: lab.create(policy) for policy in RestartPolicy.values}

    output = lab.recover()

    assert summary_counts(output)["failed"] == 1
    assert summary_counts(output)["left queued"] == 2
    failed = lab.task(ids["fail"])
    assert failed["status"] == "failed"
    assert failed["error"]["code"] == "server_restarted"
    assert types(ids["fail"]) == ["response.created", "response.failed"]
    assert events(ids["fail"])[1]["response"]["status"] == "failed"
    for policy in ("retry", "resume"):
        assert lab.task(ids[policy])["status"] == "queued"
        assert types(ids[policy]) == ["response.created"]

    with lab.worker("queued") as worker:
        for policy in ("retry", "resume"):
            assert lab.wait_for(ids[policy], TERMINAL, worker)["status"] == "succeeded"
            assert_contiguous_with_one_terminal(events(ids[policy]))
            assert Task.objects.get(pk=ids[policy]).attempts == 1
    assert lab.task(ids["fail"])["status"] == "failed"


def test_loading_tasks_killed_while_loading_fail_or_run_again(lab: Lab):
    with stalled_model(lab):
        ids = {policy: lab.create(policy, model="stall") for policy in RestartPolicy.values}
        with lab.worker("loader", concurrency=3) as worker:
            for task_id in ids.values():
                lab.wait_for(task_id, {"loading"}, worker)
            kill_process_group(worker.proc)
    assert {Task.objects.get(pk=i).status for i in ids.values()} == {TaskStatus.LOADING}

    output = lab.recover()

    assert summary_counts(output)["failed"] == 1
    assert summary_counts(output)["queued"] == 2
    failed = lab.task(ids["fail"])
    assert failed["error"]["code"] == "server_restarted"
    assert "loading" in failed["error"]["detail"]
    assert types(ids["fail"]) == ["response.created", "response.failed"]
    for policy in ("retry", "resume"):
        assert lab.task(ids[policy])["status"] == "queued"
        # The requeue says so, with the response emptied (docs/recovery.md).
        assert types(ids[policy]) == ["response.created", "response.queued"]
        assert events(ids[policy])[-1]["response"]["status"] == "queued"
        assert Task.objects.get(pk=ids[policy]).worker == ""
        [attempt] = TaskAttempt.objects.filter(task_id=ids[policy])
        assert (attempt.number, attempt.end) == (1, AttemptEnd.RECOVERED)
        assert attempt.reason == "the service restarted"

    with lab.worker("after-loading") as worker:
        for policy in ("retry", "resume"):
            assert lab.wait_for(ids[policy], TERMINAL, worker)["status"] == "succeeded"
            log = events(ids[policy])
            assert_contiguous_with_one_terminal(log)
            assert [e["type"] for e in log].count("response.in_progress") == 1
            assert Task.objects.get(pk=ids[policy]).attempts == 2


def test_running_and_cancelling_tasks_killed_mid_generation(lab: Lab):
    # Long enough that none ends before the kill: the worker's model thread no longer waits for commits,
    # and each model call is slowed down (tasks_app.faults) so that no machine is fast enough to finish one.
    running = {policy: lab.create(policy, tokens=KILLED_TOKENS) for policy in RestartPolicy.values}
    cancelling = {policy: lab.create(policy, tokens=KILLED_TOKENS) for policy in RestartPolicy.values}
    every = [*running.values(), *cancelling.values()]
    with lab.worker("generators", concurrency=6, LMSP_FAULT_MODEL_CALL_SECONDS="0.002") as worker:
        for task_id in every:
            wait_for_deltas(task_id, 3, worker)
        kill_process_group(worker.proc)
    for task_id in cancelling.values():
        reply = lab.api.post(f"/lmsp/v1/tasks/{task_id}/cancel")
        assert reply.status_code == 200
        assert reply.json()["status"] == "cancelling"
    before = {task_id: events(task_id) for task_id in every}
    assert all(Task.objects.get(pk=i).status == TaskStatus.RUNNING for i in running.values())

    output = lab.recover()

    counts = summary_counts(output)
    assert (counts["failed"], counts["queued"], counts["running (to resume)"], counts["cancelled"]) == (1, 1, 1, 3)
    # fail: failed, server_restarted, one response.failed; the response keeps the text shown so far.
    fail_id = running["fail"]
    assert lab.task(fail_id)["error"]["code"] == "server_restarted"
    assert events(fail_id)[:-1] == before[fail_id]
    assert events(fail_id)[-1]["type"] == "response.failed"
    shown = deltas(before[fail_id])
    assert Response.objects.get(task__id=fail_id).output[0]["content"][0]["text"] == shown
    # cancelling: cancelled with one response.cancelled, whatever the policy.
    for task_id in cancelling.values():
        assert lab.task(task_id)["status"] == "cancelled"
        assert events(task_id)[:-1] == before[task_id]
        assert events(task_id)[-1]["type"] == "response.cancelled"
    # retry: queued, with response.queued (its output emptied); resume: still running, no event, no worker.
    retry_id, resume_id = running["retry"], running["resume"]
    assert lab.task(retry_id)["status"] == "queued"
    assert events(retry_id)[:-1] == before[retry_id]
    queued = events(retry_id)[-1]
    assert (queued["type"], queued["response"]["status"], queued["response"]["output"]) == (
        "response.queued",
        "queued",
        [],
    )
    assert not TaskSnapshot.objects.filter(task_id=retry_id).exists()
    assert lab.task(resume_id)["status"] == "running"
    assert events(resume_id) == before[resume_id]
    assert Task.objects.get(pk=resume_id).worker == ""

    assert summary_counts(lab.recover())["running (to resume)"] == 0  # a second run moves nothing

    with lab.worker("finisher") as worker:
        assert lab.wait_for(retry_id, TERMINAL, worker)["status"] == "succeeded"
        assert lab.wait_for(resume_id, TERMINAL, worker)["status"] == "succeeded"

    # retry starts over: a second response.in_progress with empty output, then a new message id.
    log = events(retry_id)
    assert_contiguous_with_one_terminal(log)
    starts = [i for i, e in enumerate(log) if e["type"] == "response.in_progress"]
    assert len(starts) == 2 and starts[0] < len(before[retry_id]) <= starts[1]
    assert log[starts[1]]["response"]["output"] == []
    items = [e["item"]["id"] for e in log if e["type"] == "response.output_item.added"]
    assert len(items) == 2 and items[0] != items[1]
    final = lab.task(retry_id)["response"]
    assert final["output"][0]["id"] == items[1]
    assert final["output"][0]["content"][0]["text"] == deltas(log[starts[1] :])
    # resume continues the same item: no event repeated or lost.
    log = events(resume_id)
    assert_contiguous_with_one_terminal(log)
    assert log[: len(before[resume_id])] == before[resume_id]
    assert [e["type"] for e in log].count("response.in_progress") == 1
    assert [e["type"] for e in log].count("response.output_item.added") == 1
    final = lab.task(resume_id)["response"]
    assert final["output"][0]["content"][0]["text"] == deltas(log)
    assert final["usage"]["output_tokens"] == KILLED_TOKENS
    assert Task.objects.get(pk=resume_id).attempts == 2


# --------------------------------------------------------------------------- #
# Cancelled before its first token, then its worker dies: recovery must not stop on it
# --------------------------------------------------------------------------- #


def recover_in_a_process(lab: Lab) -> subprocess.CompletedProcess:
    """``manage.py lmsp_recover`` as the quick start runs it: its own process, its exit status."""
    return subprocess.run(
        [sys.executable, "manage.py", "lmsp_recover", "--inspect-timeout", "0.5"],
        cwd=REPO,
        env={**os.environ, **lab.env, "LMSP_TASK_QUEUE": lab.queue},
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.parametrize("recovery", ["lmsp_recover", "reaper"])
def test_a_task_cancelled_while_loading_whose_worker_died_is_recovered_with_the_rest(
    lab: Lab, tmp_path: Path, recovery: str
):
    # Issue 24: claim (loading), cancel before the first token (cancelling), kill -9, recover. Such a
    # task has no output item; its recovery raised and stopped every task of its page with it.
    with stalled_model(lab):
        page = {policy: lab.create(policy, model="stall") for policy in RestartPolicy.values}
        cancelled = lab.create("resume", model="stall")
        with lab.worker("loader", concurrency=4) as worker:
            for task_id in (*page.values(), cancelled):
                lab.wait_for(task_id, {"loading"}, worker)
            reply = lab.api.post(f"/lmsp/v1/tasks/{cancelled}/cancel")
            assert reply.json()["status"] == "cancelling"
            kill_process_group(worker.proc)
    # A read of the response meanwhile shows it without output (it raised the same way).
    response_id = lab.task(cancelled)["response_id"]
    reply = lab.api.get(f"/lmsp/v1/responses/{response_id}")
    assert reply.status_code == 200, reply.content
    assert reply.json()["output"] == []

    if recovery == "lmsp_recover":
        done = recover_in_a_process(lab)
        assert done.returncode == 0, done.stderr
        counts = summary_counts(done.stdout)
        assert (counts["cancelled"], counts["failed"], counts["queued"]) == (1, 1, 2), done.stdout
        assert counts["could not be recovered (next round)"] == 0
    else:
        with lab.maintenance(LMSP_HEARTBEAT_TIMEOUT_SECONDS="3", LMSP_REAP_INTERVAL_SECONDS="1") as maintenance:
            assert lab.wait_for(cancelled, TERMINAL, maintenance)["status"] == "cancelled"
            for task_id in page.values():
                lab.wait_for(task_id, {"failed", "queued"}, maintenance)
        assert "Traceback" not in maintenance.log()

    assert lab.task(cancelled)["status"] == "cancelled"
    assert types(cancelled) == ["response.created", "response.cancelled"]
    assert events(cancelled)[-1]["response"]["output"] == []
    assert lab.api.get(f"/lmsp/v1/responses/{response_id}").json()["status"] == "cancelled"
    assert lab.task(page["fail"])["status"] == "failed"
    assert lab.task(page["fail"])["error"]["code"] == "server_restarted"
    for policy in ("retry", "resume"):
        assert lab.task(page[policy])["status"] == "queued"
    for task_id in (page["fail"], cancelled):
        assert_contiguous_with_one_terminal(events(task_id))


# --------------------------------------------------------------------------- #
# resume with a seed, watched through a stream that stays open across the crash
# --------------------------------------------------------------------------- #


# Structured output resumes like text: the grammar's state is rebuilt from the committed tokens.
LINES = {"type": "array", "items": {"type": "string", "maxLength": 40}, "minItems": 50, "maxItems": 50}


# A tool call resumes mid-arguments: the parser reads the committed text again, the grammar its tokens.
WRITE_LINES = {
    "type": "function",
    "name": "write_lines",
    "parameters": {
        "type": "object",
        "properties": {"lines": LINES},
        "required": ["lines"],
        "additionalProperties": False,
    },
}


def output_of(log: list[dict[str, Any]], output: str) -> str:
    """What the stream showed of the output: the text deltas, or the call's argument deltas."""
    if output != "tool_call":
        return deltas(log)
    return "".join(e["delta"] for e in log if e["type"] == "response.function_call_arguments.delta")


def final_output(response: dict[str, Any], output: str) -> str:
    item = response["output"][0]
    return item["arguments"] if output == "tool_call" else item["content"][0]["text"]


# The snapshot's rows are the same on either database for every kind of output; what the constrained kinds
# add (the grammar's state resumed with the tokens) is the engine's: those two run in the SQLite pass only.
@pytest.mark.parametrize(
    "output",
    [
        "text",
        pytest.param("json_schema", marks=pytest.mark.sqlite_pass),
        pytest.param("tool_call", marks=pytest.mark.sqlite_pass),
    ],
)
def test_resumed_generation_equals_an_uninterrupted_run_and_the_stream_stays_clean(lab: Lab, output: str):
    request: dict[str, Any] = {"temperature": 1.0, "top_p": 0.95, "seed": 4242}
    if output == "json_schema":
        # Greedy: a float32 graph resumes with one prefill, whose logits differ from the steps' by a few
        # 1e-6; a seeded draw at top_p's very edge can flip on that (docs/recovery.md), an argmax cannot.
        request = {"temperature": 0, "text": {"format": {"type": "json_schema", "name": "lines", "schema": LINES}}}
    if output == "tool_call":
        request = {"temperature": 0, "tools": [WRITE_LINES], "tool_choice": "required", "parallel_tool_calls": False}
    env = {**lab.env, "LMSP_TASK_QUEUE": lab.queue, "LMSP_STREAM_KEEPALIVE_SECONDS": "1"}
    with uvicorn_process(lab.env["DATABASE_URL"], env) as server:
        with lab.worker("reference") as worker:
            reference_id = lab.create("fail", tokens=LONG, **request)
            reference = lab.wait_for(reference_id, TERMINAL, worker)["response"]
        expected = final_output(reference, output)
        assert reference["usage"]["output_tokens"] > 200  # long enough to be killed midway

        task_id = lab.create("resume", tokens=LONG, **request)
        with open_stream(server.base, f"/lmsp/v1/tasks/{task_id}/events", token=lab.api.token) as stream:
            # A slowed device: the test must kill the worker mid-generation, and a loaded machine that starves the
            # test process let the fast demo model make all of it first (a parallel CI run's json_schema case).
            with lab.worker("crashing", LMSP_FAULT_MODEL_CALL_SECONDS="0.05") as worker:
                # created, in_progress, the opening events, then deltas (of the text, or of the call's arguments)
                first = stream.take(12)
                kill_process_group(worker.proc)
            assert Task.objects.get(pk=task_id).status == TaskStatus.RUNNING
            assert "running (to resume): 1" in lab.recover()
            with lab.worker("resuming") as worker:
                rest = stream.all()

    seen = first + rest
    assert stream.ended
    assert [event.id for event in seen] == list(range(len(seen)))
    stored = events(task_id)
    assert [json.loads(event.data) for event in seen] == stored
    assert output_of(stored, output) == expected
    result = lab.task(task_id)["response"]
    assert final_output(result, output) == expected
    assert result["usage"] == reference["usage"]
    assert Task.objects.get(pk=task_id).attempts == 2
    assert "adopted to resume" in worker.log()
    if output == "json_schema":
        # The grammar ended the array (the endless model never ends by itself) and the JSON holds.
        assert result["status"] == "completed"
        jsonschema.validate(json.loads(expected), LINES)
    if output == "tool_call":
        # Killed in the middle of the arguments, resumed: one call, the same one, whole.
        assert "response.function_call_arguments.delta" in [json.loads(event.data)["type"] for event in first]
        assert result["status"] == "completed"
        (call,) = result["output"]
        assert (call["type"], call["name"], call["call_id"]) == (
            "function_call",
            "write_lines",
            reference_output_call_id(stored),
        )
        jsonschema.validate(json.loads(expected), WRITE_LINES["parameters"])


# --------------------------------------------------------------------------- #
# Live workers are never harmed; the reaper handles workers that die while the service is up
# --------------------------------------------------------------------------- #


def test_recover_leaves_tasks_of_live_workers_alone(lab: Lab):
    with lab.worker("alive") as worker:
        # Near the whole context: still generating when recovery has waited
        # for the workers' replies, however fast the machine; cancelled below.
        busy = lab.create("fail", tokens=8000)
        wait_for_deltas(busy, 3, worker)
        waiting = lab.create("fail")

        output = lab.recover(inspect_timeout=2)

        counts = summary_counts(output)
        assert counts["held by a live worker"] == 1 and counts["left queued"] == 1, output
        assert counts["failed"] == 0
        assert f"@{os.uname().nodename}" in output  # the live worker is named
        assert Task.objects.get(pk=busy).status == TaskStatus.RUNNING
        assert lab.api.post(f"/lmsp/v1/tasks/{busy}/cancel").status_code == 200
        assert lab.wait_for(busy, TERMINAL, worker)["status"] == "cancelled"
        assert lab.wait_for(waiting, TERMINAL, worker)["status"] == "succeeded"
    assert Task.objects.get(pk=busy).attempts == 1
    assert Task.objects.get(pk=waiting).attempts == 1


def test_a_pool_process_that_dies_mid_task_has_its_task_recovered_at_once(lab: Lab):
    # No reaper runs here: only the worker's parent, which sees its child die, can recover the task.
    # A slowed device: the kill must land mid-generation, on a loaded machine too.
    with lab.worker("parent", LMSP_FAULT_MODEL_CALL_SECONDS="0.002") as worker:
        task_id = lab.create("resume", tokens=LONG)
        wait_for_deltas(task_id, 3, worker)
        child = int(Task.objects.get(pk=task_id).worker.rpartition("/")[2])
        before = events(task_id)
        os.kill(child, signal.SIGKILL)

        done = lab.wait_for(task_id, TERMINAL, worker)

    assert done["status"] == "succeeded"
    assert f"its worker process parent@{os.uname().nodename}/{child} died" in worker.log()
    log = events(task_id)
    assert_contiguous_with_one_terminal(log)
    assert log[: len(before)] == before
    assert done["response"]["output"][0]["content"][0]["text"] == deltas(log)
    task = Task.objects.get(pk=task_id)
    assert task.attempts == 2 and not task.worker.endswith(f"/{child}")


def test_restarting_only_the_web_process_leaves_a_running_task_alone(lab: Lab):
    env = {**lab.env, "LMSP_TASK_QUEUE": lab.queue}
    body = {
        "type": "response",
        "on_restart": "fail",
        "input": {"model": ENDLESS_MODEL, "input": "Go", "max_output_tokens": LONG},
    }
    # A slowed device: the task must still be running when the web process is killed, on a loaded machine too.
    with lab.worker("steady", LMSP_FAULT_MODEL_CALL_SECONDS="0.002") as worker:
        with uvicorn_process(lab.env["DATABASE_URL"], env) as first:
            status, task = call(first.base, "POST", "/lmsp/v1/tasks", token=lab.api.token, body=body)
            assert status == 202
            wait_for_deltas(task["id"], 3, worker)
            os.kill(first.pid, signal.SIGKILL)
        assert Task.objects.get(pk=task["id"]).status == TaskStatus.RUNNING
        with uvicorn_process(lab.env["DATABASE_URL"], env) as second:
            with open_stream(second.base, f"/lmsp/v1/tasks/{task['id']}/events", token=lab.api.token) as stream:
                seen = stream.all()

    assert stream.ended and seen[-1].event == "response.incomplete"
    log = events(task["id"])
    assert [json.loads(event.data) for event in seen] == log
    assert_contiguous_with_one_terminal(log)
    assert [e["type"] for e in log].count("response.in_progress") == 1
    assert Task.objects.get(pk=task["id"]).attempts == 1


def test_reaper_resumes_the_task_of_a_dead_worker_and_spares_the_live_one(lab: Lab, tmp_path: Path):
    lab.env.update(
        # Room for a loaded machine: a live worker loading its model or between commits must not look dead.
        {"LMSP_HEARTBEAT_TIMEOUT_SECONDS": "8", "LMSP_REAP_INTERVAL_SECONDS": "1", "LMSP_SWEEP_INTERVAL_SECONDS": "1"}
    )
    # A slowed device: on a fast machine the doomed worker had made all its tokens before the kill, and
    # there was nothing left to reap (a back-to-back run, 2026-12-04).
    with (
        lab.maintenance() as maintenance,
        lab.worker("doomed", LMSP_FAULT_MODEL_CALL_SECONDS="0.002") as doomed,
        lab.worker("survivor", LMSP_FAULT_MODEL_CALL_SECONDS="0.002") as survivor,
    ):
        first, second = lab.create("resume", tokens=LONG), lab.create("resume", tokens=LONG)
        for task_id in (first, second):
            wait_for_deltas(task_id, 3, survivor)
        holders = {Task.objects.get(pk=i).worker.split("@")[0]: i for i in (first, second)}
        assert set(holders) == {"doomed", "survivor"}
        victim, spared = holders["doomed"], holders["survivor"]
        before = events(victim)
        kill_process_group(doomed.proc)

        done = lab.wait_for(victim, TERMINAL, survivor)
        assert lab.wait_for(spared, TERMINAL, survivor)["status"] == "succeeded"

    assert done["status"] == "succeeded"
    assert "reaper:" in maintenance.log()
    spared_log = events(spared)
    assert_contiguous_with_one_terminal(spared_log)
    assert [e["type"] for e in spared_log].count("response.in_progress") == 1
    assert Task.objects.get(pk=spared).attempts == 1
    log = events(victim)
    assert_contiguous_with_one_terminal(log)
    assert log[: len(before)] == before
    assert [e["type"] for e in log].count("response.output_item.added") == 1
    assert done["response"]["output"][0]["content"][0]["text"] == deltas(log)
    assert Task.objects.get(pk=victim).attempts == 2
