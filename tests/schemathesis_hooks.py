"""Schemathesis hooks of ``tests/test_schemathesis.py``; its CLI loads them by name (``SCHEMATHESIS_HOOKS``).

Each is a checker quirk, not a defect, and docs/api.md ("Schema conformance") explains it:

- ``map_case`` points generated response requests at the installed model and
  keeps their generations short. Only values the schema allows are changed,
  and into values it allows, so a generated negative case stays negative.
- ``filter_failure`` drops three kinds of failure only. (1) The server refusing
  a request the schema allows where the specification itself says so for a
  reason no schema can state (a state of the database, a rule across a
  header and the body): each such refusal is named in ``SPEC_REFUSALS``, by
  operation, status, code and the fields it names. (2) The server accepting
  the coverage phase's request with an undeclared header added. (3) The
  documented ``502 webhook_test_failed`` of a sample event sent to a
  generated endpoint's URL, which nothing answers (no generated host does).
  Everything else still fails the run.
"""

from __future__ import annotations

import re
from typing import Any

import schemathesis
from schemathesis.core.failures import AcceptedNegativeData, ServerError
from schemathesis.core.parameters import ParameterLocation
from schemathesis.generation.meta import CoveragePhaseData, CoverageScenario
from schemathesis.openapi.checks import RejectedPositiveData

# The one model the test server has; any other name the schema allows is 400 model_not_found.
MODEL = "demo"
MAX_MODEL_NAME = 200
# Every generation stays this short, so a waiting POST /responses answers in well under a second.
MAX_OUTPUT_TOKENS = 4
MAX_OUTPUT_TOKENS_ALLOWED = 1_000_000

