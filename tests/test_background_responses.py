"""OpenAI's background mode on the durable tasks, with the ``openai`` package as the real client.

``responses.create(background=True)`` answers at once with the response
``queued``; ``retrieve`` follows it (live status, the output committed so
far); ``cancel`` and ``delete`` work as OpenAI documents them; a background
stream cut mid-way resumes with ``starting_after``; a background response
with ``on_restart: resume`` whose worker is killed continues after recovery;
and every error the package raises names the problem's code in ``str(exc)``.
"""

from __future__ import annotations

import json
from typing import Any

import openai
import pytest

from tasks_app.models import Response, Task, TaskEvent
from tasks_app.states import TaskStatus
from tests.support.demo import ENDLESS_MODEL
from tests.support.logs import assert_well_formed_log, delta_text, stored
from tests.support.server import uvicorn_process
from tests.support.waiting import wait_until
from tests.support.worker import kill_process_group

RUNNING_OR_WAITING = {"queued", "in_progress"}


def sdk_for(base: str, token: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base}/lmsp/v1", api_key=token, max_retries=0, timeout=60)


@pytest.fixture
def sdk(api, web_server) -> openai.OpenAI:
    return sdk_for(web_server.base, api.token)


def final(sdk: openai.OpenAI, response_id: str) -> Any:
    """``retrieve`` until the response has ended."""

    def probe() -> Any:
        response = sdk.responses.retrieve(response_id)
        return response if response.status not in RUNNING_OR_WAITING else None

    return wait_until(probe, what=f"response {response_id} did not end", timeout=120)


def log_of(response_id: str) -> list[dict[str, Any]]:
    """The response's event log, as the payloads clients were sent."""
    return [json.loads(payload) for _, _, payload in stored(Task.objects.get(response_id=response_id).pk)]


def test_a_background_response_is_answered_queued_then_runs_to_the_text_of_its_events(sdk, running_worker):
    created = sdk.responses.create(
        model="demo", input="Tell me something", max_output_tokens=24, background=True, extra_body={"seed": 5}
    )

    assert (created.status, created.background, created.output) == ("queued", True, [])
    done = final(sdk, created.id)
    payloads = log_of(created.id)
    assert_well_formed_log(payloads)
    assert done.status in {"completed", "incomplete"}
    assert done.output_text == delta_text(payloads)
    assert done.usage.output_tokens == payloads[-1]["response"]["usage"]["output_tokens"]
    task = Task.objects.get(response_id=created.id)
    assert (task.on_restart, task.notify_webhooks) == ("fail", True)
    # The task is an ordinary task: listed, with the same response once it succeeded.
    assert sdk.get(f"/tasks/{task.pk}", cast_to=object)["response"]["id"] == created.id


def test_retrieve_shows_the_text_committed_so_far_then_cancel_twice_then_delete(sdk, running_worker):
    created = sdk.responses.create(model=ENDLESS_MODEL, input="Go on", max_output_tokens=3000, background=True)

    def running_with_text() -> Any:
        response = sdk.responses.retrieve(created.id)
        return response if response.status == "in_progress" and response.output_text else None

    live = wait_until(running_with_text, what="the response never showed text while running")
    assert live.output[0].status == "in_progress"
    cancelled = sdk.responses.cancel(created.id)
    again = sdk.responses.cancel(created.id)

    assert cancelled.status == "cancelled"
    assert again.model_dump() == cancelled.model_dump()
    payloads = log_of(created.id)
    assert payloads[-1]["type"] == "response.cancelled"
    # What the first read showed is what the log held then; the cancelled response keeps all of the log's text.
    assert cancelled.output_text.startswith(live.output_text)
    assert cancelled.output_text == delta_text(payloads)
    task_id = Task.objects.get(response_id=created.id).pk

    sdk.responses.delete(created.id)

    assert not Response.objects.filter(pk=created.id).exists()
    assert not Task.objects.filter(pk=task_id).exists()
    assert not TaskEvent.objects.filter(task_id=task_id).exists()
    with pytest.raises(openai.NotFoundError) as missing:
        sdk.responses.retrieve(created.id)
    assert "response_not_found" in str(missing.value)


