"""Every field of OpenAI's Responses request, once (PROFILE.md 10.1): implemented, accepted and echoed, or refused.

The rule is that no field is taken and then ignored: a field either does
what OpenAI documents, or asks for nothing the service lacks and shows up in
the response object as sent, or is refused with ``400 unsupported_parameter``
whose ``param`` names it. Three tables, one case per field (and per notable
value):

* ``IMPLEMENTED``: the field changes the generation, so it runs on the real
  worker, with few and short generations.
* ``ECHOED``: answered in process by a background request on a queue nobody
  consumes (the queued response object comes back at once), so the echo is
  checked without generating anything.
* ``REFUSED``: on ``POST /responses`` and inside ``POST /tasks`` (where the
  path is under ``input.``), each writes nothing.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import jinja2
import pytest
from tokenizers import Tokenizer

from fixture_models.demo import CHAT_TEMPLATE
from tasks_app.models import IdempotencyKey, Response, Task, TaskEvent
from tests.support.api import ApiClient
from tests.support.demo import ENDLESS_MODEL
from tests.support.logs import assert_well_formed_log, delta_text, stored
from tests.support.problems import assert_problem
from tests.support.sse import TERMINAL_TYPES, open_stream
from tests.support.waiting import wait_until

# OpenAI's request fields at the protocol's edge, whose stored request and response the lifecycle's and
# the API's own tests test on both databases: the SQLite pass only (pyproject.toml, the sqlite_pass marker).
pytestmark = pytest.mark.sqlite_pass

RESPONSES = "/lmsp/v1/responses"
TASKS = "/lmsp/v1/tasks"
BASE = {"model": "demo", "input": "Hello"}
RUNNING_OR_WAITING = {"queued", "in_progress"}

FUNCTION_TOOL = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    "strict": True,
}

BARE_FUNCTION_TOOL = {"type": "function", "name": "get_time", "parameters": {"type": "object", "properties": {}}}

NAMESPACE_TOOL = {
    "type": "namespace",
    "name": "agents",
    "description": "Sub-agents.",
    "tools": [{"type": "function", "name": "spawn_agent", "parameters": {"type": "object", "properties": {}}}],
}

HOSTED_TOOLS = [
    {"type": "web_search"},
    {"type": "web_search_preview"},
    {"type": "file_search", "vector_store_ids": ["vs_1"]},
    {"type": "code_interpreter", "container": {"type": "auto"}},
    {"type": "computer_use_preview", "display_width": 1024, "display_height": 768, "environment": "browser"},
    {"type": "image_generation"},
    {"type": "mcp", "server_label": "deepwiki", "server_url": "https://mcp.deepwiki.com/mcp"},
    {"type": "local_shell"},
    {"type": "shell"},
    {"type": "apply_patch"},
]


def counts() -> tuple[int, int, int, int]:
    return (Task.objects.count(), Response.objects.count(), TaskEvent.objects.count(), IdempotencyKey.objects.count())


def text_of(body: dict[str, Any]) -> str:
    return "".join(part["text"] for item in body["output"] for part in item.get("content", []))


# --------------------------------------------------------------------------- #
# Implemented: the field changes what the worker generates
# --------------------------------------------------------------------------- #

# demo:endless never ends by itself: a limit ends every generation, at a known length.
GREEDY = {"model": ENDLESS_MODEL, "input": "Once upon a time", "max_output_tokens": 16, "temperature": 0}
SAMPLED = {**GREEDY, "temperature": 1.0}


def respond(api: ApiClient, **fields: Any) -> dict[str, Any]:
    """A foreground response: the POST waits for the worker and answers the finished object."""
    reply = api.post(RESPONSES, {**BASE, **fields})
    assert reply.status_code == 200, reply.content
    body = reply.json()
    assert body["status"] not in RUNNING_OR_WAITING, body
    return body


def texts(api: ApiClient, *requests: dict[str, Any]) -> list[str]:
    return [text_of(respond(api, **request)) for request in requests]


def prompt_tokens(models_root, messages: list[dict[str, str]]) -> int:
    """Input tokens as the worker counts them: the demo's chat template rendered, then tokenised."""
    tokenizer = Tokenizer.from_file(str(models_root / "demo" / "tokenizer.json"))
    text = jinja2.Environment().from_string(CHAT_TEMPLATE).render(messages=messages, add_generation_prompt=True)
    return len(tokenizer.encode(text, add_special_tokens=False).ids)


