"""Every streamed event as the SDKs' own types require it (openai's ``ResponseStreamEvent``), for every ending.

The ``openai`` package builds events without validating them
(``construct``): a required field that is missing does not fail where the
event is parsed, but later, in whatever reads it (its stream helper reads
``event.logprobs``; openai-agents reads ``response.usage``). So each event
of a stream that ends ``completed``, ``incomplete``, ``cancelled`` and
``failed`` is validated here with pydantic, strictly, against the class its
``type`` names, its ``response`` against ``Response``; and what the package
and openai-agents then do with the ending is checked as a client sees it
(docs/api.md, "Streams that hit max_output_tokens").
"""

from __future__ import annotations

import asyncio
import typing
from collections.abc import Iterator
from typing import Any

import openai
import pydantic
import pytest
from openai.types.responses import Response, ResponseIncompleteEvent, ResponseStreamEvent

from tests.support.demo import ENDLESS_MODEL
from tests.support.logs import assert_well_formed_log, delta_text
from tests.support.sse import call, open_stream

# A client's protocol over the engine, whose writes the lifecycle's, recovery's and the adapters' own tests
# test on both databases: the SQLite pass only (pyproject.toml, the sqlite_pass marker).
pytestmark = pytest.mark.sqlite_pass

RESPONSES = "/lmsp/v1/responses"
ENDINGS = ("completed", "incomplete", "cancelled", "failed")
# The event class of each `type` in the union (the package discriminates on `type` itself).
EVENT_CLASSES: dict[str, type[pydantic.BaseModel]] = {
    typing.get_args(cls.model_fields["type"].annotation)[0]: cls
    for cls in typing.get_args(typing.get_args(ResponseStreamEvent)[0])
}
# OpenAI's stream has no cancelled event (only a `response.cancelled` webhook): PROFILE.md 4 adds one.
NOT_IN_THE_UNION = {"response.cancelled"}

# Service bugs in the response object (tasks_app/core/wire.py), found by these checks.


def ending_request(api, ending: str) -> dict[str, Any]:
    if ending == "completed":
        # The demo model ends by itself well before this (tests/test_demo_model.py).
        return {"model": "demo", "input": "Hello", "max_output_tokens": 1500, "seed": 3}
    if ending == "incomplete":
        return {"model": ENDLESS_MODEL, "input": "Hello", "max_output_tokens": 5}
    if ending == "cancelled":
        return {"model": ENDLESS_MODEL, "input": "Hello", "max_output_tokens": 100_000}
    context_length = api.get("/lmsp/v1/models/demo").json()["context_length"]
    return {"model": "demo", "input": "word " * context_length, "max_output_tokens": 5}


def streamed(api, web_server, ending: str) -> list[dict[str, Any]]:
    """The events of one streamed response that ends as ``ending``, as their JSON."""
    body = {**ending_request(api, ending), "stream": True}
    cancelling = False
    with open_stream(web_server.base, RESPONSES, token=api.token, method="POST", body=body) as stream:
        assert stream.status == 200, stream.body
        events: list[dict[str, Any]] = []
        for event in stream:
            events.append(event.payload)
            if ending == "cancelled" and event.payload["type"] == "response.output_text.delta" and not cancelling:
                cancelling = True
                status, _ = call(
                    web_server.base, "POST", f"{RESPONSES}/{events[0]['response']['id']}/cancel", token=api.token
                )
                assert status == 200
    assert_well_formed_log(events)
    assert events[-1]["response"]["status"] == ending
    return events


@pytest.fixture(params=ENDINGS)
def ending(request: pytest.FixtureRequest) -> str:
    return request.param


def strict_errors(model: type[pydantic.BaseModel], data: dict[str, Any]) -> list[dict[str, Any]]:
    """What pydantic finds wrong with ``data`` as ``model``, strictly (no coercion); [] if nothing."""
    try:
        model.model_validate(data, strict=True)
    except pydantic.ValidationError as error:
        return error.errors(include_url=False, include_input=False)
    return []


def missing_required(model: type[pydantic.BaseModel], data: dict[str, Any]) -> list[str]:
    # The lenient parse would leave these unset, and the code that reads them fail far from the cause.
    return [
        name for name, field in model.model_fields.items() if field.is_required() and (field.alias or name) not in data
    ]


def problems(events: list[dict[str, Any]]) -> Iterator[tuple[str, tuple[Any, ...], str]]:
    """(event type, location, what) for each way an event is not what its openai type requires."""
    for event in events:
        kind = event["type"]
        model, data, at = EVENT_CLASSES.get(kind), event, ()
        if model is None:
            if kind not in NOT_IN_THE_UNION:
                yield kind, (), "not an event type of openai's ResponseStreamEvent"
                continue
            # The package hands a client this event's JSON as it is: its response must still be one.
            model, data, at = Response, event["response"], ("response",)
        for name in missing_required(model, data):
            yield kind, (*at, name), "missing"
        for error in strict_errors(model, data):
            # A missing top-level field was named just above.
            if error["type"] != "missing" or len(error["loc"]) > 1:
                yield kind, (*at, *error["loc"]), error["msg"]


def outside(events, *prefixes: tuple[str, ...]) -> list[tuple[str, tuple[Any, ...], str]]:
    return [found for found in problems(events) if not any(found[1][: len(p)] == p for p in prefixes)]