def test_a_running_response_cannot_be_deleted_and_a_finished_one_cannot_be_cancelled(sdk, running_worker):
    done = sdk.responses.create(model="demo", input="Hi", max_output_tokens=4)
    running = sdk.responses.create(model=ENDLESS_MODEL, input="Go", max_output_tokens=8000, background=True)

    with pytest.raises(openai.ConflictError) as deleting:
        sdk.responses.delete(running.id)
    with pytest.raises(openai.ConflictError) as cancelling:
        sdk.responses.cancel(done.id)

    assert "response_not_finished" in str(deleting.value)
    assert "task_not_cancelable" in str(cancelling.value)
    assert Response.objects.filter(pk=running.id).exists()
    assert sdk.responses.retrieve(done.id).status == done.status
    assert sdk.responses.cancel(running.id).status == "cancelled"


def test_a_background_stream_cut_midway_resumes_with_starting_after(sdk, running_worker):
    stream = sdk.responses.create(model=ENDLESS_MODEL, input="Go", max_output_tokens=400, background=True, stream=True)
    first = []
    for event in stream:
        first.append(event)
        if len(first) == 10:
            break
    stream.close()
    response_id = first[0].response.id

    rest = list(sdk.responses.retrieve(response_id, stream=True, starting_after=first[-1].sequence_number))

    seen = first + rest
    assert first[0].response.status == "queued" and first[0].response.background is True
    assert [event.sequence_number for event in seen] == list(range(len(seen)))
    logged = log_of(response_id)
    assert [(e.sequence_number, e.type) for e in seen] == [(p["sequence_number"], p["type"]) for p in logged]
    assert seen[-1].type == "response.incomplete"
    assert final(sdk, response_id).output_text == delta_text([event.model_dump() for event in seen])


def test_a_background_response_to_resume_continues_after_its_worker_was_killed(lab):
    env = {**lab.env, "LMSP_TASK_QUEUE": lab.queue}
    with uvicorn_process(lab.env["DATABASE_URL"], env) as server:
        sdk = sdk_for(server.base, lab.api.token)
        # A slowed device: the kill must land mid-generation, on a loaded machine too.
        with lab.worker("crashing", LMSP_FAULT_MODEL_CALL_SECONDS="0.002") as worker:
            created = sdk.responses.create(
                model=ENDLESS_MODEL,
                input="Tell me a long story",
                max_output_tokens=3000,
                background=True,
                extra_body={"on_restart": "resume", "seed": 7, "temperature": 1.0},
            )
            before = wait_until(
                lambda: (r := sdk.responses.retrieve(created.id)).output_text and len(r.output_text) > 20 and r,
                what="the response showed no text before the kill",
            )
            kill_process_group(worker.proc)
        assert Task.objects.get(response_id=created.id).status == TaskStatus.RUNNING
        assert "running (to resume): 1" in lab.recover()
        with lab.worker("resuming"):
            done = final(sdk, created.id)

    payloads = log_of(created.id)
    assert_well_formed_log(payloads)
    task = Task.objects.get(response_id=created.id)
    assert (task.on_restart, task.attempts, done.status) == ("resume", 2, "incomplete")
    # The same output item goes on: what was shown before the kill is the start of the whole text.
    assert done.output_text.startswith(before.output_text)
    assert done.output_text == delta_text(payloads)
    assert done.usage.output_tokens == 3000


def test_every_error_the_package_raises_names_the_problems_code(transactional_db, api, web_server, make_client):
    sdk = sdk_for(web_server.base, api.token)
    _, reader_token = make_client("reader", scopes="read")
    calls = {
        "invalid_request": lambda: sdk.responses.create(model="demo", input="x", extra_body={"colour": "red"}),
        "model_not_found": lambda: sdk.responses.create(model="no-such-model", input="x", background=True),
        "unauthorized": lambda: sdk_for(web_server.base, "wrong").responses.retrieve("resp_x"),
        "insufficient_scope": lambda: sdk_for(web_server.base, reader_token).responses.create(
            model="demo", input="x", background=True
        ),
        "response_not_found": lambda: sdk.responses.cancel("resp_01J8M8R5X4B9D2F6H1K3N7Q0ZW"),
    }
    for code, call in calls.items():
        with pytest.raises(openai.APIStatusError) as raised:
            call()
        assert code in str(raised.value), (code, str(raised.value))
        assert raised.value.code == code
        # The RFC 9457 body is all there, the package's member beside it.
        assert raised.value.response.json()["code"] == code
        assert raised.value.response.headers["content-type"].startswith("application/problem+json")
    with pytest.raises(openai.BadRequestError) as unknown:
        calls["invalid_request"]()
    assert unknown.value.param == "colour"
    assert "colour: unknown field" in str(unknown.value)