def implemented_model(api, models_root):
    body = respond(api, model=ENDLESS_MODEL, max_output_tokens=2)
    unknown = api.post(RESPONSES, {**BASE, "model": "no-such-model"})

    assert body["model"] == ENDLESS_MODEL
    assert_problem(unknown, 400, "model_not_found")


def implemented_input(api, models_root):
    as_text, as_items = (
        respond(api, **{**GREEDY, "input": given})
        for given in (
            "Once upon a time",
            [{"role": "user", "content": [{"type": "input_text", "text": "Once upon a time"}]}],
        )
    )

    assert text_of(as_text) == text_of(as_items)
    assert as_text["usage"]["input_tokens"] == as_items["usage"]["input_tokens"]
    assert as_text["usage"]["input_tokens"] == prompt_tokens(
        models_root, [{"role": "user", "content": "Once upon a time"}]
    )


def implemented_instructions(api, models_root):
    plain = respond(api, model=ENDLESS_MODEL, input="Hello", max_output_tokens=1)
    instructed = respond(api, model=ENDLESS_MODEL, input="Hello", instructions="Be brief.", max_output_tokens=1)

    user = {"role": "user", "content": "Hello"}
    assert plain["usage"]["input_tokens"] == prompt_tokens(models_root, [user])
    assert instructed["usage"]["input_tokens"] == prompt_tokens(
        models_root, [{"role": "system", "content": "Be brief."}, user]
    )
    assert instructed["instructions"] == "Be brief."


def implemented_max_output_tokens(api, models_root):
    body = respond(api, model=ENDLESS_MODEL, max_output_tokens=5)

    assert (body["status"], body["incomplete_details"]) == ("incomplete", {"reason": "max_output_tokens"})
    assert body["usage"]["output_tokens"] == 5
    assert body["output"][0]["status"] == "incomplete"


def implemented_stop(api, models_root):
    text = texts(api, GREEDY)[0]
    stop = text.split()[2]
    for given in (stop, ["never in this text", stop]):
        body = respond(api, **GREEDY, stop=given)

        assert (body["status"], body["incomplete_details"]) == ("completed", None)
        assert text_of(body) == text[: text.index(stop)]


def implemented_seed(api, models_root):
    first, again, other = texts(api, {**SAMPLED, "seed": 5}, {**SAMPLED, "seed": 5}, {**SAMPLED, "seed": 6})

    assert first == again
    assert other != first


def implemented_temperature(api, models_root):
    greedy_1, greedy_2, sampled = texts(api, {**GREEDY, "seed": 1}, {**GREEDY, "seed": 2}, {**SAMPLED, "seed": 1})

    # 0 is greedy: the seed has nothing to choose.
    assert greedy_1 == greedy_2
    assert sampled != greedy_1


def cut_to_the_top_token(cut: dict[str, Any]) -> Callable[[ApiClient, Any], None]:
    """A cut that keeps only the most likely token makes sampling greedy, whatever the seed."""

    def check(api, models_root):
        greedy, sampled, cut_1, cut_2 = texts(
            api, GREEDY, {**SAMPLED, "seed": 1}, {**SAMPLED, **cut, "seed": 1}, {**SAMPLED, **cut, "seed": 2}
        )

        assert sampled != greedy
        assert cut_1 == cut_2 == greedy

    return check


def penalty_changes_greedy_text(penalty: dict[str, Any]) -> Callable[[ApiClient, Any], None]:
    """A positive penalty only lowers tokens already generated: 32 greedy tokens give it one to change, 16 not."""

    def check(api, models_root):
        plain, penalised = texts(
            api, {**GREEDY, "max_output_tokens": 32}, {**GREEDY, "max_output_tokens": 32, **penalty}
        )

        assert penalised != plain

    return check


def implemented_frequency_vs_presence(api, models_root):
    # Negative: repeats are rewarded, and only frequency's reward grows with each one.
    frequency, presence = texts(api, {**GREEDY, "frequency_penalty": -2.0}, {**GREEDY, "presence_penalty": -2.0})

    assert frequency != presence


def implemented_previous_response_id(api, models_root):
    first = respond(api, input="Hello", instructions="Be brief.", max_output_tokens=4)
    second = respond(api, input="Again", previous_response_id=first["id"], max_output_tokens=4)

    # The chain is the first turn's input and output; its instructions are its own.
    conversation = [
        {"role": "user", "content": "Hello"},
        {"role": "assistant", "content": text_of(first)},
        {"role": "user", "content": "Again"},
    ]
    assert second["usage"]["input_tokens"] == prompt_tokens(models_root, conversation)
    assert second["usage"]["input_tokens"] > first["usage"]["input_tokens"] + first["usage"]["output_tokens"]
    assert second["previous_response_id"] == first["id"]