# (operation, status, problem code, {field: message prefix}) the specification answers to a
# request the schema cannot tell from a good one.
STREAMS = ("GET /lmsp/v1/tasks/{task_id}/events", "GET /lmsp/v1/responses/{response_id}", "POST /lmsp/v1/responses")
SPEC_REFUSALS = [
    # A generated pairing code is unknown (PROFILE.md 1); only `lmsp_pair` makes real ones.
    ("POST /lmsp/v1/pair", 400, "invalid_request", {"code": "unknown, used or expired"}),
    ("POST /lmsp/v1/pair", 400, "invalid_request", {"code": "locked"}),
    ("POST /lmsp/v1/pair", 400, "invalid_request", {"client_name": "already in use"}),
    # A cursor past the newest event of the task (PROFILE.md 4): the schema cannot know how many there are.
    *(
        (operation, 400, "invalid_request", {cursor: "must be at most"})
        for operation in STREAMS
        for cursor in ("starting_after", "Last-Event-ID")
    ),
    # A webhook URL whose host resolves to a private, loopback, ... address, or with a port out of
    # range (docs/webhooks.md): the schema cannot state what an address is.
    *(
        (operation, 400, "invalid_request", {"url": "not an allowed target"})
        for operation in ("POST /lmsp/v1/webhook_endpoints", "POST /lmsp/v1/webhook_endpoints/{webhook_endpoint_id}")
    ),
    # `on_restart: retry` needs an Idempotency-Key (PROFILE.md 0): a header the body decides about.
    ("POST /lmsp/v1/tasks", 400, "invalid_request", {"Idempotency-Key": "required when on_restart is 'retry'"}),
    # A previous_response_id the schema allows names no stored response of the client (PROFILE.md 10.2).
    ("POST /lmsp/v1/responses", 404, "response_not_found", {"previous_response_id": "no stored response"}),
    ("POST /lmsp/v1/tasks", 404, "response_not_found", {"input.previous_response_id": "no stored response"}),
    # A conversation goes with a chain of responses or without one (PROFILE.md 12.1): a rule across two fields.
    ("POST /lmsp/v1/responses", 400, "invalid_request", {"conversation": "not with previous_response_id"}),
    ("POST /lmsp/v1/tasks", 400, "invalid_request", {"input.conversation": "not with previous_response_id"}),
    # A multipart part is a file only with a filename (docs/batches.md): OpenAPI has no word for it.
    ("POST /lmsp/v1/files", 400, "invalid_request", {"file": "required, as a part with a filename"}),
    # Function tools (PROFILE.md 10.4, docs/tools.md): rules across a request's tools and its tool_choice,
    # and parameters the grammar engine cannot compile, which no schema states. `[*]`: any index.
    *(
        refusal
        for operation, prefix, function in (
            ("POST /lmsp/v1/responses", "", ""),
            ("POST /lmsp/v1/tasks", "input.", ""),
            ("POST /lmsp/v1/chat/completions", "", ".function"),
        )
        for refusal in (
            (operation, 400, "invalid_request", {f"{prefix}tool_choice": "requires tools"}),
            (operation, 400, "invalid_request", {f"{prefix}tool_choice": "no tool named"}),
            (operation, 400, "invalid_request", {f"{prefix}tool_choice": "allows no tool"}),
            (operation, 400, "invalid_request", {f"{prefix}tools[*]{function}.name": "tool names must be unique"}),
            (operation, 400, "invalid_request", {f"{prefix}tools[*]{function}.parameters": ""}),
        )
    ),
    # A namespace's functions are offered by their own names beside every other function (docs/tools.md).
    *(
        refusal
        for operation, prefix in (("POST /lmsp/v1/responses", ""), ("POST /lmsp/v1/tasks", "input."))
        for refusal in (
            (operation, 400, "invalid_request", {f"{prefix}tools[*].tools[*].name": "tool names must be unique"}),
            (operation, 400, "invalid_request", {f"{prefix}tools[*].tools[*].parameters": ""}),
        )
    ),
    # A chat allowed_tools choice is free-form in the schema (OpenAI's shape nests it once more).
    ("POST /lmsp/v1/chat/completions", 400, "invalid_request", {"tool_choice.allowed_tools": "malformed"}),
    # Two token limits that disagree (PROFILE.md 10.3): a rule across two fields.
    ("POST /lmsp/v1/chat/completions", 400, "invalid_request", {"max_tokens": "differs from max_completion_tokens"}),
    # One key with another body (PROFILE.md 5): generated keys repeat across generated bodies.
    *(
        (operation, 422, "idempotency_key_reused", {"Idempotency-Key": "already used with another body"})
        for operation in ("POST /lmsp/v1/tasks", "POST /lmsp/v1/responses")
    ),
]


# The Messages routes answer Anthropic's errors, which carry no code and no field list: their refusals of
# schema-valid requests are named by (operation, status, the start of error.message), the message starting
# with the field's path (tasks_app/anthropic/errors.py). The same rules across fields as above: the ids a
# tool_result names, tool names and tool_choice, schemas the grammar engine cannot compile, the keys.
MESSAGES, COUNT_TOKENS = "POST /lmsp/v1/messages", "POST /lmsp/v1/messages/count_tokens"
_MESSAGE_RULES = [
    r"messages\.\d+\.content\.\d+\.tool_use_id: tool_use_id must name a tool_use block",
    # A last assistant message asks the answer to continue it (a prefill), which is refused by name.
    r"messages\.\d+: a last assistant message",
    r"tools\.\d+\.name: two tools are named",
    r"tools\.\d+\.input_schema: the input schema cannot be enforced",
    r"output_config\.format\.schema: the schema cannot be enforced",
    r"tool_choice 'any' requires tools",
    r"tool_choice: 'any' requires a tool this service can run",
    r"tool_choice\.name: tool_choice names .* which is not among the tools",
    r"tool_choice\.name: .* runs on Anthropic's servers",
]
ANTHROPIC_REFUSALS = [
    *((operation, 400, rule) for operation in (MESSAGES, COUNT_TOKENS) for rule in _MESSAGE_RULES),
    # A generated conversation longer than the demo model's context (refused before it is queued).
    (MESSAGES, 400, r"prompt is too long: \d+ tokens > \d+ maximum"),
    # A key is for streams only (a retry resumes the stream): a rule across a header and the body.
    (MESSAGES, 400, r"Idempotency-Key: send it with stream: true"),
    (MESSAGES, 400, r"Idempotency-Key is supported on streamed messages only"),
    (MESSAGES, 400, r"Last-Event-ID \d+ is past the newest event"),
    (MESSAGES, 422, r"This Idempotency-Key was first used with a different request body"),
]


