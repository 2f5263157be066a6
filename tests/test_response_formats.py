"""Structured output through the API (PROFILE.md 10.5): JSON that parses, schemas refused before anything runs.

The ``openai`` package is the client: ``responses.parse`` and
``chat.completions.parse`` with a Pydantic model, a streamed ``json_schema``
response, and ``json_object`` on both APIs, each through the session's real
uvicorn and Celery worker on the demo model (which, left alone, writes no
JSON). A schema the grammar engine cannot compile, a format without its
name or schema, and a stop string beside a JSON format are refused by the
field's path, on every endpoint, and nothing is queued.
"""

from __future__ import annotations

import json
from typing import Any, Literal

import jsonschema
import openai
import pytest
from openai.lib._pydantic import to_strict_json_schema
from pydantic import BaseModel, Field

from tasks_app.models import Response, Task

# Bounded, as a careful schema author writes them: the demo model writes word salad, and
# in an unbounded string or number it would go on until the token limit cut it.


class Weather(BaseModel):
    city: str = Field(max_length=24)
    temperature_c: int = Field(ge=-60, le=60)
    conditions: Literal["sunny", "cloudy", "rain"]


class Forecast(BaseModel):
    days: list[Weather] = Field(min_length=2, max_length=3)
    confident: bool


WEATHER_SCHEMA = to_strict_json_schema(Weather)
PROMPT = "What is the weather in Paris? Answer as JSON."


