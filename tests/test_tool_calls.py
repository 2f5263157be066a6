"""Function tools through the API (PROFILE.md 10.4): calls each family's template asks for, enforced.

Each family runs on the demo model with that family's real chat template
(``tests/support/templates.py``: llama.cpp's and vLLM's copies) through the
session's real uvicorn and Celery worker; the ``openai`` package is the
client. Left alone the demo model writes word salad and never a call, so a
``required`` or named call that parses, names an offered tool and whose
arguments validate against its schema is the grammar's work, in the
family's own format (read back by its parser). ``none`` never calls;
``auto`` lets free text be a message, and on a model scripted to write text
and then two calls in Qwen2.5's format (``tests/support/scripted.py``) gives
a message and two calls, each streamed as it comes. The call streams as argument deltas
(Responses) and ``delta.tool_calls`` fragments (Chat), and the next turn
sends the call's output back with ``previous_response_id`` through the same
template. What cannot be enforced is refused by its field before anything
is queued.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import jsonschema
import openai
import pytest
from tokenizers import Tokenizer

from tasks_app.generation.tool_calls import FORMATS, tool_format_of_template
from tasks_app.models import Response, Task
from tasks_app.registry.scan import model_scan
from tests.support.scripted import scripted_model
from tests.support.templates import FAMILY_TEMPLATES, family_template

# A client's protocol over the engine, whose writes the lifecycle's, recovery's and the adapters' own tests
# test on both databases: the SQLite pass only (pyproject.toml, the sqlite_pass marker).
pytestmark = pytest.mark.sqlite_pass

WEATHER_PARAMETERS = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "enum": ["Paris", "Oslo", "Lima"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
        "units": {"anyOf": [{"type": "string", "enum": ["C", "F"]}, {"type": "null"}]},
    },
    "required": ["city", "days", "units"],
    "additionalProperties": False,
}
TIME_PARAMETERS = {
    "type": "object",
    "properties": {"zone": {"type": "string", "pattern": "^[A-Z][a-z]{2,8}/[A-Z][a-z]{2,8}$"}},
    "required": ["zone"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "name": "get_weather", "description": "The forecast.", "parameters": WEATHER_PARAMETERS},
    {"type": "function", "name": "get_time", "description": "The time in a zone.", "parameters": TIME_PARAMETERS},
]
SCHEMAS = {tool["name"]: tool["parameters"] for tool in TOOLS}
CHAT_TOOLS = [{"type": "function", "function": {k: v for k, v in tool.items() if k != "type"}} for tool in TOOLS]
PROMPT = "What is the weather in Paris for three days?"
# The demo model's own template knows no tools: the generic format, with its system instruction.
FAMILIES = [*FAMILY_TEMPLATES, "generic"]


def model_name(family: str) -> str:
    return "tools-" + family.replace(".", "-")


@pytest.fixture
def family_models(running_worker, worker_models_root: Path) -> dict[str, str]:
    """A copy of the demo model per family, its chat template replaced by the family's real one."""
    for family in FAMILIES:
        folder = worker_models_root / model_name(family)
        if not folder.exists():
            staging = worker_models_root / f".{model_name(family)}"
            shutil.copytree(worker_models_root / "demo", staging, ignore=shutil.ignore_patterns("endless"))
            if family in FAMILY_TEMPLATES:
                (staging / "chat_template.jinja").write_text(family_template(family), encoding="utf-8")
            staging.rename(folder)
    model_scan(models_dir=worker_models_root)
    return {family: model_name(family) for family in FAMILIES}