def is_anthropic_refusal(label: str, status: int, body: dict[str, Any]) -> bool:
    """Whether this answer is one of ``ANTHROPIC_REFUSALS``."""
    error = body.get("error")
    message = error.get("message") if isinstance(error, dict) and body.get("type") == "error" else None
    if not isinstance(message, str):
        return False
    return any(
        (operation, wanted) == (label, status) and re.match(rule, message)
        for operation, wanted, rule in ANTHROPIC_REFUSALS
    )


# Ollama's routes answer Ollama's {"error": "<code>: <detail>"} (tasks_app/ollama/errors.py): their refusals of
# schema-valid requests are named by (operation, status, the start of the error). The same kinds of rules across
# fields as above, and what depends on the model: its context (num_ctx, a long conversation), schemas the grammar
# engine cannot compile, tool names, a stop beside a format, repeat_last_n beside a repetition penalty.
OLLAMA_CHAT, OLLAMA_GENERATE, OLLAMA_SHOW = "POST /api/chat", "POST /api/generate", "POST /api/show"
_OLLAMA_RULES = [
    r"invalid_request: options\.num_ctx: \d+ is more than the model's context",
    r"unsupported_parameter: options\.repeat_last_n: the repetition penalty reads the whole context",
    r"unsupported_parameter: options\.stop: a stop string would cut the JSON",
    r"invalid_request: the format's schema cannot be enforced",
    # A stream: false generation whose prompt is over the model's context fails with its task's problem.
    r"context_length_exceeded: ",
]
OLLAMA_REFUSALS = [
    *((operation, 400, rule) for operation in (OLLAMA_CHAT, OLLAMA_GENERATE) for rule in _OLLAMA_RULES),
    (OLLAMA_CHAT, 400, r"invalid_request: tool name .*: tool names must be unique"),
    (OLLAMA_CHAT, 400, r"invalid_request: the parameters of tool .* cannot be enforced"),
]


def is_ollama_refusal(label: str, status: int, body: dict[str, Any]) -> bool:
    """Whether this answer is one of ``OLLAMA_REFUSALS``."""
    error = body.get("error")
    if not isinstance(error, str) or set(body) != {"error"}:
        return False
    return any(
        (operation, wanted) == (label, status) and re.match(rule, error) for operation, wanted, rule in OLLAMA_REFUSALS
    )


def _ollama_short(request: dict[str, Any]) -> None:
    """An Ollama generation on the installed model, its ``options.num_predict`` at most ``MAX_OUTPUT_TOKENS``."""
    _on_the_model(request)
    if request.get("options") is None:
        request["options"] = {}
    options = request["options"]
    if not isinstance(options, dict):
        return
    limit = options.get("num_predict")
    if _is_allowed_int(limit, 1, 2**63):
        options["num_predict"] = min(limit, MAX_OUTPUT_TOKENS)
    elif limit in (None, -1, -2) and not isinstance(limit, bool):
        options["num_predict"] = MAX_OUTPUT_TOKENS


# A sample event to a URL that does not answer (docs/webhooks.md): the upstream's failure, not the server's.
UNANSWERED_TEST = ("POST /lmsp/v1/webhook_endpoints/{webhook_endpoint_id}/test", 502, "webhook_test_failed")