@pytest.fixture
def sdk(api, web_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{web_server.base}/lmsp/v1", api_key=api.token, max_retries=0, timeout=60)


def stored_text(response_id: str) -> str:
    output = Response.objects.get(pk=response_id).output
    return "".join(part["text"] for item in output if item["type"] == "message" for part in item["content"])


# --------------------------------------------------------------------------- #
# Enforced
# --------------------------------------------------------------------------- #


SAMPLING = [{"temperature": 0}, {"temperature": 1.0, "extra_body": {"seed": 3}}]


@pytest.mark.parametrize("sampling", SAMPLING, ids=["greedy", "seeded"])
def test_responses_parse_gives_the_pydantic_model(sdk, running_worker, sampling):
    response = sdk.responses.parse(model="demo", input=PROMPT, text_format=Forecast, max_output_tokens=400, **sampling)
    assert response.status == "completed"
    assert isinstance(response.output_parsed, Forecast)
    assert 2 <= len(response.output_parsed.days) <= 3
    assert response.output_text == stored_text(response.id)
    # The format is echoed as sent, so a client reading the response back knows what it asked.
    assert response.text.format.type == "json_schema" and response.text.format.name == "Forecast"


def test_a_streamed_json_schema_response_parses_from_its_deltas(sdk, running_worker):
    text_format = {"type": "json_schema", "name": "weather", "schema": WEATHER_SCHEMA, "strict": True}
    deltas = []
    with sdk.responses.stream(
        model="demo", input=PROMPT, text={"format": text_format}, max_output_tokens=200, temperature=0
    ) as stream:
        for event in stream:
            if event.type == "response.output_text.delta":
                deltas.append(event.delta)
        final = stream.get_final_response()
    assert len(deltas) > 1  # streamed as it was generated, not one chunk at the end
    text = "".join(deltas)
    assert text == final.output_text == stored_text(final.id)
    jsonschema.validate(json.loads(text), WEATHER_SCHEMA)


def test_chat_completions_parse_gives_the_pydantic_model(sdk, running_worker):
    completion = sdk.chat.completions.parse(
        model="demo", messages=[{"role": "user", "content": PROMPT}], response_format=Weather, max_tokens=200
    )
    choice = completion.choices[0]
    assert choice.finish_reason == "stop"
    assert isinstance(choice.message.parsed, Weather)
    request = Response.objects.get(pk="resp_" + completion.id.removeprefix("chatcmpl-")).request
    assert request["text"]["format"]["type"] == "json_schema" and request["text"]["format"]["name"] == "Weather"


def test_a_streamed_chat_completion_with_a_schema_parses_from_its_chunks(sdk, running_worker):
    response_format = {"type": "json_schema", "json_schema": {"name": "weather", "schema": WEATHER_SCHEMA}}
    chunks = sdk.chat.completions.create(
        model="demo",
        messages=[{"role": "user", "content": PROMPT}],
        response_format=response_format,
        max_tokens=200,
        stream=True,
    )
    text = "".join(chunk.choices[0].delta.content or "" for chunk in chunks if chunk.choices)
    jsonschema.validate(json.loads(text), WEATHER_SCHEMA)


def test_json_object_is_an_object_or_cut_by_the_limit(sdk, running_worker):
    """The demo model never closes a free key by itself: the limit cuts it, and the response says so."""
    response = sdk.responses.create(
        model="demo", input=PROMPT, text={"format": {"type": "json_object"}}, max_output_tokens=12
    )
    assert response.status == "incomplete"
    assert response.output_text.startswith('{"')
    completion = sdk.chat.completions.create(
        model="demo",
        messages=[{"role": "user", "content": PROMPT}],
        response_format={"type": "json_object"},
        max_tokens=12,
    )
    assert completion.choices[0].finish_reason == "length"
    assert completion.choices[0].message.content.startswith('{"')


# --------------------------------------------------------------------------- #
# Refused before anything is queued
# --------------------------------------------------------------------------- #

UNCOMPILABLE = [
    pytest.param({"type": "object", "properties": {"a": {"type": "string", "format": "fancy"}}}, "fancy", id="format"),
    pytest.param({"type": "object", "properties": {"a": {"not": {"type": "string"}}}}, "not", id="keyword"),
    pytest.param({"type": "object", "properties": {"a": {"type": "string", "pattern": "(("}}}, "unclosed", id="regex"),
    pytest.param({"$ref": "#/$defs/missing"}, "missing", id="ref"),
    pytest.param({"type": "frob"}, "frob", id="type"),
]


def _text_format(schema: Any) -> dict[str, Any]:
    return {"type": "json_schema", "name": "out", "schema": schema, "strict": True}


@pytest.mark.parametrize(("schema", "reason"), UNCOMPILABLE)
def test_a_schema_that_does_not_compile_is_refused_with_the_engines_reason(transactional_db, sdk, schema, reason):
    before = Task.objects.count()
    with pytest.raises(openai.BadRequestError) as raised:
        sdk.responses.create(model="demo", input="Hi", text={"format": _text_format(schema)})
    assert raised.value.code == "invalid_request"
    assert raised.value.param == "text.format.schema"
    assert reason in raised.value.message
    with pytest.raises(openai.BadRequestError) as raised:
        sdk.chat.completions.create(
            model="demo",
            messages=[{"role": "user", "content": "Hi"}],
            response_format={"type": "json_schema", "json_schema": {"name": "out", "schema": schema}},
        )
    assert raised.value.code == "invalid_request"
    assert raised.value.param == "response_format.json_schema.schema"
    assert reason in raised.value.message
    assert Task.objects.count() == before


def test_a_task_with_an_uncompilable_schema_is_refused_by_its_path_in_the_envelope(transactional_db, api):
    before = Task.objects.count()
    body = {"model": "demo", "input": "Hi", "text": {"format": _text_format({"type": "frob"})}}
    reply = api.create_task(input=body)
    assert reply.status_code == 400
    problem = reply.json()
    assert problem["code"] == "invalid_request"
    assert problem["errors"][0]["field"] == "input.text.format.schema"
    assert Task.objects.count() == before


@pytest.mark.parametrize(
    ("text_format", "param"),
    [
        ({"type": "json_schema", "schema": {"type": "object"}}, "text.format.name"),
        ({"type": "json_schema", "name": "out"}, "text.format.schema"),
    ],
    ids=["no-name", "no-schema"],
)
def test_a_json_schema_format_needs_its_name_and_schema(transactional_db, sdk, text_format, param):
    with pytest.raises(openai.BadRequestError) as raised:
        sdk.responses.create(model="demo", input="Hi", text={"format": text_format})
    assert raised.value.code == "invalid_request"
    assert raised.value.param == param


@pytest.mark.parametrize("kind", ["json_object", "json_schema"])
def test_a_stop_string_beside_a_json_format_is_refused_by_name(transactional_db, sdk, kind: str):
    text_format = {"type": kind} if kind == "json_object" else _text_format({"type": "object"})
    with pytest.raises(openai.BadRequestError) as raised:
        sdk.responses.create(model="demo", input="Hi", text={"format": text_format}, extra_body={"stop": ["}"]})
    assert raised.value.code == "unsupported_parameter"
    assert raised.value.param == "stop"
    chat_format = (
        {"type": kind} if kind == "json_object" else {"type": kind, "json_schema": {"name": "o", "schema": {}}}
    )
    with pytest.raises(openai.BadRequestError) as raised:
        sdk.chat.completions.create(
            model="demo", messages=[{"role": "user", "content": "Hi"}], response_format=chat_format, stop="}"
        )
    assert raised.value.param == "stop"
