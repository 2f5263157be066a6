"""A threads-pool worker runs many tasks in one batch: each task still gets its own text, cancel and recovery.

The worker is started as the Procfile starts it (``--pool threads``, a few
task threads that start rows, ``LMSP_MAX_BATCH`` rows): real processes, the test
database, the main Redis. Each task's final text is compared with the same
request generated alone in this process by the backend (no engine, no
batch): greedy-free seeded sampling, so a row that saw another row's logits
or random numbers would show it. The reference follows a task's text only
through the draws the batch's last-bit logit differences can turn
(``tests.support.alone``).
"""

from __future__ import annotations

from typing import Any

import pytest

from tasks_app.models import Task, TaskEvent
from tasks_app.states import TaskStatus
from tests.support.alone import alone_text
from tests.support.demo import DEMO_MODEL, ENDLESS_MODEL
from tests.support.lab import Lab
from tests.support.specs import prompt_for
from tests.support.waiting import wait_until
from tests.support.worker import kill_process_group
from tests.test_recovery import TERMINAL, deltas, events, wait_for_deltas
from workers.backends.onnx import OnnxRuntimeBackend
from workers.backends.onnx.model import OnnxModel

BATCH = "4"
BATCHED = {"LMSP_MAX_BATCH": BATCH, "LMSP_DELTA_BATCH_MS": "20"}
# For a worker whose rows must still be generating when the test cancels or kills: each model call
# waits 2 ms (tasks_app.faults), so no machine is fast enough to finish them first. Tokens are unchanged.
SLOW_DEVICE = {"LMSP_FAULT_MODEL_CALL_SECONDS": "0.002"}


@pytest.fixture
def alone(lab: Lab):
    """The text of a request generated alone, in this process, by the backend the worker uses.

    Given the text a task produced (``following``), it follows that text through the draws that
    the batch's last-bit logit differences can turn (``tests.support.alone``), and nowhere else.
    """
    loaded: dict[str, OnnxModel] = {}

    def text_of(model: str, request: dict[str, Any], *, following: str) -> str:
        if model not in loaded:
            name, _, tag = model.partition(":")
            folder = lab.models / name / tag if tag else lab.models / name
            loaded[model] = OnnxRuntimeBackend().load(folder, device="cpu")
        return alone_text(loaded[model], request, following=following)

    yield text_of
    for model in loaded.values():
        model.close()


def request(index: int, *, tokens: int) -> dict[str, Any]:
    return {
        "input": f"Tell me story number {index}",
        "max_output_tokens": tokens,
        "seed": 100 + index,
        "temperature": 0.9,
        "top_p": 0.95,
    }


def final_text(lab: Lab, task_id: str) -> str:
    return lab.task(task_id)["response"]["output"][0]["content"][0]["text"]


def most_at_once(task_ids: list[str]) -> int:
    """The most tasks that were generating at one time (each from its first to its last delta's commit)."""
    spans = []
    for task_id in task_ids:
        rows = TaskEvent.objects.filter(task_id=task_id, type="response.output_text.delta").order_by("sequence_number")
        spans.append((rows.first().created_at, rows.last().created_at))
    return max(sum(1 for start, end in spans if start <= at < end) for at, _ in spans)


def test_tasks_in_one_batch_each_get_the_text_of_their_request_alone(lab: Lab, alone) -> None:
    # The slowed device keeps the first rows generating while the later ones are created: on a fast
    # machine each task had ended before the next one arrived, and no two shared a batch (CI run).
    # Two task threads start the rows; the run loop carries them: more rows than threads run at once.
    with lab.worker("batched", pool="threads", concurrency=2, **BATCHED, **SLOW_DEVICE) as worker:
        bodies = [request(i, tokens=60 + 40 * i) for i in range(6)]
        ids = [lab.create("fail", model=ENDLESS_MODEL, **body) for body in bodies]
        for task_id in ids:
            assert lab.wait_for(task_id, TERMINAL, worker)["status"] == "succeeded"
    texts = [final_text(lab, task_id) for task_id in ids]
    assert texts == [alone(ENDLESS_MODEL, body, following=text) for body, text in zip(bodies, texts, strict=True)]
    assert all(deltas(events(task_id)) == final_text(lab, task_id) for task_id in ids)
    assert 2 < most_at_once(ids) <= int(BATCH)