def _is_allowed_int(value: Any, low: int, high: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and low <= value <= high


def _on_the_model(request: dict[str, Any]) -> None:
    model = request.get("model")
    if isinstance(model, str) and 1 <= len(model) <= MAX_MODEL_NAME and "\x00" not in model:
        request["model"] = MODEL


def _shorten(request: dict[str, Any], *limits: str) -> None:
    _on_the_model(request)
    for limit in limits or ("max_output_tokens",):
        tokens = request.get(limit)
        if limit not in request or _is_allowed_int(tokens, 1, MAX_OUTPUT_TOKENS_ALLOWED):
            request[limit] = min(tokens or MAX_OUTPUT_TOKENS, MAX_OUTPUT_TOKENS)


@schemathesis.hook
def map_case(context: schemathesis.HookContext, case: schemathesis.Case) -> schemathesis.Case:
    # map_case, not map_body: the coverage phase's cases go through this hook only.
    body = case.body
    if not isinstance(body, dict):
        return case
    if case.operation.label == "POST /lmsp/v1/tasks" and isinstance(body.get("input"), dict):
        _shorten(body["input"])
    elif case.operation.label == "POST /lmsp/v1/responses":
        _shorten(body)
    elif case.operation.label == "POST /lmsp/v1/chat/completions":
        _shorten(body, "max_tokens", "max_completion_tokens")
    elif case.operation.label == MESSAGES:
        _shorten(body, "max_tokens")
    elif case.operation.label == COUNT_TOKENS:
        _on_the_model(body)
    elif case.operation.label in (OLLAMA_CHAT, OLLAMA_GENERATE):
        _ollama_short(body)
    elif case.operation.label == OLLAMA_SHOW:
        _on_the_model(body)
    return case


def _problem(response: schemathesis.Response) -> dict[str, Any]:
    try:
        body = response.json()
    except ValueError:
        return {}
    return body if isinstance(body, dict) else {}


def is_spec_refusal(label: str, status: int, problem: dict[str, Any]) -> bool:
    """Whether this answer is one of ``SPEC_REFUSALS``: same operation, status, code, and exactly its fields."""
    errors = problem.get("errors") or []
    for operation, wanted_status, code, fields in SPEC_REFUSALS:
        if (operation, wanted_status, code) != (label, status, problem.get("code")):
            continue
        if len(errors) == len(fields) and all(
            isinstance(error, dict)
            and (field := _field_of(str(error.get("field")), fields)) is not None
            and str(error.get("message", "")).startswith(fields[field])
            for error in errors
        ):
            return True
    return False


def _field_of(named: str, fields: dict[str, str]) -> str | None:
    """The key of ``fields`` that the error's field matches (``[*]`` in a key stands for any index)."""
    for field in fields:
        pattern = re.escape(field).replace(re.escape("[*]"), r"\[\d+\]")
        if re.fullmatch(pattern, named):
            return field
    return None


def is_unknown_header(case: schemathesis.Case) -> bool:
    """Whether the case is the coverage phase's request with an undeclared header added.

    HTTP lets every hop add headers, so no server refuses one it does not
    know; the checker expects a refusal all the same.
    """
    data = case.meta.phase.data if case.meta is not None else None
    return (
        isinstance(data, CoveragePhaseData)
        and data.parameter_location == ParameterLocation.HEADER
        and data.scenario == CoverageScenario.OBJECT_UNEXPECTED_PROPERTIES
    )


@schemathesis.hook
def filter_failure(
    context: schemathesis.HookContext, failure: Any, case: schemathesis.Case, response: schemathesis.Response
) -> bool:
    """Keep every failure except a spec refusal of schema-valid data and an accepted unknown header."""
    if isinstance(failure, RejectedPositiveData):
        label, status, body = case.operation.label, response.status_code, _problem(response)
        return not (
            is_spec_refusal(label, status, body)
            or is_anthropic_refusal(label, status, body)
            or is_ollama_refusal(label, status, body)
        )
    if isinstance(failure, AcceptedNegativeData):
        return not is_unknown_header(case)
    if isinstance(failure, ServerError):
        return (case.operation.label, response.status_code, _problem(response).get("code")) != UNANSWERED_TEST
    return True