def implemented_store(api, models_root):
    unstored = respond(api, input="Hello", max_output_tokens=2, store=False)
    chained = api.post(RESPONSES, {**BASE, "previous_response_id": unstored["id"]})

    assert unstored["store"] is False
    problem = assert_problem(chained, 404, "response_not_found")
    assert problem["error"]["param"] == "previous_response_id"


def implemented_truncation(api, models_root):
    context_length = api.get("/lmsp/v1/models/demo").json()["context_length"]
    # Each earlier turn alone fills the context ("word " is at least one token); only the last turn is short.
    long = "word " * context_length
    history = [
        {"role": "user", "content": long},
        {"role": "assistant", "content": "ok"},
        {"role": "user", "content": long},
        {"role": "assistant", "content": "ok"},
        {"role": "user", "content": "Hi"},
    ]
    disabled = respond(api, input=history, max_output_tokens=3, truncation="disabled")
    auto = respond(api, input=history, max_output_tokens=3, truncation="auto")

    assert disabled["status"] == "failed"
    assert disabled["error"]["code"] == "context_length_exceeded"
    assert (auto["status"], auto["error"], auto["truncation"]) == ("incomplete", None, "auto")
    # Whole items went from the start until it fitted: the last assistant turn and the question are left.
    assert auto["usage"]["input_tokens"] == prompt_tokens(models_root, history[3:])


def implemented_background(api, models_root):
    reply = api.post(RESPONSES, {**BASE, "max_output_tokens": 3, "background": True})

    assert reply.status_code == 200, reply.content
    answered = reply.json()
    assert (answered["status"], answered["background"], answered["output"]) == ("queued", True, [])

    def ended() -> dict[str, Any] | None:
        body = api.get(f"{RESPONSES}/{answered['id']}").json()
        return body if body["status"] not in RUNNING_OR_WAITING else None

    done = wait_until(ended, what="the background response did not end")
    assert (done["status"], done["background"], done["usage"]["output_tokens"]) == ("incomplete", True, 3)


def implemented_metadata(api, models_root):
    body = respond(api, max_output_tokens=1, metadata={"run": "7"})

    assert body["metadata"] == {"run": "7"}
    assert api.get(f"{RESPONSES}/{body['id']}").json()["metadata"] == {"run": "7"}


IMPLEMENTED: dict[str, Callable[[ApiClient, Any], None]] = {
    "model": implemented_model,
    "input": implemented_input,
    "instructions": implemented_instructions,
    "max_output_tokens": implemented_max_output_tokens,
    "stop": implemented_stop,
    "seed": implemented_seed,
    "temperature": implemented_temperature,
    "top_p": cut_to_the_top_token({"top_p": 1e-9}),
    "top_k": cut_to_the_top_token({"top_k": 1}),
    "min_p": cut_to_the_top_token({"min_p": 1.0}),
    "repetition_penalty": penalty_changes_greedy_text({"repetition_penalty": 1.3}),
    "frequency_penalty": penalty_changes_greedy_text({"frequency_penalty": 2.0}),
    "presence_penalty": penalty_changes_greedy_text({"presence_penalty": 2.0}),
    "frequency_penalty-vs-presence_penalty": implemented_frequency_vs_presence,
    "previous_response_id": implemented_previous_response_id,
    "store": implemented_store,
    "truncation": implemented_truncation,
    "background": implemented_background,
    "metadata": implemented_metadata,
}


@pytest.mark.parametrize("field", list(IMPLEMENTED))
def test_an_implemented_field_changes_the_generation(api, running_worker, worker_models_root, field):
    IMPLEMENTED[field](api, worker_models_root)


def test_stream_sends_the_events_whose_text_is_the_response(api, running_worker, web_server):
    body = {**BASE, "max_output_tokens": 6, "stream": True}
    with open_stream(web_server.base, RESPONSES, token=api.token, method="POST", body=body) as stream:
        assert (stream.status, stream.headers["content-type"].split(";")[0]) == (200, "text/event-stream")
        payloads = [event.payload for event in stream.all()]

    assert_well_formed_log(payloads)
    assert payloads[-1]["type"] in TERMINAL_TYPES
    done = api.get(f"{RESPONSES}/{payloads[0]['response']['id']}").json()
    assert text_of(done) == delta_text(payloads) == text_of(payloads[-1]["response"])
    assert done["usage"]["output_tokens"] == 6


# --------------------------------------------------------------------------- #
# Accepted and echoed: answered at once, nothing generated
# --------------------------------------------------------------------------- #

