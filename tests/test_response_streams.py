"""``POST /responses`` with ``stream: true`` and ``GET /responses/{id}?stream=true`` over a live server."""

from __future__ import annotations

import json

import openai

from tasks_app.models import Task, TaskEvent
from tests.support.logs import as_rows, assert_well_formed_log, delta_text, stored
from tests.support.sse import TERMINAL_TYPES, call, open_stream

BODY = {"model": "demo", "input": "Say something", "max_output_tokens": 24, "seed": 11, "stream": True}


def test_a_streamed_response_is_its_tasks_event_log(api, running_worker, web_server):
    with open_stream(web_server.base, "/lmsp/v1/responses", token=api.token, method="POST", body=BODY) as stream:
        assert stream.status == 200
        events = stream.all()

    assert stream.ended
    response_id = events[0].payload["response"]["id"]
    task = Task.objects.get(response_id=response_id)
    assert as_rows(events) == stored(task.pk)
    payloads = [event.payload for event in events]
    assert_well_formed_log(payloads)
    status, body = call(web_server.base, "GET", f"/lmsp/v1/responses/{response_id}", token=api.token)
    assert status == 200
    assert delta_text(payloads) == body["output"][0]["content"][0]["text"]
    assert body["usage"]["output_tokens"] == 24


def test_a_streamed_request_retried_with_its_key_streams_the_same_task_again(api, running_worker, web_server):
    headers = {"Idempotency-Key": "stream-once"}
    with open_stream(
        web_server.base, "/lmsp/v1/responses", token=api.token, method="POST", body=BODY, headers=headers
    ) as first:
        events = first.all()
    tasks_before = Task.objects.count()

    with open_stream(
        web_server.base, "/lmsp/v1/responses", token=api.token, method="POST", body=BODY, headers=headers
    ) as again:
        assert again.headers["idempotent-replayed"] == "true"
        replayed = again.all()
    with open_stream(
        web_server.base,
        "/lmsp/v1/responses",
        token=api.token,
        method="POST",
        body=BODY,
        headers={**headers, "Last-Event-ID": "5"},
    ) as resumed:
        rest = resumed.all()

    assert Task.objects.count() == tasks_before
    assert as_rows(replayed) == as_rows(events)
    assert as_rows(rest) == as_rows(events)[6:]
    other_body = open_stream(
        web_server.base,
        "/lmsp/v1/responses",
        token=api.token,
        method="POST",
        body={**BODY, "seed": 12},
        headers=headers,
    )
    assert (other_body.status, json.loads(other_body.body)["code"]) == (422, "idempotency_key_reused")


def test_errors_before_the_stream_are_plain_problems_and_create_nothing(api, transactional_db, web_server):
    before = (Task.objects.count(), TaskEvent.objects.count())

    unknown_model = open_stream(
        web_server.base, "/lmsp/v1/responses", token=api.token, method="POST", body={**BODY, "model": "nope"}
    )
    bad_field = open_stream(
        web_server.base, "/lmsp/v1/responses", token=api.token, method="POST", body={**BODY, "colour": "red"}
    )
    no_token = open_stream(web_server.base, "/lmsp/v1/responses", method="POST", body=BODY)

    for reply, status, code in (
        (unknown_model, 400, "model_not_found"),
        (bad_field, 400, "invalid_request"),
        (no_token, 401, "unauthorized"),
    ):
        assert reply.status == status
        assert reply.headers["content-type"] == "application/problem+json"
        assert json.loads(reply.body)["code"] == code
    assert (Task.objects.count(), TaskEvent.objects.count()) == before


def test_a_stored_response_streams_again_from_a_cursor(api, running_worker, web_server):
    with open_stream(web_server.base, "/lmsp/v1/responses", token=api.token, method="POST", body=BODY) as stream:
        events = stream.all()
    response_id = events[0].payload["response"]["id"]
    path = f"/lmsp/v1/responses/{response_id}"

    with open_stream(web_server.base, f"{path}?stream=true&starting_after=3", token=api.token) as resumed:
        assert as_rows(resumed.all()) == as_rows(events)[4:]
    plain = open_stream(web_server.base, f"{path}?stream=false", token=api.token)
    bogus = open_stream(web_server.base, f"{path}?stream=maybe", token=api.token)
    at_end = open_stream(web_server.base, f"{path}?stream=true&starting_after={events[-1].id}", token=api.token)

    assert (plain.status, json.loads(plain.body)["id"]) == (200, response_id)
    assert (bogus.status, json.loads(bogus.body)["errors"][0]["field"]) == (400, "stream")
    assert at_end.status == 204


def test_the_openai_package_creates_streams_and_resumes_a_response(api, running_worker, web_server):
    sdk = openai.OpenAI(base_url=f"{web_server.base}/lmsp/v1", api_key=api.token, max_retries=0, timeout=60)

    events = list(
        sdk.responses.create(
            model="demo", input="Hello there", max_output_tokens=16, stream=True, extra_body={"seed": 4}
        )
    )

    assert events[0].type == "response.created"
    assert events[-1].type in TERMINAL_TYPES
    assert [event.sequence_number for event in events] == list(range(len(events)))
    text = "".join(event.delta for event in events if event.type == "response.output_text.delta")
    response_id = events[0].response.id
    resumed = list(sdk.responses.retrieve(response_id, stream=True, starting_after=5))
    assert [event.sequence_number for event in resumed] == list(range(6, len(events)))
    assert [event.type for event in resumed] == [event.type for event in events[6:]]
    assert sdk.responses.retrieve(response_id).output_text == text