def inside(events, prefix: tuple[str, ...]) -> list[tuple[str, tuple[Any, ...], str]]:
    return [found for found in problems(events) if found[1][: len(prefix)] == prefix]


USAGE = ("response", "usage")
ERROR = ("response", "error")


def test_every_event_is_the_openai_type_its_name_says_with_every_required_field(
    api, running_worker, web_server, ending
):
    events = streamed(api, web_server, ending)

    # The usage and error objects have tests of their own below, where what they lack is named.
    assert outside(events, USAGE, ERROR) == []
    assert {event["type"] for event in events} - EVENT_CLASSES.keys() <= NOT_IN_THE_UNION


def test_usage_is_what_openai_response_usage_requires(api, running_worker, web_server, ending):
    events = streamed(api, web_server, ending)

    assert inside(events, USAGE) == []
    # A response not finished shows zeros (nothing counted yet); the counted ones are checked.
    usages = [e["response"]["usage"] for e in events if "response" in e and e["response"]["usage"]["total_tokens"]]
    assert usages or ending in ("cancelled", "failed")
    # What the worker's prefix cache held of the prompt: never all of it (the last token is computed).
    assert all(0 <= usage["input_tokens_details"]["cached_tokens"] < usage["input_tokens"] for usage in usages)


def test_error_is_what_openai_response_error_requires_but_its_lmsp_code(api, running_worker, web_server, ending):
    events = streamed(api, web_server, ending)

    # PROFILE.md section 2 fixes the codes (context_length_exceeded here), which openai's closed list of
    # ResponseError codes lacks; the package builds its objects without validating, so a client still
    # reads the code as a string. Everything else the type requires is there.
    assert [(at, what) for _, at, what in inside(events, ERROR) if at != (*ERROR, "code")] == []
    if ending == "failed":
        error = events[-1]["response"]["error"]
        assert error["message"] == f"context_length_exceeded: {error['detail']}"


# --------------------------------------------------------------------------- #
# What the clients do with the endings
# --------------------------------------------------------------------------- #


@pytest.fixture
def sdk(api, web_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{web_server.base}/lmsp/v1", api_key=api.token, max_retries=0, timeout=60)


def test_the_openai_package_reads_the_partial_text_of_a_stream_cut_by_max_output_tokens(sdk, running_worker):
    events = list(sdk.responses.create(model=ENDLESS_MODEL, input="Hello", max_output_tokens=5, stream=True))

    last = events[-1]
    assert [e.item.status for e in events if e.type == "response.output_item.done"] == ["incomplete"]
    assert isinstance(last, ResponseIncompleteEvent)
    assert (last.response.status, last.response.incomplete_details.reason) == ("incomplete", "max_output_tokens")
    assert last.response.output_text == "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert last.response.output_text


def test_the_openai_stream_helper_has_no_final_response_for_an_incomplete_one_as_against_openai(sdk, running_worker):
    with sdk.responses.stream(model=ENDLESS_MODEL, input="Hello", max_output_tokens=5) as stream:
        events = list(stream)
        with pytest.raises(RuntimeError, match=r"response\.completed"):
            stream.get_final_response()

    assert events[-1].type == "response.incomplete"
    assert events[-1].response.output_text


def test_openai_agents_raises_on_a_streamed_incomplete_response_as_against_openai(api, running_worker, web_server):
    from agents import Agent, ModelSettings, OpenAIResponsesModel, Runner, set_tracing_disabled
    from agents.exceptions import ModelBehaviorError

    # Nothing may leave the machine: the SDK would export its traces to OpenAI.
    set_tracing_disabled(True)
    client = openai.AsyncOpenAI(base_url=f"{web_server.base}/lmsp/v1", api_key=api.token, max_retries=0)
    agent = Agent(
        name="writer",
        instructions="Be brief.",
        model=OpenAIResponsesModel(model=ENDLESS_MODEL, openai_client=client),
        model_settings=ModelSettings(max_tokens=5),
    )
    seen: list[str] = []

    async def run() -> None:
        result = Runner.run_streamed(agent, "Hello")
        async for event in result.stream_events():
            if event.type == "raw_response_event":
                seen.append(event.data.type)

    with pytest.raises(ModelBehaviorError, match=r"response\.incomplete.*max_output_tokens"):
        asyncio.run(run())
    assert seen[-1] == "response.incomplete"
    assert "response.output_text.delta" in seen


def test_a_cancelled_stream_reaches_the_openai_package_as_an_event_of_no_type_of_its_own(
    api, sdk, running_worker, web_server
):
    stream = sdk.responses.create(model=ENDLESS_MODEL, input="Hello", max_output_tokens=100_000, stream=True)
    events = []
    for event in stream:
        events.append(event)
        if event.type == "response.output_text.delta" and sum(e.type == event.type for e in events) == 1:
            assert sdk.responses.cancel(events[0].response.id).status == "cancelled"

    last = events[-1]
    assert last.type == "response.cancelled"
    # Not in the union, so the package builds some other class around it and leaves `response` a dict.
    assert not isinstance(last.response, Response)
    assert last.response["status"] == "cancelled"
    shown = "".join(part["text"] for item in last.response["output"] for part in item["content"])
    assert shown == delta_text([event.model_dump() for event in events])
    assert sdk.responses.retrieve(last.response["id"]).status == "cancelled"