@pytest.fixture
def sdk(api, web_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{web_server.base}/lmsp/v1", api_key=api.token, max_retries=0, timeout=60)


def assert_valid_call(item) -> dict:
    assert item.type == "function_call" and item.status == "completed"
    assert item.name in SCHEMAS
    arguments = json.loads(item.arguments)
    jsonschema.validate(arguments, SCHEMAS[item.name])
    assert item.call_id and item.id.startswith("fc_")
    return arguments


# --------------------------------------------------------------------------- #
# Enforced, per family
# --------------------------------------------------------------------------- #


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("choice", ["required", {"type": "function", "name": "get_time"}], ids=["required", "named"])
def test_a_required_call_parses_and_validates_for_every_family(sdk, family_models, family, choice):
    response = sdk.responses.create(
        model=family_models[family],
        input=PROMPT,
        tools=TOOLS,
        tool_choice=choice,
        parallel_tool_calls=False,
        max_output_tokens=200,
        temperature=0,
    )
    assert response.status == "completed", response.incomplete_details
    calls = [item for item in response.output if item.type == "function_call"]
    assert len(calls) == 1 and len(response.output) == 1  # parallel_tool_calls false: one call, nothing else
    assert_valid_call(calls[0])
    if isinstance(choice, dict):
        assert calls[0].name == "get_time"
    # The family's own format, read back by its parser: the stored request ran under that family.
    assert Response.objects.get(pk=response.id).output[0]["name"] == calls[0].name
    if FORMATS[_family_format(family)].call_id_length:
        assert len(calls[0].call_id) == 9 and calls[0].call_id.isalnum()  # what Mistral's template reads back
    else:
        assert calls[0].call_id.startswith("call_")


def _family_format(family: str) -> str:
    return tool_format_of_template(family_template(family) if family in FAMILY_TEMPLATES else None).name


@pytest.mark.parametrize(
    "family", ["qwen2.5", "llama3.1", "mistral-nemo", "mistral-small-3.2", "phi4-mini-vllm", "generic"]
)
def test_the_next_turn_sends_the_calls_output_back_through_the_template(sdk, family_models, family):
    first = sdk.responses.create(
        model=family_models[family],
        input=PROMPT,
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=False,
        max_output_tokens=200,
        temperature=0,
    )
    call = first.output[0]
    second = sdk.responses.create(
        model=family_models[family],
        previous_response_id=first.id,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": '{"forecast": "sunny"}'}],
        tools=TOOLS,
        tool_choice="none",
        max_output_tokens=30,
        temperature=0,
    )
    assert second.status in ("completed", "incomplete")
    # One message (the demo model may end it at once: the template's prompt after a tool result is its own).
    assert [item.type for item in second.output] == ["message"]
    # The template was given the call and its result: the prompt grew by both.
    assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens


@pytest.mark.parametrize("family", ["qwen2.5", "mistral-nemo", "generic"])
def test_none_never_calls(sdk, family_models, family):
    response = sdk.responses.create(
        model=family_models[family], input=PROMPT, tools=TOOLS, tool_choice="none", max_output_tokens=40, temperature=0
    )
    assert [item.type for item in response.output] == ["message"]
    assert FORMATS[_family_format(family)].start not in response.output_text


def test_auto_lets_free_text_be_a_message(sdk, family_models):
    response = sdk.responses.create(
        model=family_models["qwen2.5"], input="Say hello.", tools=TOOLS, max_output_tokens=40, temperature=0
    )
    assert response.tool_choice == "auto"
    assert [item.type for item in response.output] == ["message"]
    assert response.output_text and "<tool_call>" not in response.output_text
    assert response.output[0].status == ("completed" if response.status == "completed" else "incomplete")


def test_a_call_cut_by_the_token_limit_is_incomplete_and_so_is_the_response(sdk, family_models):
    note = {
        "type": "object",
        "properties": {"note": {"type": "string", "minLength": 300, "maxLength": 300}},
        "required": ["note"],
        "additionalProperties": False,
    }
    response = sdk.responses.create(
        model=family_models["generic"],
        input=PROMPT,
        tools=[{"type": "function", "name": "write_note", "parameters": note}],
        tool_choice="required",
        max_output_tokens=60,
        temperature=0,
    )
    assert (response.status, response.incomplete_details.reason) == ("incomplete", "max_output_tokens")
    (call,) = response.output
    assert (call.type, call.name, call.status) == ("function_call", "write_note", "incomplete")
    assert call.arguments.startswith('{"note":"') and len(call.arguments) < 300


# --------------------------------------------------------------------------- #
# auto, on a model whose output is known
# --------------------------------------------------------------------------- #

# What a Qwen2.5 model writes when it answers with text and then two calls (its template's format).
SCRIPT = (
    "Let me check the forecast.\n"
    '<tool_call>\n{"name": "get_weather", "arguments": {"city":"Paris","days":3,"units":null}}\n</tool_call>\n'
    '<tool_call>\n{"name": "get_time", "arguments": {"zone":"Europe/Oslo"}}\n</tool_call>'
)


@pytest.fixture
def scripted(sdk, family_models, worker_models_root: Path) -> str:
    """The Qwen2.5-template demo model, scripted to write ``SCRIPT`` after ``PROMPT`` with ``TOOLS``."""
    folder = worker_models_root / "tools-scripted"
    if not folder.exists():
        probe = sdk.responses.create(model=family_models["qwen2.5"], input=PROMPT, tools=TOOLS, max_output_tokens=1)
        source = worker_models_root / family_models["qwen2.5"]
        tokenizer = Tokenizer.from_file(str(source / "tokenizer.json"))
        eos = json.loads((source / "generation_config.json").read_text())["eos_token_id"]
        staging = worker_models_root / ".tools-scripted"
        scripted_model(
            source,
            staging,
            prompt_tokens=probe.usage.input_tokens,
            script=tokenizer.encode(SCRIPT, add_special_tokens=False).ids,
            eos=eos[0] if isinstance(eos, list) else eos,
        )
        staging.rename(folder)
    model_scan(models_dir=worker_models_root)
    return "tools-scripted"


def test_auto_reads_text_then_calls_and_streams_each_as_it_comes(sdk, scripted):
    seen = []
    with sdk.responses.stream(model=scripted, input=PROMPT, tools=TOOLS, temperature=0) as stream:
        for event in stream:
            seen.append(event)
        final = stream.get_final_response()

    assert final.status == "completed"
    message, weather, time = final.output
    assert (message.type, message.status) == ("message", "completed")
    assert final.output_text == "Let me check the forecast."  # no marker, no whitespace before it
    assert (weather.name, json.loads(weather.arguments)) == ("get_weather", {"city": "Paris", "days": 3, "units": None})
    assert (time.name, json.loads(time.arguments)) == ("get_time", {"zone": "Europe/Oslo"})
    assert weather.call_id != time.call_id
    added = [(e.output_index, e.item.type) for e in seen if e.type == "response.output_item.added"]
    assert added == [(0, "message"), (1, "function_call"), (2, "function_call")]
    done = [(e.output_index, e.item.type) for e in seen if e.type == "response.output_item.done"]
    assert done == added
    # Each call's arguments arrive as deltas between its added and done events.
    for index, call in ((1, weather), (2, time)):
        pieces = [
            e.delta for e in seen if e.type == "response.function_call_arguments.delta" and e.output_index == index
        ]
        assert "".join(pieces) == call.arguments
    # The message is done before the first call opens: nothing of it is sent after.
    kinds = [(e.type, getattr(e, "output_index", None)) for e in seen]
    assert kinds.index(("response.output_item.done", 0)) < kinds.index(("response.output_item.added", 1))


def test_auto_with_one_call_at_most_stops_after_the_first(sdk, scripted):
    response = sdk.responses.create(model=scripted, input=PROMPT, tools=TOOLS, parallel_tool_calls=False, temperature=0)
    assert response.status == "completed"
    assert [item.type for item in response.output] == ["message", "function_call"]
    assert response.output[1].name == "get_weather"


def test_auto_on_chat_streams_text_then_each_calls_fragments(sdk, scripted):
    chunks = list(
        sdk.chat.completions.create(
            model=scripted,
            messages=[{"role": "user", "content": PROMPT}],
            tools=CHAT_TOOLS,
            temperature=0,
            stream=True,
        )
    )
    text = "".join(chunk.choices[0].delta.content or "" for chunk in chunks if chunk.choices)
    assert text == "Let me check the forecast."
    fragments = [call for chunk in chunks if chunk.choices for call in chunk.choices[0].delta.tool_calls or ()]
    by_index: dict[int, str] = {}
    for fragment in fragments:
        by_index[fragment.index] = by_index.get(fragment.index, "") + (fragment.function.arguments or "")
    assert [json.loads(by_index[i]) for i in (0, 1)] == [
        {"city": "Paris", "days": 3, "units": None},
        {"zone": "Europe/Oslo"},
    ]
    assert [f.function.name for f in fragments if f.function.name] == ["get_weather", "get_time"]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


# --------------------------------------------------------------------------- #
# Streamed
# --------------------------------------------------------------------------- #


# Arguments long enough to span many of the worker's delta batches (16 tokens or 20 ms each) even when a
# busy machine lets the worker's task thread fall behind its model thread (chunks that pile up while a
# commit runs go out together): some 1,500 tokens of the demo model, a second or more of generation.
NOTE_PARAMETERS = {
    "type": "object",
    "properties": {"note": {"type": "string", "minLength": 1500, "maxLength": 1500}},
    "required": ["note"],
    "additionalProperties": False,
}


def test_a_streamed_call_sends_its_arguments_as_they_are_written(sdk, family_models):
    kinds = []
    deltas = []
    with sdk.responses.stream(
        model=family_models["qwen2.5"],
        input=PROMPT,
        tools=[*TOOLS, {"type": "function", "name": "write_note", "parameters": NOTE_PARAMETERS}],
        tool_choice={"type": "function", "name": "write_note"},
        parallel_tool_calls=False,
        max_output_tokens=3000,
        temperature=0,
    ) as stream:
        for event in stream:
            kinds.append(event.type)
            if event.type == "response.output_item.added":
                assert event.item.type == "function_call" and event.item.arguments == ""
                assert event.item.name == "write_note"
            if event.type == "response.function_call_arguments.delta":
                deltas.append(event.delta)
            if event.type == "response.function_call_arguments.done":
                done = event
        final = stream.get_final_response()
    assert final.status == "completed"
    assert len(deltas) > 1  # as they were generated, not one chunk at the end
    arguments = "".join(deltas)
    assert done.arguments == arguments and done.name == "write_note"
    assert final.output[0].arguments == arguments
    jsonschema.validate(json.loads(arguments), NOTE_PARAMETERS)
    assert kinds[-1] == "response.completed"
    assert kinds.index("response.output_item.added") < kinds.index("response.function_call_arguments.delta")
    assert kinds.index("response.function_call_arguments.done") < kinds.index("response.output_item.done")


def test_a_namespace_functions_call_names_its_namespace_and_hosted_tools_stay_unshown(sdk, family_models):
    """As Codex CLI offers its tools (PROFILE.md 10.1): a namespace of functions beside a hosted tool."""
    tools = [
        {"type": "namespace", "name": "clock", "description": "Time tools.", "tools": [TOOLS[1]]},
        {"type": "web_search"},
    ]
    with sdk.responses.stream(
        model=family_models["qwen2.5"],
        input=PROMPT,
        tools=tools,
        tool_choice="required",
        parallel_tool_calls=False,
        max_output_tokens=200,
    ) as stream:
        items = [
            event.item for event in stream if event.type in ("response.output_item.added", "response.output_item.done")
        ]
        final = stream.get_final_response()

    assert final.status == "completed"
    (call,) = final.output
    # Called by its own name; the item names the namespace beside it, as the events did.
    assert (call.name, call.namespace) == ("get_time", "clock")
    jsonschema.validate(json.loads(call.arguments), TIME_PARAMETERS)
    assert [(item.name, item.namespace) for item in items] == [("get_time", "clock")] * 2
    # Both echoed; the one call a required choice allows is the function's: the hosted tool is never called.
    assert [tool.type for tool in final.tools] == ["namespace", "web_search"]


def test_chat_completions_return_tool_calls(sdk, family_models):
    completion = sdk.chat.completions.create(
        model=family_models["llama3.1"],
        messages=[{"role": "user", "content": PROMPT}],
        tools=CHAT_TOOLS,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        parallel_tool_calls=False,
        max_tokens=200,
        temperature=0,
    )
    choice = completion.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather" and call.type == "function"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER_PARAMETERS)


def test_a_streamed_chat_completion_sends_tool_call_fragments(sdk, family_models):
    chunks = list(
        sdk.chat.completions.create(
            model=family_models["mistral-nemo"],
            messages=[{"role": "user", "content": PROMPT}],
            tools=CHAT_TOOLS,
            tool_choice="required",
            parallel_tool_calls=False,
            max_tokens=200,
            temperature=0,
            stream=True,
        )
    )
    fragments = [call for chunk in chunks if chunk.choices for call in chunk.choices[0].delta.tool_calls or ()]
    assert len(fragments) >= 2  # the head (id, name), then the arguments in one piece or more
    head = fragments[0]
    assert head.index == 0 and head.id and head.function.name in SCHEMAS and head.function.arguments == ""
    arguments = "".join(fragment.function.arguments or "" for fragment in fragments)
    jsonschema.validate(json.loads(arguments), SCHEMAS[head.function.name])
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


# --------------------------------------------------------------------------- #
# Refused before anything is queued
# --------------------------------------------------------------------------- #

ALLOWED_X = {"type": "function", "name": "x"}


BAD = {
    "named-tool-not-offered": ({"tools": TOOLS, "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice"),
    "duplicate-name": ({"tools": [TOOLS[0], TOOLS[0]]}, "tools[1].name"),
    # A name's shape is the schema's (a pattern): the serializer refuses it, by its own path.
    "bad-name": ({"tools": [{**TOOLS[0], "name": "has space"}]}, "tools.0.name"),
    "schema-does-not-compile": (
        {"tools": [{**TOOLS[0], "parameters": {"type": "string", "pattern": "(unclosed"}}]},
        "tools[0].parameters",
    ),
    "allowed-tool-not-offered": (
        {"tools": TOOLS, "tool_choice": {"type": "allowed_tools", "mode": "required", "tools": [ALLOWED_X]}},
        "tool_choice",
    ),
    "required-without-tools": ({"tool_choice": "required"}, "tool_choice"),
}


@pytest.mark.parametrize(("fields", "param"), list(BAD.values()), ids=list(BAD))
def test_a_tool_that_cannot_be_enforced_is_refused_by_its_field(transactional_db, api, fields, param):
    answer = api.post("/lmsp/v1/responses", {"model": "demo", "input": "hi", **fields})
    assert answer.status_code == 400, answer.json()
    problem = answer.json()
    assert problem["code"] == "invalid_request"
    assert param in {error["field"] for error in problem["errors"]}
    assert not Task.objects.exists()


def test_a_chat_tool_that_cannot_be_enforced_is_refused_by_its_field(transactional_db, api):
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "integer", "minimum": "x"}}}]
    answer = api.post(
        "/lmsp/v1/chat/completions", {"model": "demo", "messages": [{"role": "user", "content": "hi"}], "tools": tools}
    )
    assert answer.status_code == 400
    assert "tools[0].function.parameters" in {error["field"] for error in answer.json()["errors"]}
    assert not Task.objects.exists()
