"""The response object and every stream event against the published schemas (PROFILE.md 10.1).

OpenAI's OpenAPI description (the one its SDKs are generated from) and the
Open Responses specification, vendored in ``tests/data/`` (their sources,
commits and licences are in each file's ``$comment``). Through the session's
real uvicorn and Celery worker, responses of each kind a client meets
(completed, cut by the token limit, ending in a function call, structured,
background, cancelled) are streamed, created and read back; every event and
every response object, as streamed, answered and stored, must validate
against both. Our extensions (``queue_position``, ``top_k``...) are extra
members, which both schemas allow.
"""

from __future__ import annotations

import json
import shutil
from functools import cache
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from referencing import Registry, Resource
from referencing.jsonschema import DRAFT202012

from tasks_app.core import lifecycle
from tasks_app.exceptions import ServerRestarted
from tasks_app.models import Task
from tasks_app.registry.scan import model_scan
from tests.support.demo import DEMO_MODEL, ENDLESS_MODEL
from tests.support.logs import stored as stored_events
from tests.support.sse import TERMINAL_TYPES, open_stream
from tests.support.waiting import wait_until

DATA = Path(__file__).parent / "data"
RESPONSES = "/lmsp/v1/responses"

# Each event type we stream, and its schema in each document; None: that document has no such event.
EVENT_SCHEMAS: dict[str, tuple[str | None, str | None]] = {
    "response.queued": ("ResponseQueuedEvent", "ResponseQueuedStreamingEvent"),
    "response.created": ("ResponseCreatedEvent", "ResponseCreatedStreamingEvent"),
    "response.in_progress": ("ResponseInProgressEvent", "ResponseInProgressStreamingEvent"),
    "response.output_item.added": ("ResponseOutputItemAddedEvent", "ResponseOutputItemAddedStreamingEvent"),
    "response.content_part.added": ("ResponseContentPartAddedEvent", "ResponseContentPartAddedStreamingEvent"),
    "response.output_text.delta": ("ResponseTextDeltaEvent", "ResponseOutputTextDeltaStreamingEvent"),
    "response.output_text.done": ("ResponseTextDoneEvent", "ResponseOutputTextDoneStreamingEvent"),
    "response.content_part.done": ("ResponseContentPartDoneEvent", "ResponseContentPartDoneStreamingEvent"),
    "response.output_item.done": ("ResponseOutputItemDoneEvent", "ResponseOutputItemDoneStreamingEvent"),
    "response.function_call_arguments.delta": (
        "ResponseFunctionCallArgumentsDeltaEvent",
        "ResponseFunctionCallArgumentsDeltaStreamingEvent",
    ),
    "response.function_call_arguments.done": (
        "ResponseFunctionCallArgumentsDoneEvent",
        "ResponseFunctionCallArgumentsDoneStreamingEvent",
    ),
    "response.completed": ("ResponseCompletedEvent", "ResponseCompletedStreamingEvent"),
    "response.incomplete": ("ResponseIncompleteEvent", "ResponseIncompleteStreamingEvent"),
    "response.failed": ("ResponseFailedEvent", "ResponseFailedStreamingEvent"),
    "error": ("ResponseErrorEvent", "ErrorStreamingEvent"),
    # LMSP's own terminal event (neither document has one): its response object is still checked.
    "response.cancelled": (None, None),
}
RESPONSE_SCHEMAS = ("Response", "ResponseResource")
DOCUMENTS = ("openai_responses.schema.json", "openresponses.schema.json")

WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The forecast.",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo"]}},
        "required": ["city"],
        "additionalProperties": False,
    },
}
ANSWER = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}},
    "required": ["ok"],
    "additionalProperties": False,
}
# The requests, one per kind of response, with the status each must end in.
KINDS: dict[str, tuple[dict[str, Any], str]] = {
    "completed": ({"model": DEMO_MODEL, "input": "Hello", "max_output_tokens": 2000}, "completed"),
    "incomplete": ({"model": ENDLESS_MODEL, "input": "Hello", "max_output_tokens": 5}, "incomplete"),
    "function-call": (
        {"model": DEMO_MODEL, "input": "Weather?", "tools": [WEATHER], "tool_choice": "required", "temperature": 0},
        "completed",
    ),
    "structured": (
        {
            "model": DEMO_MODEL,
            "input": "Fine?",
            "text": {"format": {"type": "json_schema", "name": "answer", "schema": ANSWER, "strict": True}},
            "instructions": "Answer in JSON.",
            "top_p": 0.9,
            "presence_penalty": 0.5,
        },
        "completed",
    ),
}


