"""Tasks run end to end: HTTP API -> Redis -> a real ``celery worker`` -> ONNX Runtime -> database."""

from __future__ import annotations

import json
import os
import shutil
import threading
from pathlib import Path
from typing import Any

import jinja2
import pytest
from tokenizers import Tokenizer

from fixture_models.demo import CHAT_TEMPLATE
from tasks_app.models import Task, TaskEvent
from tasks_app.registry.scan import model_scan
from tasks_app.selectors.tasks import task_snapshot_get
from tasks_app.services.dispatch import task_dispatch
from tasks_app.states import TaskStatus
from tests.support.demo import ENDLESS_MODEL
from tests.support.logs import assert_well_formed_log, delta_text
from tests.support.tasks import create, wait_for_status
from tests.support.waiting import wait_until

TERMINAL = {"succeeded", "failed", "cancelled"}


def events_of(task_id: str) -> list[dict[str, Any]]:
    rows = TaskEvent.objects.filter(task_id=task_id).order_by("sequence_number")
    return [json.loads(row.payload) for row in rows]


def prompt_token_count(models_root: Path, messages: list[dict[str, str]]) -> int:
    """Input tokens as the tokenizer counts them, rendered independently of the backend."""
    tokenizer = Tokenizer.from_file(str(models_root / "demo" / "tokenizer.json"))
    text = jinja2.Environment().from_string(CHAT_TEMPLATE).render(messages=messages, add_generation_prompt=True)
    return len(tokenizer.encode(text, add_special_tokens=False).ids)