ABSENT = object()
# Service bug: OpenAI's response object has the field, and core.response_echo.response_echo leaves it out.


def case(fields: dict[str, Any], echo: dict[str, Any], id: str, marks: Any = ()) -> Any:
    return pytest.param(fields, echo, id=id, marks=marks)


ECHOED = [
    case({}, {"tools": [], "tool_choice": "auto", "parallel_tool_calls": True}, "defaults-tools"),
    case(
        {},
        {"text": {"format": {"type": "text"}, "verbosity": "medium"}, "truncation": "disabled", "top_logprobs": 0},
        "defaults-text-truncation",
    ),
    case({}, {"service_tier": "default", "store": True, "reasoning": {"effort": None, "summary": None}}, "defaults"),
    case({"tools": []}, {"tools": [], "tool_choice": "auto"}, "tools-empty"),
    # Offered but never callable: what the model may not call cannot be an ignored constraint.
    case(
        {"tools": [FUNCTION_TOOL], "tool_choice": "none"},
        {"tools": [FUNCTION_TOOL], "tool_choice": "none"},
        "tools-function-with-tool_choice-none",
    ),
    # Items of one list with different keys: each item's own fields count, not the first one's.
    # A function tool as normalized: what both published schemas require filled in (PROFILE.md 10.1).
    case(
        {"tools": [BARE_FUNCTION_TOOL, FUNCTION_TOOL], "tool_choice": "none"},
        {"tools": [{**BARE_FUNCTION_TOOL, "description": None, "strict": True}, FUNCTION_TOOL], "tool_choice": "none"},
        "tools-items-with-different-keys",
    ),
    case(
        {"tools": [{**BARE_FUNCTION_TOOL, "strict": False}]},
        {"tools": [{**BARE_FUNCTION_TOOL, "description": None, "strict": False}]},
        "tools-function-strict-false",
    ),
    case({"tool_choice": "auto"}, {"tool_choice": "auto", "tools": []}, "tool_choice-auto-without-tools"),
    # Implemented (tests/test_tool_calls.py): echoed as sent.
    case({"tools": [FUNCTION_TOOL]}, {"tools": [FUNCTION_TOOL], "tool_choice": "auto"}, "tools-function-default"),
    case(
        {"tools": [FUNCTION_TOOL], "tool_choice": {"type": "function", "name": "get_weather"}},
        {"tools": [FUNCTION_TOOL], "tool_choice": {"type": "function", "name": "get_weather"}},
        "tools-function-named",
    ),
    case(
        {"tools": [FUNCTION_TOOL], "tool_choice": "required", "parallel_tool_calls": False},
        {"tools": [FUNCTION_TOOL], "tool_choice": "required", "parallel_tool_calls": False},
        "tools-function-required-one-call",
    ),
    case({"tool_choice": "none"}, {"tool_choice": "none"}, "tool_choice-none-without-tools"),
    case({"parallel_tool_calls": False}, {"parallel_tool_calls": False}, "parallel_tool_calls-false"),
    case({"parallel_tool_calls": True}, {"parallel_tool_calls": True}, "parallel_tool_calls-true"),
    case({"max_tool_calls": 3}, {"max_tool_calls": 3}, "max_tool_calls"),
    case(
        {"text": {"format": {"type": "text"}, "verbosity": "medium"}},
        {"text": {"format": {"type": "text"}, "verbosity": "medium"}},
        "text-format-text-verbosity-medium",
    ),
    case({"text": {}}, {"text": {"format": {"type": "text"}, "verbosity": "medium"}}, "text-empty"),
    # Implemented (tests/test_structured_output_schemas.py): echoed as sent.
    case(
        {"text": {"format": {"type": "json_object"}}},
        {"text": {"format": {"type": "json_object"}, "verbosity": "medium"}},
        "text-format-json_object",
    ),
    case(
        {"text": {"format": {"type": "json_schema", "name": "answer", "schema": {"type": "object"}, "strict": True}}},
        {
            "text": {
                "format": {
                    "type": "json_schema",
                    "name": "answer",
                    "schema": {"type": "object"},
                    "strict": True,
                    "description": "",
                },
                "verbosity": "medium",
            }
        },
        "text-format-json_schema",
    ),
    case({"truncation": "auto"}, {"truncation": "auto"}, "truncation-auto"),
    case({"truncation": "disabled"}, {"truncation": "disabled"}, "truncation-disabled"),
    # OpenAI's response object has no `include`, `stream_options`, `background_options` or
    # `context_management`: accepted, with nothing to echo them in.
    case({"include": []}, {}, "include-empty"),
    case({"top_logprobs": 0}, {"top_logprobs": 0}, "top_logprobs-0"),
    case({"user": "user-42"}, {"user": "user-42"}, "user"),
    case({"safety_identifier": "hashed-42"}, {"safety_identifier": "hashed-42"}, "safety_identifier"),
    case({"prompt_cache_key": "conversation-7"}, {"prompt_cache_key": "conversation-7"}, "prompt_cache_key"),
    case({"prompt_cache_retention": "24h"}, {"prompt_cache_retention": "24h"}, "prompt_cache_retention-24h"),
    case(
        {"prompt_cache_retention": "in_memory"},
        {"prompt_cache_retention": "in_memory"},
        "prompt_cache_retention-in_memory",
    ),
    case(
        {"prompt_cache_options": {"mode": "implicit", "ttl": "30m"}},
        {"prompt_cache_options": {"mode": "implicit", "ttl": "30m"}},
        "prompt_cache_options",
    ),
    case({"service_tier": "auto"}, {"service_tier": "auto"}, "service_tier-auto"),
    case({"service_tier": "default"}, {"service_tier": "default"}, "service_tier-default"),
    case({"reasoning": {"effort": "low"}}, {"reasoning": {"effort": "low"}}, "reasoning-effort-low"),
    case(
        {"reasoning": {"effort": "medium", "summary": "auto"}},
        {"reasoning": {"effort": "medium", "summary": "auto"}},
        "reasoning-summary",
    ),
    case({"stream_options": {"include_obfuscation": False}}, {}, "stream_options"),
    case({"background_options": {"completion_window": "soonest"}}, {}, "background_options-soonest"),
    case(
        {"image": {"context_compression": "disabled"}},
        {"image": {"context_compression": "disabled"}},
        "image-context_compression-disabled",
    ),
    case({"context_management": []}, {}, "context_management-empty"),
    # Null is the absence of what the service lacks; the object says null (or nothing) for each.
    case({"prompt": None}, {"prompt": None}, "prompt-null"),
    case({"conversation": None}, {"conversation": None}, "conversation-null"),
    case({"moderation": None}, {"moderation": None}, "moderation-null"),
    case({"access_programs": None}, {"access_programs": None}, "access_programs-null"),
    # The implemented fields are echoed as well (their effect: IMPLEMENTED below).
    case({"instructions": "Be brief."}, {"instructions": "Be brief."}, "instructions"),
    case({"max_output_tokens": 7}, {"max_output_tokens": 7}, "max_output_tokens"),
    case({"temperature": 0.25, "top_p": 0.5}, {"temperature": 0.25, "top_p": 0.5}, "temperature-top_p"),
    # Left unset: the values in force, the demo model's generation config setting none (PROFILE.md 10.1).
    case(
        {},
        {"temperature": 1.0, "top_p": 1.0, "frequency_penalty": 0.0, "presence_penalty": 0.0, "completed_at": None},
        "sampling-in-force",
    ),
    case({"top_k": 9, "min_p": 0.1}, {"top_k": 9, "min_p": 0.1}, "top_k-min_p"),
    case({"repetition_penalty": 1.2}, {"repetition_penalty": 1.2}, "repetition_penalty"),
    case(
        {"frequency_penalty": 0.5, "presence_penalty": -0.5},
        {"frequency_penalty": 0.5, "presence_penalty": -0.5},
        "frequency_penalty-presence_penalty",
    ),
    case({"metadata": {"run": "7", "who": "tests"}}, {"metadata": {"run": "7", "who": "tests"}}, "metadata"),
    # What Codex CLI sends on every request (PROFILE.md 10.1): hosted tools offered under auto or none are
    # echoed and never shown to the model; a namespace's functions are offered like any other.
    *[
        case({"tools": [tool], "tool_choice": choice}, {"tools": [tool], "tool_choice": choice}, f"{kind}-{choice}")
        for tool in HOSTED_TOOLS
        for kind in [tool["type"]]
        for choice in ("auto", "none")
    ],
    case(
        {"tools": [FUNCTION_TOOL, NAMESPACE_TOOL, {"type": "web_search", "external_web_access": False}]},
        {"tools": [FUNCTION_TOOL, NAMESPACE_TOOL, {"type": "web_search", "external_web_access": False}]},
        "codex-tool-set",
    ),
    case(
        {"tools": [FUNCTION_TOOL, {"type": "web_search"}], "tool_choice": "required"},
        {"tools": [FUNCTION_TOOL, {"type": "web_search"}], "tool_choice": "required"},
        "required-with-a-function-beside-a-hosted-tool",
    ),
    # OpenAI's response object has no `include` or `client_metadata`: accepted, with nothing to echo them in.
    case({"include": ["reasoning.encrypted_content"]}, {}, "include-reasoning-encrypted_content"),
    case({"client_metadata": {"session_id": "s-1"}}, {"client_metadata": None}, "client_metadata-not-echoed"),
]


