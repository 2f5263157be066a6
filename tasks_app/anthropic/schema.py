"""Anthropic's Messages API in the served OpenAPI schema: the requests, the Message, its stream, the errors.

The request serializers read the content blocks, tools and tool choice as
plain JSON (``translate.py`` checks them, naming the path of a fault), so
spectacular cannot see their shapes: they are written out here, exactly as
strict as the translation, so that a request the schema allows is one the
service takes (apart from the rules across fields no schema states, listed in
docs/api.md "Schema conformance"). The views name these in their
``operation`` annotations; ``tasks_app/api/schema_generator.py`` adds the
components (``SCHEMA_COMPONENTS``) and writes each error answer with
``error_content``, since these routes answer Anthropic's error shape, not
problem+json (``errors.py``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tasks_app import exceptions as exc
from tasks_app.anthropic.errors import anthropic_error, error_type
from tasks_app.anthropic.serializers import MAX_MESSAGES, MAX_STOP_SEQUENCES, MAX_TOOLS
from tasks_app.anthropic.translate import THINKING_TYPES, TOOL_CHOICE_TYPES

ERROR_MEDIA_TYPE = "application/json"
STREAM_EVENT = "AnthropicStreamEvent"
NAME_PATTERN = "^[a-zA-Z0-9_-]{1,128}$"


def _ref(name: str) -> dict[str, str]:
    return {"$ref": f"#/components/schemas/{name}"}


ANY = _ref("JsonValue")
# A block or setting whose other members the service does not read (cache_control marks, citations...).
OPEN = {"additionalProperties": ANY}
ANY_OBJECT = {"type": "object", **OPEN}
NULLABLE_OBJECT = {"type": ["object", "null"], **OPEN}


def _typed(kind: str, required: Sequence[str] = (), **properties: Any) -> dict[str, Any]:
    return {
        "type": "object",
        "required": ["type", *required],
        "properties": {"type": {"type": "string", "enum": [kind]}, **properties},
        **OPEN,
    }


TEXT = {"type": "string"}
TEXT_BLOCK = _typed("text", ["text"], text=TEXT)
TOOL_REFERENCE = _typed("tool_reference", ["tool_name"], tool_name=TEXT)
TOOL_RESULT = _typed(
    "tool_result",
    ["tool_use_id"],
    tool_use_id={"type": "string", "description": "The `id` of a `tool_use` block of an earlier assistant message."},
    content={
        "oneOf": [TEXT, {"type": "array", "items": {"oneOf": [TEXT_BLOCK, TOOL_REFERENCE]}}, {"type": "null"}],
        "description": "A `tool_reference` block loads the deferred tool it names (`defer_loading`).",
    },
)
TOOL_USE_IN = _typed(
    "tool_use", ["id", "name", "input"], id={"type": "string", "minLength": 1}, name={"type": "string", "minLength": 1}
)
TOOL_USE_IN["properties"]["input"] = ANY_OBJECT


def _message(role: str, blocks: Sequence[dict[str, Any]], description: str) -> dict[str, Any]:
    return {
        "type": "object",
        "required": ["role", "content"],
        "properties": {
            "role": {"type": "string", "enum": [role]},
            "content": {"oneOf": [TEXT, {"type": "array", "items": {"oneOf": list(blocks)}}]},
        },
        "additionalProperties": False,
        "description": description,
    }


MESSAGES = {
    "type": "array",
    "minItems": 1,
    "maxItems": MAX_MESSAGES,
    "items": {
        "oneOf": [
            _message("user", [TEXT_BLOCK, TOOL_RESULT], "Image, document and other blocks are refused by name."),
            _message(
                "assistant",
                [TEXT_BLOCK, TOOL_USE_IN, _typed("thinking"), _typed("redacted_thinking")],
                "An earlier answer; its `thinking` blocks are taken and left out of the prompt. The last message "
                "must not be an assistant's (a prefill is refused by name).",
            ),
            _message("system", [TEXT_BLOCK], "Extension (what Claude Code sends): more of the system prompt."),
        ]
    },
}
CUSTOM_TOOL = {
    "type": "object",
    "required": ["name", "input_schema"],
    "properties": {
        "type": {"type": ["string", "null"], "enum": ["custom", None]},
        "name": {"type": "string", "pattern": NAME_PATTERN},
        "description": {"type": ["string", "null"]},
        "input_schema": {
            "type": "object",
            "required": ["type"],
            "properties": {"type": {"type": "string", "enum": ["object"]}},
            **OPEN,
            "description": "A JSON Schema the arguments are generated under (a schema the grammar engine cannot "
            "enforce is refused).",
        },
        "defer_loading": {**ANY, "description": "`true`: shown to the model once a `tool_reference` names it."},
        **{key: ANY for key in ("cache_control", "strict", "input_examples", "eager_input_streaming")},
        "allowed_callers": ANY,
    },
    "additionalProperties": False,
    "description": "A client tool: the model calls it, the client runs it.",
}
SERVER_TOOL = {
    "type": "object",
    "required": ["type", "name"],
    "properties": {
        "type": {"type": "string", "minLength": 1, "pattern": "^[^\\u0000]*$", "not": {"enum": ["custom"]}},
        "name": {"type": "string", "pattern": NAME_PATTERN},
    },
    **OPEN,
    "description": "A tool run on Anthropic's side (web search, code execution...): offered, never shown to the "
    "model; a `tool_choice` that requires it is refused by name.",
}
TOOL_CHOICE = {
    "type": "object",
    "required": ["type"],
    "properties": {
        "type": {"type": "string", "enum": list(TOOL_CHOICE_TYPES)},
        "name": {"type": "string", "description": "With `type: tool`: the tool the answer must call."},
        "disable_parallel_tool_use": {"type": "boolean"},
    },
    "additionalProperties": False,
    "description": "Enforced: `any` and `tool` constrain the answer to a call, `none` to text.",
}
SYSTEM = {"oneOf": [TEXT, {"type": "array", "items": TEXT_BLOCK}]}
OUTPUT_CONFIG = {
    "type": ["object", "null"],
    "properties": {
        "effort": ANY,
        "format": {
            "oneOf": [
                {"type": "null"},
                _typed("json_schema", ["schema"], schema=ANY_OBJECT),
            ],
            "description": "Enforced: the answer's text is generated under the schema.",
        },
    },
    "additionalProperties": False,
}
STRING = {"type": "string", "minLength": 1}

# What a Messages request and a token count share (serializers._Common).
COMMON = {
    "model": {"type": "string", "minLength": 1, "maxLength": 200},
    "messages": MESSAGES,
    "system": SYSTEM,
    "tools": {"type": "array", "maxItems": MAX_TOOLS, "items": {"oneOf": [CUSTOM_TOOL, SERVER_TOOL]}},
    "tool_choice": TOOL_CHOICE,
    "thinking": {
        "type": ["object", "null"],
        "required": ["type"],
        "properties": {"type": {"type": "string", "enum": list(THINKING_TYPES)}},
        **OPEN,
        "description": "Accepted; these models do not think aloud.",
    },
    "output_config": OUTPUT_CONFIG,
    "cache_control": {**NULLABLE_OBJECT, "description": "Accepted: the prefix cache works on its own."},
    "context_management": NULLABLE_OBJECT,
    "speed": {"type": ["string", "null"], "minLength": 1},
    "container": {"type": "null", "description": "Only null: code execution containers are refused by name."},
    "mcp_servers": {"type": ["array", "null"], "maxItems": 0, "description": "Only empty: refused by name."},
}
COUNT_TOKENS_REQUEST = {
    "type": "object",
    "required": ["model", "messages"],
    "properties": COMMON,
    "additionalProperties": False,
    "description": "A Messages request's prompt (its `max_tokens`, sampling and stream settings left out).",
}
MESSAGE_REQUEST = {
    "type": "object",
    "required": ["model", "max_tokens", "messages"],
    "properties": {
        **COMMON,
        "max_tokens": {"type": "integer", "minimum": 1},
        "stream": {"type": "boolean", "default": False},
        "stop_sequences": {"type": "array", "maxItems": MAX_STOP_SEQUENCES, "items": STRING},
        "temperature": {"type": "number", "minimum": 0, "maximum": 1},
        "top_p": {"type": "number", "minimum": 0, "maximum": 1},
        "top_k": {"type": "integer", "minimum": 1},
        "metadata": {**NULLABLE_OBJECT, "description": "Accepted, not read."},
        "service_tier": STRING,
        "inference_geo": {"type": ["string", "null"], "minLength": 1},
        "diagnostics": NULLABLE_OBJECT,
        "on_restart": {
            "type": "string",
            "enum": ["fail", "resume"],
            "default": "fail",
            "description": "Extension (as on `POST /responses`): the generation's fate if the service restarts.",
        },
    },
    "additionalProperties": False,
    "description": "Anthropic's Messages request (PROFILE.md 11.1).",
}

# --- answers ------------------------------------------------------------------------------------------

STOP_REASONS = ["end_turn", "max_tokens", "stop_sequence", "tool_use"]
_USAGE = {
    "type": "object",
    "required": ["input_tokens", "output_tokens", "cache_creation_input_tokens", "cache_read_input_tokens"],
    "properties": {
        "input_tokens": {"type": "integer", "minimum": 0, "description": "The prompt's tokens the cache did not hold."},
        "output_tokens": {"type": "integer", "minimum": 0},
        "cache_creation_input_tokens": {"type": "integer", "enum": [0]},
        "cache_read_input_tokens": {"type": "integer", "minimum": 0, "description": "Read from the prefix cache."},
        "service_tier": {"type": "string", "enum": ["standard"]},
    },
}
_TEXT_OUT = {
    "type": "object",
    "required": ["type", "text"],
    "properties": {"type": {"type": "string", "enum": ["text"]}, "text": {"type": "string"}},
}
_TOOL_USE_OUT = {
    "type": "object",
    "required": ["type", "id", "name", "input"],
    "properties": {
        "type": {"type": "string", "enum": ["tool_use"]},
        "id": {"type": "string"},
        "name": {"type": "string"},
        "input": {"type": "object"},
    },
}
_MESSAGE = {
    "type": "object",
    "required": ["id", "type", "role", "model", "content", "stop_reason", "stop_sequence", "usage"],
    "properties": {
        "id": {"type": "string", "pattern": "^msg_", "description": "The response's id with `msg_` for `resp_`."},
        "type": {"type": "string", "enum": ["message"]},
        "role": {"type": "string", "enum": ["assistant"]},
        "model": {"type": "string"},
        "content": {"type": "array", "items": {"oneOf": [_ref("AnthropicTextBlock"), _ref("AnthropicToolUseBlock")]}},
        "stop_reason": {"type": ["string", "null"], "enum": [*STOP_REASONS, None]},
        "stop_sequence": {"type": ["string", "null"]},
        "usage": _ref("AnthropicUsage"),
    },
}
_ERROR_BODY = {
    "type": "object",
    "required": ["type", "message"],
    "properties": {"type": {"type": "string"}, "message": {"type": "string"}},
}


def _event(kind: str, required: Sequence[str] = (), **properties: Any) -> dict[str, Any]:
    return {
        "type": "object",
        "required": ["type", *required],
        "properties": {"type": {"type": "string", "enum": [kind]}, **properties},
        "additionalProperties": False,
    }


def _delta(kind: str, field: str) -> dict[str, Any]:
    return _event(kind, [field], **{field: {"type": "string"}})


_INDEX = {"type": "integer", "minimum": 0}
STREAM_EVENTS = [
    _event("message_start", ["message"], message=_ref("AnthropicMessage")),
    _event("ping"),
    _event(
        "content_block_start",
        ["index", "content_block"],
        index=_INDEX,
        content_block={"oneOf": [_ref("AnthropicTextBlock"), _ref("AnthropicToolUseBlock")]},
    ),
    _event(
        "content_block_delta",
        ["index", "delta"],
        index=_INDEX,
        delta={"oneOf": [_delta("text_delta", "text"), _delta("input_json_delta", "partial_json")]},
    ),
    _event("content_block_stop", ["index"], index=_INDEX),
    _event(
        "message_delta",
        ["delta", "usage"],
        delta={
            "type": "object",
            "required": ["stop_reason", "stop_sequence"],
            "properties": {
                "stop_reason": {"type": "string", "enum": STOP_REASONS},
                "stop_sequence": {"type": ["string", "null"]},
            },
            "additionalProperties": False,
        },
        usage=_ref("AnthropicUsage"),
    ),
    _event("message_stop"),
    _event("error", ["error"], error=_ERROR_BODY),
]
STREAM_EVENT_TYPES = [event["properties"]["type"]["enum"][0] for event in STREAM_EVENTS]

SCHEMA_COMPONENTS: dict[str, dict[str, Any]] = {
    "AnthropicMessage": {**_MESSAGE, "description": "Anthropic's Message: the answer, as `POST /messages` gives it."},
    "AnthropicTextBlock": _TEXT_OUT,
    "AnthropicToolUseBlock": {**_TOOL_USE_OUT, "description": "A call of a client tool: `input` is its arguments."},
    "AnthropicUsage": _USAGE,
    STREAM_EVENT: {
        "oneOf": STREAM_EVENTS,
        "description": "One event of a Messages stream: the JSON of a frame's `data:` line.",
    },
    "AnthropicError": {
        "type": "object",
        "required": ["type", "error"],
        "properties": {"type": {"type": "string", "enum": ["error"]}, "error": _ERROR_BODY},
        "description": "Every error of the Messages routes (`Content-Type: application/json`).",
    },
}

COUNT_TOKENS_ANSWER = {
    "type": "object",
    "required": ["input_tokens"],
    "properties": {"input_tokens": {"type": "integer", "minimum": 0}},
}
MESSAGE_STREAM_SCHEMA = {
    "type": "object",
    "required": ["event", "data"],
    "properties": {
        "id": {
            "type": "string",
            "pattern": "^(0|[1-9][0-9]*)$",
            "description": "On the last frame made from a task event: its `sequence_number`, to resume from.",
        },
        "event": {"type": "string", "enum": STREAM_EVENT_TYPES, "description": "The event's `type`."},
        "data": {
            "type": "string",
            "contentMediaType": "application/json",
            "contentSchema": _ref(STREAM_EVENT),
        },
    },
}
MESSAGE_STREAM_DESCRIPTION = (
    "`stream: true`: Anthropic's events, `event: <type>` and `data: <the event as JSON>`: `message_start`, "
    "`ping`, per content block (`text`, or `tool_use` for a call) `content_block_start`, its deltas "
    "(`text_delta`, `input_json_delta`) and `content_block_stop`, then `message_delta` (the stop reason, the "
    "usage) and `message_stop`; or an `error` event for a generation that failed or was cancelled. A frame "
    "that ends a task event carries its `id:`: with an `Idempotency-Key`, a retry with `Last-Event-ID` "
    "resumes after it. Comments (`: keepalive`) keep an idle connection open."
)


def error_content(status: int, classes: Sequence[type[exc.LmspError]]) -> dict[str, Any]:
    """The ``content`` of one error status: Anthropic's shape with this status's error type, an example per code."""
    examples = {}
    for cls in classes:
        _, body = anthropic_error(cls().to_http_problem())
        examples[cls.code] = {"summary": cls.title, "value": body}
    schema = {
        "allOf": [
            _ref("AnthropicError"),
            {"properties": {"error": {"properties": {"type": {"type": "string", "enum": [error_type(status)]}}}}},
        ]
    }
    return {ERROR_MEDIA_TYPE: {"schema": schema, "examples": examples}}
