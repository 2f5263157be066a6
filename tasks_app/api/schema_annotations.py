"""What the API views' schema annotations use: ``operation(...)``, shared parameters and responses.

The views (``views.py``) and the stand-ins of the async views
(``schema_stand_ins.py``) import this module, so it imports no view module.
How the schema is put together: ``schema_generator.py``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from drf_spectacular.utils import OpenApiExample, OpenApiParameter, OpenApiResponse, extend_schema

from tasks_app import exceptions as exc
from tasks_app.edge.stream_cursor import MAX_CURSOR
from tasks_app.events import TERMINAL, EventType
from tasks_app.services.idempotency import MAX_KEY_LENGTH

F = TypeVar("F", bound=Callable[..., Any])

EVENT_STREAM_MEDIA_TYPE = "text/event-stream"

# The order of a task's log (PROFILE.md section 4): the enum's members are in
# log order, and the terminal ones end it, in the order of ``events.TERMINAL``
# (the lifecycle and the stream reader use that constant too).
NON_TERMINAL_EVENT_TYPES: tuple[EventType, ...] = tuple(t for t in EventType if t not in TERMINAL)
EVENT_TYPES: tuple[EventType, ...] = (*NON_TERMINAL_EVENT_TYPES, *TERMINAL)


# --- parameters and headers shared by several operations ---------------------------------------------

TASK_ID = OpenApiParameter("task_id", str, OpenApiParameter.PATH, description="`task_` + ULID.")
RESPONSE_ID = OpenApiParameter("response_id", str, OpenApiParameter.PATH, description="`resp_` + ULID.")
MODEL_ID = OpenApiParameter(
    "model_id",
    str,
    OpenApiParameter.PATH,
    description="`name` or `name:tag`, as `GET /models` lists it (`name:latest` is `name`).",
)
IDEMPOTENCY_KEY = OpenApiParameter(
    "Idempotency-Key",
    {"type": "string", "minLength": 1, "maxLength": MAX_KEY_LENGTH, "pattern": "^[ -~]+$"},
    OpenApiParameter.HEADER,
    description="1-255 printable ASCII characters, scoped to the client and the endpoint, kept 24 h by default. "
    "The same key with the same body answers the first reply again (with `Idempotent-Replayed: true`); "
    "with another body `422 idempotency_key_reused`; while the first is still being served "
    "`409 idempotency_key_in_use`.",
)
_CURSOR_RULES = (
    "Send only events with a greater `sequence_number`. A cursor at the terminal event of a finished task "
    "answers `204`; one past the newest event `400 invalid_request`; one before the oldest kept event "
    "`410 event_history_expired`."
)
LAST_EVENT_ID = OpenApiParameter(
    "Last-Event-ID",
    {"type": "integer", "minimum": 0, "maximum": MAX_CURSOR},
    OpenApiParameter.HEADER,
    description="Resume cursor, as an `EventSource` sends it on reconnect; wins over `starting_after`. "
    + _CURSOR_RULES,
)
STARTING_AFTER = OpenApiParameter(
    "starting_after",
    {"type": "integer", "minimum": 0, "maximum": MAX_CURSOR},
    OpenApiParameter.QUERY,
    description="Resume cursor, as the `openai` package sends it. " + _CURSOR_RULES,
)
LOCATION = OpenApiParameter(
    "Location", str, OpenApiParameter.HEADER, response=[202], description="Path of the new task."
)


def idempotent_replayed(*statuses: int) -> OpenApiParameter:
    """The response header that marks a replay, on these statuses."""
    return OpenApiParameter(
        "Idempotent-Replayed",
        {"type": "string", "enum": ["true"]},
        OpenApiParameter.HEADER,
        response=list(statuses),
        description="Present on a reply that repeats the first reply to this `Idempotency-Key`.",
    )


# OpenAPI 3.1 gives an event stream's schema per event, as an SSE parser yields it (`id`, `event`,
# `data`); its `data` is the JSON of a `StreamEvent`, so a checker can validate every event.
SSE_EVENT_SCHEMA = {
    "type": "object",
    "required": ["id", "event", "data"],
    "properties": {
        "id": {"type": "string", "pattern": "^(0|[1-9][0-9]*)$", "description": "The event's `sequence_number`."},
        "event": {"type": "string", "enum": list(EVENT_TYPES), "description": "The event's `type`."},
        "data": {
            "type": "string",
            "contentMediaType": "application/json",
            "contentSchema": {"$ref": "#/components/schemas/StreamEvent"},
        },
    },
}
EVENT_STREAM = OpenApiResponse(
    SSE_EVENT_SCHEMA,
    description=(
        "Server-sent events, one frame per event: `id: <sequence_number>`, `event: <type>`, "
        "`data: <the event as JSON, see the StreamEvent schema>`, a blank line. Types in order: "
        + ", ".join(f"`{name}`" for name in NON_TERMINAL_EVENT_TYPES)
        + " (many deltas), then exactly one of "
        + ", ".join(f"`{name}`" for name in TERMINAL)
        + ", after which the server closes the stream. It opens with the comment `: stream opened` and "
        "sends `: keepalive` while idle. A `retry` policy's rerun appends a new `response.in_progress` "
        "with empty output: drop the text of earlier attempts when it comes. The schema is that of one "
        "event as an SSE parser yields it."
    ),
    examples=[
        OpenApiExample(
            "event",
            summary="One event as an SSE parser yields it from the frame `id: 4`, `event: ...`, `data: ...`",
            value={
                "id": "4",
                "event": EventType.OUTPUT_TEXT_DELTA,
                "data": '{"type":"response.output_text.delta","sequence_number":4,"item_id":"msg_…",'
                '"output_index":0,"content_index":0,"delta":"Hel"}',
            },
            media_type=EVENT_STREAM_MEDIA_TYPE,
            status_codes=[200],
            response_only=True,
        )
    ],
)
STREAM_FINISHED = OpenApiResponse(
    description="The cursor is the task's terminal event: nothing is left to send, so an `EventSource` "
    "stops reconnecting."
)


def operation(*, problems: Sequence[type[exc.LmspError]] = (), **schema: Any) -> Callable[[F], F]:
    """``extend_schema`` for one handler, plus the problems it raises itself.

    The postprocessing hook adds the problems every operation shares and
    renders all of them (see ``schema_generator.py``).
    """

    def decorate(handler: F) -> F:
        handler.lmsp_problems = tuple(problems)  # type: ignore[attr-defined]
        return extend_schema(**schema)(handler)

    return decorate


# A chat completion's stream (PROFILE.md 10.3): `data:` lines only, each a chunk (or an error), then
# `data: [DONE]`; as an SSE parser yields them, a frame is its `data`.
_CHAT_DELTA = {
    "type": "object",
    "properties": {
        "role": {"type": "string", "enum": ["assistant"]},
        "content": {"type": ["string", "null"]},
        "tool_calls": {"type": "array", "items": {"type": "object"}},
    },
    "additionalProperties": False,
}
CHAT_COMPLETION_CHUNK_SCHEMA = {
    "oneOf": [
        {
            "type": "object",
            "required": ["id", "object", "created", "model", "choices"],
            "properties": {
                "id": {"type": "string", "pattern": "^chatcmpl-"},
                "object": {"type": "string", "enum": ["chat.completion.chunk"]},
                "created": {"type": "integer"},
                "model": {"type": "string"},
                "system_fingerprint": {"type": "null"},
                "choices": {
                    "type": "array",
                    "maxItems": 1,
                    "items": {
                        "type": "object",
                        "required": ["index", "delta", "finish_reason"],
                        "properties": {
                            "index": {"type": "integer", "enum": [0]},
                            "delta": _CHAT_DELTA,
                            "logprobs": {"type": "null"},
                            "finish_reason": {
                                "type": ["string", "null"],
                                "enum": ["stop", "length", "tool_calls", None],
                            },
                        },
                    },
                },
                "usage": {
                    "oneOf": [
                        {"type": "null"},
                        {"$ref": "#/components/schemas/ChatCompletionUsage"},
                    ]
                },
            },
            "additionalProperties": False,
        },
        {
            "type": "object",
            "required": ["error"],
            "properties": {"error": {"$ref": "#/components/schemas/SdkError"}},
            "additionalProperties": False,
            "description": "A failure mid-stream (the generation failed or was cancelled); `[DONE]` follows.",
        },
    ]
}
CHAT_STREAM = OpenApiResponse(
    {
        "type": "object",
        "required": ["data"],
        "properties": {
            # anyOf: a validator does not read contentSchema, so "[DONE]" matches both.
            "data": {
                "anyOf": [
                    {"type": "string", "enum": ["[DONE]"]},
                    {
                        "type": "string",
                        "contentMediaType": "application/json",
                        "contentSchema": {"$ref": "#/components/schemas/ChatCompletionChunk"},
                    },
                ]
            }
        },
    },
    description="`stream: true`: `data: <a ChatCompletionChunk as JSON>` lines, the first with the role, "
    "then content deltas, one with `finish_reason`, with `stream_options.include_usage` one with `usage` "
    'and no choices (every other chunk then has `usage: null`); a failure is one `data: {"error": ...}` '
    "line; the last line is `data: [DONE]`.",
)