@cache
def validator(document: str, name: str) -> jsonschema.protocols.Validator:
    """A validator for one named schema of a vendored document, its ``$ref``s resolved inside it."""
    contents = json.loads((DATA / document).read_text(encoding="utf-8"))
    uri = f"urn:lmsp-test:{document}"
    registry = Registry().with_resource(uri, Resource.from_contents(contents, default_specification=DRAFT202012))
    return jsonschema.Draft202012Validator({"$ref": f"{uri}#/components/schemas/{name}"}, registry=registry)


def problems_of(instance: Any, document: str, name: str) -> list[str]:
    found = validator(document, name).iter_errors(instance)
    return [f"{document} {name} at {'/'.join(map(str, error.absolute_path))}: {error.message[:300]}" for error in found]


def assert_valid_response(body: dict[str, Any]) -> None:
    found = [
        p for document, name in zip(DOCUMENTS, RESPONSE_SCHEMAS, strict=True) for p in problems_of(body, document, name)
    ]
    assert not found, "\n".join(found)


def assert_valid_event(event: dict[str, Any]) -> None:
    names = EVENT_SCHEMAS[event["type"]]
    found = [
        p for document, name in zip(DOCUMENTS, names, strict=True) if name for p in problems_of(event, document, name)
    ]
    assert not found, "\n".join(found)
    if "response" in event:
        assert_valid_response(event["response"])


@pytest.fixture
def base(web_server, running_worker) -> str:
    return web_server.base


def stream(base: str, token: str, path: str, body: Any = None) -> list[dict[str, Any]]:
    method = "GET" if body is None else "POST"
    with open_stream(base, path, token=token, method=method, body=body) as sse:
        assert sse.status == 200, sse.body
        events = [event.payload for event in sse]
    return events


def read(api, response_id: str) -> dict[str, Any]:
    reply = api.get(f"{RESPONSES}/{response_id}")
    assert reply.status_code == 200, reply.content
    return reply.json()


@pytest.mark.parametrize("kind", KINDS)
def test_a_streamed_response_and_its_stored_object_pass_both_schemas(api, base, kind):
    request, status = KINDS[kind]
    events = stream(base, api.token, RESPONSES, {**request, "stream": True})

    for event in events:
        assert_valid_event(event)
    final = events[-1]["response"]
    assert (events[-1]["type"], final["status"]) == (f"response.{status}", status)
    stored = read(api, final["id"])
    assert_valid_response(stored)
    assert stored["completed_at"] == final["completed_at"] >= stored["created_at"]
    # The values in force: the request's, else the model's defaults (the demo's generation config sets none).
    in_force = {"temperature": 1.0, "top_p": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0}
    assert {key: stored[key] for key in in_force} == {**in_force, **{k: request[k] for k in in_force if k in request}}
    if kind == "function-call":
        assert [item["type"] for item in stored["output"]] == ["function_call"]
        assert stored["tools"] == [{**WEATHER, "strict": True}]
    else:
        assert {part["type"] for item in stored["output"] for part in item["content"]} == {"output_text"}


def test_a_created_answer_passes_both_schemas(api, base):
    reply = api.post(RESPONSES, {"model": ENDLESS_MODEL, "input": "Hello", "max_output_tokens": 3})

    assert reply.status_code == 200, reply.content
    assert reply.json()["status"] == "incomplete"
    assert_valid_response(reply.json())