def test_background_needs_store_and_retry_needs_a_key(api):
    no_store = api.post("/lmsp/v1/responses", {"model": "demo", "input": "x", "background": True, "store": False})
    no_key = api.post("/lmsp/v1/responses", {"model": "demo", "input": "x", "background": True, "on_restart": "retry"})

    assert (no_store.status_code, no_store.json()["errors"][0]["field"]) == (400, "store")
    assert (no_key.status_code, no_key.json()["errors"][0]["field"]) == (400, "Idempotency-Key")
    assert not Task.objects.exists()


def test_a_background_request_retried_with_its_key_gets_its_first_answer(api, queue):
    body = {"model": "demo", "input": "x", "background": True, "on_restart": "retry"}
    headers = {"Idempotency-Key": "bg-once"}

    first = api.post("/lmsp/v1/responses", body, headers=headers)
    again = api.post("/lmsp/v1/responses", body, headers=headers)

    assert first.status_code == again.status_code == 200
    assert again.headers["Idempotent-Replayed"] == "true"
    assert again.json() == first.json()
    assert first.json()["status"] == "queued" and first.json()["queue_position"] == 1
    assert Task.objects.get().on_restart == "retry"


# --------------------------------------------------------------------------- #
# Queue position
# --------------------------------------------------------------------------- #


def test_queued_tasks_and_background_responses_show_their_place_in_the_line(api, queue):
    tasks = [api.create_task(f"task {n}").json() for n in range(2)]
    responses = [
        api.post("/lmsp/v1/responses", {"model": "demo", "input": f"r {n}", "background": True}).json()
        for n in range(2)
    ]
    third = api.create_task("last").json()

    assert [t["queue_position"] for t in tasks] + [third["queue_position"]] == [1, 2, 5]
    assert [r["queue_position"] for r in responses] == [3, 4]
    api.post(f"/lmsp/v1/tasks/{tasks[0]['id']}/cancel")
    api.post(f"/lmsp/v1/responses/{responses[0]['id']}/cancel")
    listed = {t["id"]: t["queue_position"] for t in api.get("/lmsp/v1/tasks").json()["data"]}
    read = api.get(f"/lmsp/v1/responses/{responses[1]['id']}").json()

    assert listed == {
        tasks[0]["id"]: None,
        tasks[1]["id"]: 1,
        Task.objects.get(response_id=responses[0]["id"]).pk: None,
        Task.objects.get(response_id=responses[1]["id"]).pk: 2,
        third["id"]: 3,
    }
    assert (read["status"], read["queue_position"]) == ("queued", 2)
    assert api.get(f"/lmsp/v1/tasks/{third['id']}").json()["queue_position"] == 3
    # The event log records the acceptance, not a place that changes: its copy says null.
    assert json.loads(stored(third["id"])[0][2])["response"]["queue_position"] is None


def test_reading_a_queued_response_costs_a_fixed_number_of_queries(api, queue, django_assert_num_queries):
    for n in range(5):
        api.create_task(f"ahead {n}")
    created = api.post("/lmsp/v1/responses", {"model": "demo", "input": "x", "background": True}).json()
    api.get(f"/lmsp/v1/responses/{created['id']}")  # the client's last-used stamp settles

    # The client, the response with its task, the count of the line ahead.
    with django_assert_num_queries(3):
        read = api.get(f"/lmsp/v1/responses/{created['id']}")
    assert read.json()["queue_position"] == 6