def echo_matches(body: dict[str, Any], echo: dict[str, Any]) -> dict[str, tuple[Any, Any]]:
    """The echoed fields that differ from what was expected: name -> (expected, shown).

    A field left out reads as null to the SDKs (their models default it to None), so absent matches null.
    """
    shown = {name: body.get(name, None if want is None else ABSENT) for name, want in echo.items()}
    return {name: (echo[name], value) for name, value in shown.items() if value != echo[name]}


@pytest.mark.parametrize(("fields", "echo"), ECHOED)
def test_an_accepted_field_is_echoed_by_the_response_object(api, queue, fields, echo):
    reply = api.post(RESPONSES, {**BASE, **fields, "background": True})

    assert reply.status_code == 200, reply.content
    body = reply.json()
    assert (body["object"], body["status"], body["background"]) == ("response", "queued", True)
    assert echo_matches(body, echo) == {}
    # The stored request is what later reads and every event show: the same echo.
    read = api.get(f"{RESPONSES}/{body['id']}").json()
    created = json.loads(stored(Task.objects.get(response_id=body["id"]).pk)[0][2])["response"]
    assert echo_matches(read, echo) == {}
    assert echo_matches(created, echo) == {}


ACCEPTED_INPUTS = [
    pytest.param([{"role": "user", "content": "Hi"}], id="message-without-type"),
    pytest.param(
        [
            {"role": "system", "content": "Be brief."},
            {"role": "developer", "content": [{"type": "input_text", "text": "Plain words."}]},
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Hi"}]},
        ],
        id="system-developer-and-parts",
    ),
    pytest.param(
        [
            {"role": "user", "content": "Hi"},
            # An output item of ours as the openai package echoes it back (`response.output`).
            {
                "id": "msg_01J8M8R5X4B9D2F6H1K3N7Q0ZW",
                "type": "message",
                "status": "completed",
                "role": "assistant",
                "content": [{"type": "output_text", "text": "Hello.", "annotations": [], "logprobs": []}],
            },
            {"role": "user", "content": "Again"},
        ],
        id="own-output-item-echoed",
    ),
    pytest.param(
        [
            {"role": "user", "content": "Hi"},
            {"type": "message", "role": "assistant", "content": [{"type": "refusal", "refusal": "I cannot."}]},
            {"role": "user", "content": "Please"},
        ],
        id="refusal-part",
    ),
    pytest.param(
        [
            {"role": "user", "content": "Weather in Oslo?"},
            {
                "type": "function_call",
                "id": "fc_1",
                "call_id": "call_1",
                "name": "get_weather",
                "arguments": '{"city": "Oslo"}',
                "status": "completed",
            },
            {"type": "function_call_output", "call_id": "call_1", "output": "Rain"},
        ],
        id="function_call-and-output",
    ),
    pytest.param(
        [
            {"type": "function_call", "call_id": "call_2", "name": "get_weather", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "call_2", "output": [{"type": "input_text", "text": "Sun"}]},
        ],
        id="function_call_output-parts",
    ),
]