def test_background_and_cancelled_responses_pass_both_schemas(api, base):
    done = api.post(RESPONSES, {"model": DEMO_MODEL, "input": "Hello", "background": True, "max_output_tokens": 40})
    running = api.post(
        RESPONSES, {"model": ENDLESS_MODEL, "input": "Go on", "background": True, "max_output_tokens": 4000}
    )

    for reply in (done, running):
        assert reply.status_code == 200, reply.content
        assert reply.json()["status"] in ("queued", "in_progress")
        assert reply.json()["completed_at"] is None
        assert_valid_response(reply.json())
    wait_until(
        lambda: read(api, running.json()["id"])["status"] == "in_progress", what="the endless task never started"
    )
    cancelled = api.post(f"{RESPONSES}/{running.json()['id']}/cancel")
    assert cancelled.status_code == 200, cancelled.content
    wait_until(lambda: read(api, done.json()["id"])["status"] not in ("queued", "in_progress"), what="never ended")
    for response_id in (done.json()["id"], running.json()["id"]):
        stored = read(api, response_id)
        assert_valid_response(stored)
        # A background response's events, replayed from the start.
        events = stream(base, api.token, f"{RESPONSES}/{response_id}?stream=true")
        assert events[-1]["type"] in TERMINAL_TYPES
        for event in events:
            assert_valid_event(event)
    cancelled_body = read(api, running.json()["id"])
    assert cancelled_body["status"] == "cancelled"
    assert cancelled_body["completed_at"] >= cancelled_body["created_at"]


def test_a_failed_response_passes_open_responses_and_openai_but_for_lmsp_s_failure_code(api, queue):
    """A task the restart policy failed: its stored response and its ``response.failed`` event.

    OpenAI's ``ResponseError.code`` is a closed list of OpenAI's own failures; PROFILE.md section 2
    makes the response's ``error`` LMSP's problem object, whose codes (``server_restarted``,
    ``model_load_failed``, ``backend_error``) that list lacks. That member is the one difference.
    """
    created = api.post(RESPONSES, {"model": DEMO_MODEL, "input": "Hello", "background": True})
    response_id = created.json()["id"]
    task = Task.objects.get(response_id=response_id)
    problem = ServerRestarted("the server restarted while the task ran").to_problem()
    assert lifecycle.task_fail(task_id=task.id, error=problem).won

    stored = read(api, response_id)
    (failed,) = [json.loads(payload) for _, kind, payload in stored_events(task.id) if kind == "response.failed"]
    for body in (stored, failed["response"]):
        assert (body["status"], body["error"]["code"]) == ("failed", "server_restarted")
        assert body["completed_at"] >= body["created_at"]
        assert not problems_of(body, DOCUMENTS[1], RESPONSE_SCHEMAS[1])
        assert [p.split(":")[0] for p in problems_of(body, DOCUMENTS[0], RESPONSE_SCHEMAS[0])] == [
            f"{DOCUMENTS[0]} Response at error"
        ]
        assert_valid_response({**body, "error": {**body["error"], "code": "server_error"}})
    assert not problems_of(failed, DOCUMENTS[1], EVENT_SCHEMAS["response.failed"][1])


@pytest.mark.parametrize(
    ("config", "shown"),
    [
        ({"temperature": 0.7, "top_p": 0.8}, {"temperature": 0.7, "top_p": 0.8}),
        ({"do_sample": False, "temperature": 0.7}, {"temperature": 0.0, "top_p": 1.0}),
    ],
    ids=["sampling-defaults", "greedy-by-default"],
)
def test_an_unset_knob_shows_the_model_s_own_default(api, queue, demo_models_root, tmp_path, settings, config, shown):
    root = tmp_path / "models"
    shutil.copytree(demo_models_root / "demo", root / "tuned")
    generation_config = root / "tuned" / "generation_config.json"
    generation_config.write_text(json.dumps({**json.loads(generation_config.read_text()), **config}))
    settings.LMSP_MODELS_DIR = root
    model_scan(models_dir=root)

    unset = api.post(RESPONSES, {"model": "tuned", "input": "Hello", "background": True}).json()
    chosen = api.post(RESPONSES, {"model": "tuned", "input": "Hello", "background": True, "temperature": 0.3}).json()

    assert {key: unset[key] for key in shown} == shown
    assert {key: chosen[key] for key in shown} == {**shown, "temperature": 0.3}
    assert_valid_response(unset)