def test_an_automatic_batch_runs_what_its_kv_budget_holds_and_leaves_the_rest_queued_for_other_workers(
    lab: Lab,
) -> None:
    bodies = [request(i, tokens=300) for i in range(5)]
    name, _, tag = ENDLESS_MODEL.partition(":")
    model = OnnxRuntimeBackend().load(lab.models / name / tag, device="cpu")
    try:
        # Each row reserves its prompt and its 300 output tokens: the budget holds two rows, not three.
        row_bytes = model.kv_bytes_per_position * max(len(model.prompt_ids(prompt_for(body))) + 300 for body in bodies)
    finally:
        model.close()
    # LMSP_MAX_BATCH left to its default (automatic); two task threads.
    budget = {"LMSP_KV_CACHE_BYTES": str(row_bytes * 5 // 2), "LMSP_DELTA_BATCH_MS": "20"}
    with lab.worker("automatic", pool="threads", concurrency=2, **budget, **SLOW_DEVICE) as worker:
        assert not lab.env.get("LMSP_MAX_BATCH")
        ids = [lab.create("fail", model=ENDLESS_MODEL, **body) for body in bodies]
        wait_until(
            lambda: (
                sum(TaskEvent.objects.filter(task_id=i, type="response.output_text.delta").exists() for i in ids) >= 2
            ),
            what=lambda: f"two rows never generated:\n{worker.log()[-3000:]}",
        )
        # Two rows run, and each task thread may have claimed one more that waits in the engine for room
        # (it saw the engine not yet full): the fifth was not claimed, so it is still queued, free for any
        # worker (a fixed batch of 8 would have claimed all five).
        statuses = [lab.task(task_id)["status"] for task_id in ids]
        assert statuses.count("queued") >= 1, statuses
        outcomes = [lab.wait_for(task_id, TERMINAL, worker)["status"] for task_id in ids]
    assert outcomes == ["succeeded"] * 5
    assert most_at_once(ids) == 2


def test_the_demo_model_in_a_batch_ends_each_task_as_it_would_alone(lab: Lab, alone) -> None:
    with lab.worker("batched-demo", pool="threads", concurrency=int(BATCH), **BATCHED) as worker:
        bodies = [request(i, tokens=400) for i in range(5)]
        ids = [lab.create("fail", model=DEMO_MODEL, **body) for body in bodies]
        outcomes = [lab.wait_for(task_id, TERMINAL, worker) for task_id in ids]
    assert [o["status"] for o in outcomes] == ["succeeded"] * 5
    texts = [final_text(lab, task_id) for task_id in ids]
    assert texts == [alone(DEMO_MODEL, body, following=text) for body, text in zip(bodies, texts, strict=True)]


def test_a_cancelled_row_stops_and_the_rows_beside_it_keep_their_text(lab: Lab, alone) -> None:
    with lab.worker("batched-cancel", pool="threads", concurrency=int(BATCH), **BATCHED, **SLOW_DEVICE) as worker:
        bodies = [request(i, tokens=400) for i in range(4)]
        ids = [lab.create("fail", model=ENDLESS_MODEL, **body) for body in bodies]
        for task_id in ids:
            wait_for_deltas(task_id, 3, worker)
        victim = ids[1]
        reply = lab.api.post(f"/lmsp/v1/tasks/{victim}/cancel")
        assert reply.status_code == 200
        assert lab.wait_for(victim, TERMINAL, worker)["status"] == "cancelled"
        others = [task_id for task_id in ids if task_id != victim]
        for task_id in others:
            assert lab.wait_for(task_id, TERMINAL, worker)["status"] == "succeeded"
    assert events(victim)[-1]["type"] == "response.cancelled"
    for task_id, body in zip(ids, bodies, strict=True):
        if task_id != victim:
            text = final_text(lab, task_id)
            assert text == alone(ENDLESS_MODEL, body, following=text), task_id


def test_a_killed_batched_worker_loses_every_row_and_each_is_recovered_by_its_policy(lab: Lab, alone) -> None:
    policies = ["resume", "retry", "fail", "resume"]
    bodies = [request(i, tokens=600) for i in range(len(policies))]
    with lab.worker("batched-victim", pool="threads", concurrency=int(BATCH), **BATCHED, **SLOW_DEVICE) as worker:
        ids = [lab.create(policy, model=ENDLESS_MODEL, **body) for policy, body in zip(policies, bodies, strict=True)]
        for task_id in ids:
            wait_for_deltas(task_id, 3, worker)
        kill_process_group(worker.proc)
    shown = {task_id: deltas(events(task_id)) for task_id in ids}
    assert all(Task.objects.get(pk=task_id).status == TaskStatus.RUNNING for task_id in ids)
    lab.recover()
    with lab.worker("batched-finisher", pool="threads", concurrency=int(BATCH), **BATCHED) as worker:
        outcomes = {task_id: lab.wait_for(task_id, TERMINAL, worker) for task_id in ids}
    for task_id, policy, body in zip(ids, policies, bodies, strict=True):
        if policy == "fail":
            assert outcomes[task_id]["status"] == "failed"
            assert outcomes[task_id]["error"]["code"] == "server_restarted"
            continue
        assert outcomes[task_id]["status"] == "succeeded", (policy, outcomes[task_id])
        text = final_text(lab, task_id)
        assert text == alone(ENDLESS_MODEL, body, following=text), policy
        if policy == "resume":
            # The same output item, continued right after what was committed before the kill.
            assert final_text(lab, task_id).startswith(shown[task_id])
            assert Task.objects.get(pk=task_id).attempts == 2