@pytest.mark.parametrize("items", ACCEPTED_INPUTS)
def test_input_items_as_the_sdks_send_them_are_accepted(api, queue, items):
    reply = api.post(
        RESPONSES, {**BASE, "input": items, "background": True, "tools": [FUNCTION_TOOL], "tool_choice": "none"}
    )

    assert reply.status_code == 200, reply.content
    stored_input = Response.objects.get(pk=reply.json()["id"]).request["input"]
    assert len(stored_input) == len(items)
    # What only an echoed output item carries is not part of the conversation kept.
    assert not any({"id", "status"} & set(item) for item in stored_input)


def test_a_replayed_history_of_codex_is_accepted_and_its_reasoning_left_out(api, queue):
    """Codex CLI resends its whole history (store: false): reasoning items echoed back hold nothing for a
    model without a reasoning mode and are left out; a namespace function's call comes with its namespace."""
    items = [
        {"role": "user", "content": "Hi"},
        {"type": "reasoning", "id": "rs_1", "summary": [], "content": None, "encrypted_content": "gAAAA"},
        {"type": "function_call", "name": "spawn_agent", "namespace": "agents", "arguments": "{}", "call_id": "c1"},
        {"type": "function_call_output", "call_id": "c1", "output": "spawned"},
    ]
    fields = {"tools": [NAMESPACE_TOOL], "client_metadata": {"session_id": "s-1"}, "store": False}

    body = {**BASE, **fields, "input": items, "include": ["reasoning.encrypted_content"]}

    reply = api.post(TASKS, {"type": "response", "input": body})

    assert reply.status_code == 202, reply.content
    response_id = reply.json()["response_id"]
    assert "client_metadata" not in api.get(f"{RESPONSES}/{response_id}").json()
    request = Response.objects.get(pk=response_id).request
    assert [item.get("type", "message") for item in request["input"]] == [
        "message",
        "function_call",
        "function_call_output",
    ]
    # Stored with the response, as OpenAI keeps it, though never echoed.
    assert request["client_metadata"] == {"session_id": "s-1"}


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"tools": [{"type": "web_search"}], "tool_choice": "required"}, "tool_choice"),
        (
            {
                "tools": [{"type": "web_search"}],
                "tool_choice": {"type": "allowed_tools", "mode": "auto", "tools": [{"type": "web_search"}]},
            },
            "tool_choice",
        ),
        ({"input": [{"type": "reasoning", "summary": []}]}, "input"),
        (
            {"tools": [FUNCTION_TOOL, {**NAMESPACE_TOOL, "tools": [{**FUNCTION_TOOL, "description": "again"}]}]},
            "tools[1].tools[0].name",
        ),
    ],
    ids=["required-hosted-only", "allowed-hosted", "reasoning-only", "namespace-name-twice"],
)
def test_what_no_runnable_tool_or_item_can_answer_is_refused_naming_the_field(api, queue, fields, param):
    before = counts()

    reply = api.post(RESPONSES, {**BASE, **fields, "background": True})

    problem = assert_problem(reply, 400, "invalid_request")
    assert (problem["error"]["param"], [error["field"] for error in problem["errors"]]) == (param, [param])
    assert counts() == before