def test_task_runs_to_the_end_and_its_log_matches_its_response(api, running_worker, worker_models_root):
    task = create(api, "Write a haiku about rivers", instructions="Be brief.", max_output_tokens=40, seed=7)

    done = wait_for_status(api, task["id"], TERMINAL)

    assert done["status"] == "succeeded"
    response = done["response"]
    # The demo model never samples its end token, so the limit ends it.
    assert response["status"] == "incomplete"
    assert response["incomplete_details"] == {"reason": "max_output_tokens"}
    events = events_of(task["id"])
    assert_well_formed_log(events)
    types = [e["type"] for e in events]
    assert types[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert types[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.incomplete",
    ]
    assert set(types[4:-4]) == {"response.output_text.delta"}
    text = response["output"][0]["content"][0]["text"]
    assert text
    assert text == delta_text(events)
    assert events[-4]["text"] == text
    item_id = response["output"][0]["id"]
    assert item_id.startswith("msg_")
    assert {e["item_id"] for e in events if e["type"] == "response.output_text.delta"} == {item_id}
    assert events[-1]["response"] == response
    usage = response["usage"]
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Write a haiku about rivers"}]
    assert usage["input_tokens"] == prompt_token_count(worker_models_root, messages)
    assert usage["output_tokens"] == 40
    assert usage["total_tokens"] == usage["input_tokens"] + 40
    assert api.get(f"/lmsp/v1/responses/{task['response_id']}").json() == response

    row = Task.objects.get(pk=task["id"])
    assert row.attempts == 1
    assert row.output_tokens == 40
    assert row.worker.startswith("test@")
    assert row.heartbeat_at is not None
    assert task_snapshot_get(task_id=task["id"]) is None  # a finished task keeps no snapshot
    assert "CPUExecutionProvider" in running_worker.log()


def test_same_seed_gives_the_same_text_and_greedy_ignores_the_seed(api, running_worker):
    sampled = [create(api, "Once upon a time", max_output_tokens=30, temperature=1.0, seed=42) for _ in range(2)]
    greedy = [create(api, "Once upon a time", max_output_tokens=30, temperature=0, seed=s) for s in (1, 2)]
    other = create(api, "Once upon a time", max_output_tokens=30, temperature=1.0, seed=43)

    texts = {}
    for task in [*sampled, *greedy, other]:
        body = wait_for_status(api, task["id"], TERMINAL)
        texts[task["id"]] = body["response"]["output"][0]["content"][0]["text"]

    assert texts[sampled[0]["id"]] == texts[sampled[1]["id"]]
    assert texts[greedy[0]["id"]] == texts[greedy[1]["id"]]
    assert texts[other["id"]] != texts[sampled[0]["id"]]


def test_stop_string_ends_the_response_before_it(api, running_worker):
    first = create(api, "Name three colours", max_output_tokens=30, temperature=0)
    text = wait_for_status(api, first["id"], TERMINAL)["response"]["output"][0]["content"][0]["text"]
    stop = text[10:14]
    assert stop.strip()

    second = create(api, "Name three colours", max_output_tokens=30, temperature=0, stop=[stop])
    done = wait_for_status(api, second["id"], TERMINAL)

    response = done["response"]
    assert response["status"] == "completed"
    assert response["incomplete_details"] is None
    stopped = response["output"][0]["content"][0]["text"]
    assert stopped == text[: text.index(stop)]
    assert stop not in stopped
    assert stopped == delta_text(events_of(second["id"]))


def test_cancel_while_running_keeps_the_partial_output(api, running_worker):
    task = create(api, "Write a very long report", model=ENDLESS_MODEL, max_output_tokens=100_000)
    wait_until(
        TaskEvent.objects.filter(task_id=task["id"], type="response.output_text.delta").exists,
        what="no delta arrived",
    )
    # Progress shows while it runs (the admin's "output tokens" column).
    growing = wait_until(lambda: Task.objects.get(pk=task["id"]).output_tokens, what="no output tokens were counted")
    assert Task.objects.get(pk=task["id"]).cancel_requested_at is None

    reply = api.post(f"/lmsp/v1/tasks/{task['id']}/cancel")

    assert reply.status_code == 200
    assert reply.json()["status"] in {"cancelling", "cancelled"}
    done = wait_for_status(api, task["id"], TERMINAL)
    assert done["status"] == "cancelled"
    assert done["response"] is None
    events = events_of(task["id"])
    assert_well_formed_log(events)
    assert events[-1]["type"] == "response.cancelled"
    cancelled = events[-1]["response"]
    assert cancelled["status"] == "cancelled"
    partial = cancelled["output"][0]["content"][0]["text"]
    assert partial == delta_text(events)
    # Stopped long before the context window ran out.
    assert cancelled["usage"]["output_tokens"] < 8000
    assert api.get(f"/lmsp/v1/responses/{task['response_id']}").json()["output"] == cancelled["output"]
    row = Task.objects.get(pk=task["id"])
    # The count is of committed tokens: never more than the response's usage.
    assert growing <= row.output_tokens <= cancelled["usage"]["output_tokens"]
    assert row.cancel_requested_at is not None
    assert row.cancel_requested_at <= row.updated_at


def test_cancel_while_queued_then_the_message_arrives(api, running_worker, settings):
    # Nobody consumes this queue, so the task stays queued.
    settings.LMSP_TASK_QUEUE = settings.LMSP_REDIS_PREFIX + "-nobody"
    task = create(api, "Hi", max_output_tokens=5)
    assert api.post(f"/lmsp/v1/tasks/{task['id']}/cancel").json()["status"] == "cancelled"

    settings.LMSP_TASK_QUEUE = running_worker.queue
    assert task_dispatch(task_id=task["id"])
    running_worker.wait_for_log(f"dropped message for task {task['id']}")

    row = Task.objects.get(pk=task["id"])
    assert row.status == TaskStatus.CANCELLED
    assert row.attempts == 0
    assert [e["type"] for e in events_of(task["id"])] == ["response.created", "response.cancelled"]


def test_duplicate_delivery_runs_the_task_once(api, running_worker):
    task = create(api, "Hello twice", max_output_tokens=20)
    # The same message two more times, as a redelivery or the sweeper would send it.
    assert task_dispatch(task_id=task["id"])
    assert task_dispatch(task_id=task["id"])

    done = wait_for_status(api, task["id"], TERMINAL)
    running_worker.wait_for_log(f"dropped message for task {task['id']}")

    assert done["status"] == "succeeded"
    events = events_of(task["id"])
    assert_well_formed_log(events)
    assert [e["type"] for e in events].count("response.in_progress") == 1
    assert Task.objects.get(pk=task["id"]).attempts == 1


def test_cancel_racing_the_last_token_ends_in_one_consistent_state(api, running_worker):
    """Cancels land before, during and after each task's final commit; the outcome always agrees."""
    # Long enough that a cancel sent right after a few of them starts finds it running: the batch
    # engine decodes without waiting for commits, so a 4-token task is often over before a cancel.
    tasks = [create(api, f"Race {n}", max_output_tokens=8 + 8 * (n % 7)) for n in range(24)]
    # And one that no machine finishes before its cancel: a test process starved by a loaded machine
    # saw every short task end first (all 24 "succeeded"), and the log checks below then met no cancel.
    tasks.append(create(api, "Race long", model=ENDLESS_MODEL, max_output_tokens=4000))
    replies: dict[str, int] = {}
    for n, task in enumerate(tasks):
        # Spread the cancels over the short life of each task.
        if n % 3:
            wait_for_status(api, task["id"], {"running", *TERMINAL})
        replies[task["id"]] = api.post(f"/lmsp/v1/tasks/{task['id']}/cancel").status_code

    outcomes = set()
    for task in tasks:
        done = wait_for_status(api, task["id"], TERMINAL)
        events = events_of(task["id"])
        assert_well_formed_log(events)
        if replies[task["id"]] == 409:
            # It ended first: at its token limit, or at the end token the demo model may sample.
            assert done["status"] == "succeeded"
            assert events[-1]["type"] in {"response.completed", "response.incomplete"}
            assert events[-1]["response"] == done["response"]
            assert done["response"]["status"] == events[-1]["type"].removeprefix("response.")
        else:
            assert replies[task["id"]] == 200
            assert done["status"] == "cancelled"
            assert events[-1]["type"] == "response.cancelled"
            output = events[-1]["response"]["output"]
            assert delta_text(events) == (output[0]["content"][0]["text"] if output else "")
        outcomes.add(done["status"])
    assert "cancelled" in outcomes


def _copy_demo(root: Path, name: str) -> Path:
    target = root / name
    if target.exists():
        shutil.rmtree(target)
    shutil.copytree(root / "demo", target)
    return target


def test_a_model_that_fails_to_load_fails_the_task_and_the_worker_goes_on(
    api, running_worker, worker_models_root, settings
):
    broken = _copy_demo(worker_models_root, "broken")
    (broken / "model.onnx").write_bytes(b"this is not an onnx model")
    try:
        model_scan(models_dir=worker_models_root)
        response = api.post("/lmsp/v1/tasks", {"type": "response", "input": {"model": "broken", "input": "Hi"}})
        task = response.json()

        done = wait_for_status(api, task["id"], TERMINAL)

        assert done["status"] == "failed"
        assert done["error"]["code"] == "model_load_failed"
        assert done["error"]["status"] == 500
        assert "Traceback" not in done["error"]["detail"]
        events = events_of(task["id"])
        assert [e["type"] for e in events] == ["response.created", "response.failed"]
        assert events[-1]["response"]["error"] == done["error"]

        after = create(api, "Still alive?", max_output_tokens=5)
        assert wait_for_status(api, after["id"], TERMINAL)["status"] == "succeeded"
        assert Task.objects.get(pk=after["id"]).worker == Task.objects.get(pk=task["id"]).worker
    finally:
        shutil.rmtree(broken)


def over_the_context(api) -> str:
    """A prompt of more tokens than the demo model's context holds (a word is at least a token)."""
    return "word " * (api.get("/lmsp/v1/models/demo").json()["context_length"] + 800)


def test_a_prompt_longer_than_the_context_fails_with_context_length_exceeded(api, running_worker):
    # PROFILE.md 10.1: without `truncation: auto` an overflow is the client's context_length_exceeded.
    task = create(api, over_the_context(api), max_output_tokens=5)

    done = wait_for_status(api, task["id"], TERMINAL)

    assert done["status"] == "failed"
    assert done["error"]["code"] == "context_length_exceeded"
    assert done["error"]["status"] == 400
    assert "context" in done["error"]["detail"]
    assert_well_formed_log(events_of(task["id"]))
    after = create(api, "Still alive?", max_output_tokens=5)
    assert wait_for_status(api, after["id"], TERMINAL)["status"] == "succeeded"


def test_a_foreground_response_longer_than_the_context_is_answered_as_its_stored_failed_response(api, running_worker):
    # docs/api.md: the web app has no tokenizer, so the response exists by the time the worker finds the overflow.
    reply = api.post("/lmsp/v1/responses", {"model": "demo", "input": over_the_context(api), "max_output_tokens": 5})

    assert reply.status_code == 200, reply.content
    body = reply.json()
    assert (body["status"], body["error"]["code"], body["output"]) == ("failed", "context_length_exceeded", [])
    assert body["error"]["message"] == f"context_length_exceeded: {body['error']['detail']}"
    assert api.get(f"/lmsp/v1/responses/{body['id']}").json() == body


def test_cancel_while_loading(api, running_worker, worker_models_root):
    """A model whose config.json is a pipe keeps the worker in ``loading`` until the test writes it."""
    name = f"slow{os.getpid()}"
    folder = _copy_demo(worker_models_root, name)
    config = (folder / "config.json").read_bytes()
    try:
        model_scan(models_dir=worker_models_root)
        (folder / "config.json").unlink()
        os.mkfifo(folder / "config.json")
        response = api.post("/lmsp/v1/tasks", {"type": "response", "input": {"model": name, "input": "Hi"}})
        task = response.json()
        wait_for_status(api, task["id"], {"loading"})
        claimed_beat = Task.objects.get(pk=task["id"]).heartbeat_at
        # The worker is stuck in the load, yet it keeps reporting (every second in these tests).
        wait_until(
            lambda: Task.objects.get(pk=task["id"]).heartbeat_at > claimed_beat,
            what="no heartbeat while the model loads",
        )

        reply = api.post(f"/lmsp/v1/tasks/{task['id']}/cancel")
        assert reply.json()["status"] == "cancelling"

        def feed() -> None:
            with open(folder / "config.json", "wb") as pipe:
                pipe.write(config)

        feeder = threading.Thread(target=feed, daemon=True)
        feeder.start()
        done = wait_for_status(api, task["id"], TERMINAL)
        feeder.join(timeout=10)

        assert done["status"] == "cancelled"
        assert [e["type"] for e in events_of(task["id"])] == ["response.created", "response.cancelled"]
    finally:
        shutil.rmtree(folder)


def test_post_responses_waits_and_returns_the_response(api, running_worker):
    body = {"model": "demo", "input": "Say hello", "max_output_tokens": 12, "seed": 3}

    first = api.post("/lmsp/v1/responses", body, headers={"Idempotency-Key": "sync-1"})

    assert first.status_code == 200
    response = first.json()
    assert response["object"] == "response"
    assert response["status"] == "incomplete"
    assert response["usage"]["output_tokens"] == 12
    assert api.get(f"/lmsp/v1/responses/{response['id']}").json() == response
    again = api.post("/lmsp/v1/responses", body, headers={"Idempotency-Key": "sync-1"})
    assert again.status_code == 200
    assert again["Idempotent-Replayed"] == "true"
    assert again.content == first.content
    task = Task.objects.get(response_id=response["id"])
    assert delta_text(events_of(task.id)) == response["output"][0]["content"][0]["text"]


def test_post_responses_refuses_bad_input_as_a_problem(api, running_worker):
    reply = api.post("/lmsp/v1/responses", {"model": "demo", "input": "x", "bogus": 1})

    assert reply.status_code == 400
    assert reply["Content-Type"] == "application/problem+json"
    assert reply.json()["errors"][0]["field"] == "bogus"
    assert not Task.objects.exists()


@pytest.mark.parametrize("method", ["get", "put"])
def test_post_responses_is_the_only_method(api, method):
    reply = getattr(api.http, method)("/lmsp/v1/responses", headers={"Authorization": f"Bearer {api.token}"})
    assert reply.status_code == 405


def test_a_short_prompt_starts_and_commits_its_first_delta_in_one_transaction(api, running_patient_fold_worker):
    """The start waits for the first token (up to LMSP_START_FOLD_MS): one commit shows both."""
    task = create(api, "Say something", max_output_tokens=60, seed=3)
    done = wait_for_status(api, task["id"], TERMINAL)
    assert done["status"] == "succeeded"
    rows = list(TaskEvent.objects.filter(task_id=task["id"]).order_by("sequence_number"))
    types = [row.type for row in rows]
    first_delta = types.index("response.output_text.delta")
    assert types[1:first_delta] == ["response.in_progress", "response.output_item.added", "response.content_part.added"]
    # One transaction stamps its events with one time: the start's events and the first delta(s) share it.
    started_at = rows[1].created_at
    assert rows[first_delta].created_at == started_at
    assert rows[0].created_at < started_at  # the create is its own commit, before
    assert_well_formed_log([json.loads(row.payload) for row in rows])
    text = done["response"]["output"][0]["content"][0]["text"]
    assert text == delta_text([json.loads(row.payload) for row in rows])