def test_on_restart_is_the_background_tasks_policy(api, queue):
    reply = api.post(RESPONSES, {**BASE, "background": True, "on_restart": "resume"})

    assert reply.status_code == 200, reply.content
    assert Task.objects.get(response_id=reply.json()["id"]).on_restart == "resume"


# --------------------------------------------------------------------------- #
# Refused by name: 400 unsupported_parameter, nothing written
# --------------------------------------------------------------------------- #

REFUSED = [
    # Freeform grammar tools are not built: refused by name, alone or inside a namespace.
    pytest.param({"tools": [{"type": "custom", "name": "grammar_tool"}]}, "tools[0].type", id="tools-custom"),
    pytest.param(
        {"tools": [{**NAMESPACE_TOOL, "tools": [{"type": "custom", "name": "grammar_tool"}]}]},
        "tools[0].tools[0].type",
        id="tools-namespace-custom",
    ),
    pytest.param({"tool_choice": {"type": "web_search_preview"}}, "tool_choice", id="tool_choice-hosted"),
    pytest.param({"text": {"verbosity": "low"}}, "text.verbosity", id="text-verbosity-low"),
    pytest.param({"text": {"verbosity": "high"}}, "text.verbosity", id="text-verbosity-high"),
    pytest.param({"include": ["message.output_text.logprobs"]}, "include[0]", id="include-logprobs"),
    pytest.param(
        {"include": ["reasoning.encrypted_content", "file_search_call.results"]}, "include[1]", id="include-second"
    ),
    pytest.param({"include": ["web_search_call.action.sources"]}, "include[0]", id="include-web_search"),
    pytest.param({"include": ["no.such.thing"]}, "include[0]", id="include-unknown"),
    pytest.param({"top_logprobs": 3}, "top_logprobs", id="top_logprobs-3"),
    pytest.param(
        {"top_logprobs": 3, "include": ["message.output_text.logprobs"]}, "include[0]", id="top_logprobs-with-include"
    ),
    pytest.param({"service_tier": "flex"}, "service_tier", id="service_tier-flex"),
    pytest.param({"service_tier": "priority"}, "service_tier", id="service_tier-priority"),
    pytest.param({"service_tier": "scale"}, "service_tier", id="service_tier-scale"),
    pytest.param({"prompt": {"id": "pmpt_1", "version": "2"}}, "prompt", id="prompt"),
    pytest.param({"moderation": {"model": "omni-moderation-latest"}}, "moderation", id="moderation"),
    pytest.param({"access_programs": {"cyber": "standard"}}, "access_programs", id="access_programs"),
    pytest.param(
        {"context_management": [{"type": "compaction", "compact_threshold": 1000}]},
        "context_management",
        id="context_management-compaction",
    ),
    pytest.param(
        {"background_options": {"completion_window": "2h"}},
        "background_options.completion_window",
        id="background_options-2h",
    ),
    pytest.param(
        {"image": {"context_compression": "enabled"}}, "image.context_compression", id="image-context_compression"
    ),
    pytest.param(
        {
            "input": [
                {"role": "user", "content": "Hi"},
                {"type": "web_search_call", "id": "ws_1", "status": "completed", "action": {"type": "search"}},
            ]
        },
        "input[1].type",
        id="input-web_search_call-item",
    ),
    pytest.param(
        {"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0].type", id="input-item_reference-item"
    ),
    pytest.param(
        {
            "input": [
                {
                    "role": "user",
                    "content": [
                        {"type": "input_text", "text": "What is this?"},
                        {"type": "input_image", "image_url": "https://example.com/a.png", "detail": "auto"},
                    ],
                }
            ]
        },
        "input[0].content[1].type",
        id="input-input_image-part",
    ),
    pytest.param(
        {
            "input": [
                {"role": "user", "content": "Hi"},
                {"role": "user", "content": [{"type": "input_file", "file_id": "file_1"}]},
            ]
        },
        "input[1].content[0].type",
        id="input-input_file-part",
    ),
]


def post_refused(api: ApiClient, endpoint: str, fields: dict[str, Any]):
    body = {**BASE, **fields}
    if endpoint == TASKS:
        return api.post(TASKS, {"type": "response", "input": body})
    return api.post(RESPONSES, {**body, "background": True})


@pytest.mark.parametrize("endpoint", [RESPONSES, TASKS], ids=["responses", "tasks"])
@pytest.mark.parametrize(("fields", "param"), REFUSED)
def test_what_the_service_cannot_do_is_refused_by_name_and_writes_nothing(api, queue, endpoint, fields, param):
    before = counts()

    reply = post_refused(api, endpoint, fields)

    problem = assert_problem(reply, 400, "unsupported_parameter")
    named = f"input.{param}" if endpoint == TASKS else param
    if named.endswith("*"):
        prefix = named.removesuffix("*")
        named = problem["param"] if problem["param"].startswith(prefix) else prefix
    assert (problem["param"], problem["error"]["param"], problem["error"]["code"]) == (
        named,
        named,
        "unsupported_parameter",
    )
    assert [error["field"] for error in problem["errors"]] == [named]
    assert counts() == before


INVALID = [
    pytest.param({"tool_choice": "required"}, "tool_choice", id="tool_choice-required-without-tools"),
    pytest.param(
        {"tool_choice": {"type": "function", "name": "get_weather"}},
        "tool_choice",
        id="tool_choice-named-without-tools",
    ),
    pytest.param({"colour": "red"}, "colour", id="unknown-field"),
    pytest.param({"text": {"format": {"type": "text"}, "colour": "red"}}, "text.colour", id="unknown-nested-field"),
    pytest.param(
        {"tools": [BARE_FUNCTION_TOOL, {**FUNCTION_TOOL, "colour": "red"}], "tool_choice": "none"},
        "tools.1.colour",
        id="unknown-field-in-a-later-list-item",
    ),
]


@pytest.mark.parametrize("endpoint", [RESPONSES, TASKS], ids=["responses", "tasks"])
@pytest.mark.parametrize(("fields", "param"), INVALID)
def test_a_contradiction_or_an_unknown_field_is_an_invalid_request_naming_it(api, queue, endpoint, fields, param):
    before = counts()

    reply = post_refused(api, endpoint, fields)

    problem = assert_problem(reply, 400, "invalid_request")
    named = f"input.{param}" if endpoint == TASKS else param
    assert named in [error["field"] for error in problem["errors"]]
    assert problem["error"]["param"] == named
    assert counts() == before


@pytest.mark.parametrize(
    ("endpoint", "param"),
    [
        pytest.param(RESPONSES, "model", id="responses"),
        pytest.param(TASKS, "input.model", id="tasks"),
    ],
)
def test_an_unknown_model_is_named_by_its_path(api, queue, endpoint, param):
    before = counts()

    problem = assert_problem(post_refused(api, endpoint, {"model": "no-such-model"}), 400, "model_not_found")

    assert (problem["error"]["param"], [error["field"] for error in problem["errors"]]) == (param, [param])
    assert counts() == before
