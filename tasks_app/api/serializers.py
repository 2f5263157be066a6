"""Input and output serializers of the API.

Input serializers check shape and JSON types strictly (``"5"`` is not an
integer, ``1`` is not a boolean) and refuse unknown fields by name; they hold
no business rules. Output serializers only render the wire objects.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any
from urllib.parse import urlencode

from django.http import HttpRequest
from drf_spectacular.utils import extend_schema_field
from rest_framework import serializers

from tasks_app.exceptions import InvalidRequest
from tasks_app.ids import TASK_PREFIX
from tasks_app.models import TaskType
from tasks_app.states import RestartPolicy, TaskStatus
from tasks_app.wire import events_url, response_object, task_object, unix_seconds

MAX_STOP_SEQUENCES = 4
MAX_METADATA_PAIRS = 16
MAX_METADATA_KEY = 64
MAX_METADATA_VALUE = 512
MAX_SEED = 2**64 - 1
# More than any vocabulary: a top_k at or above a model's vocabulary keeps every token.
MAX_TOP_K = 1_000_000
# The sampler's range (workers/backends/sampling.py, which this layer may not import):
# outside it a penalised float32 score can overflow.
MIN_REPETITION_PENALTY = 0.01
MAX_REPETITION_PENALTY = 100.0
MAX_AFTER = 200
ROLES = ("user", "system", "developer", "assistant")
TEXT_PART_TYPES = ("input_text", "output_text")

# OpenAPI shapes of the fields below that take more than one JSON type.
_TEXT_PART_SCHEMA = {
    "type": "object",
    "required": ["type", "text"],
    "properties": {"type": {"type": "string", "enum": list(TEXT_PART_TYPES)}, "text": {"type": "string"}},
}
_CONTENT_SCHEMA = {
    "oneOf": [{"type": "string"}, {"type": "array", "minItems": 1, "items": _TEXT_PART_SCHEMA}],
    "description": "A string, or a non-empty list of text parts.",
}
_MESSAGE_ITEM_SCHEMA = {
    "type": "object",
    "required": ["role", "content"],
    "properties": {
        "type": {"type": "string", "enum": ["message"], "default": "message"},
        "role": {"type": "string", "enum": list(ROLES)},
        "content": _CONTENT_SCHEMA,
    },
}


class StrictSerializer(serializers.Serializer):
    """Refuses fields it does not declare, naming each one."""

    def to_internal_value(self, data: Any) -> Any:
        unknown = sorted(set(data) - set(self.fields)) if isinstance(data, Mapping) else []
        errors: dict[str, Any] = {name: ["unknown field"] for name in unknown}
        try:
            value = super().to_internal_value(data)
        except serializers.ValidationError as error:
            if not isinstance(error.detail, Mapping):
                raise
            errors.update(error.detail)
        if errors:
            raise serializers.ValidationError(errors)
        return value


class StrictCharField(serializers.CharField):
    def to_internal_value(self, data: Any) -> str:
        if not isinstance(data, str):
            self.fail("invalid")
        return super().to_internal_value(data)


class StrictIntegerField(serializers.IntegerField):
    default_error_messages = {"invalid": "A JSON integer is required."}

    def to_internal_value(self, data: Any) -> int:
        # JSON has one number type: 5.0 is the integer 5 (as JSON Schema's "integer" says), 5.5 is not.
        if isinstance(data, float) and data.is_integer():
            data = int(data)
        if isinstance(data, bool) or not isinstance(data, int):
            self.fail("invalid")
        return super().to_internal_value(data)


class StrictFloatField(serializers.FloatField):
    default_error_messages = {"invalid": "A JSON number is required."}

    def to_internal_value(self, data: Any) -> float:
        if isinstance(data, bool) or not isinstance(data, (int, float)):
            self.fail("invalid")
        return super().to_internal_value(data)


class StrictBooleanField(serializers.BooleanField):
    default_error_messages = {"invalid": "A JSON boolean is required."}

    def to_internal_value(self, data: Any) -> bool:
        if not isinstance(data, bool):
            self.fail("invalid")
        return data


class StrictChoiceField(serializers.ChoiceField):
    def to_internal_value(self, data: Any) -> Any:
        if not isinstance(data, str):
            self.fail("invalid_choice", input=data)
        return super().to_internal_value(data)


class TextPartSerializer(StrictSerializer):
    type = StrictChoiceField(choices=TEXT_PART_TYPES)
    text = StrictCharField(allow_blank=True, trim_whitespace=False)


@extend_schema_field(_CONTENT_SCHEMA)
class MessageContentField(serializers.Field):
    """``content``: a string, or a non-empty list of text parts."""

    def to_internal_value(self, data: Any) -> str | list[dict[str, str]]:
        if isinstance(data, str):
            return data
        if not isinstance(data, list) or not data:
            raise serializers.ValidationError("must be a string or a non-empty list of text parts")
        parts, errors, failed = [], [], False
        for item in data:
            part = TextPartSerializer(data=item)
            if part.is_valid():
                parts.append(dict(part.validated_data))
                errors.append({})
            else:
                failed = True
                errors.append(part.errors)
        if failed:
            raise serializers.ValidationError(errors)
        return parts

    def to_representation(self, value: Any) -> Any:
        return value


class MessageItemSerializer(StrictSerializer):
    type = StrictChoiceField(choices=("message",), required=False, default="message")
    role = StrictChoiceField(choices=ROLES)
    content = MessageContentField()


@extend_schema_field(
    {
        "oneOf": [{"type": "string"}, {"type": "array", "minItems": 1, "items": _MESSAGE_ITEM_SCHEMA}],
        "description": "A string, or a non-empty list of message items.",
    }
)
class ResponseInputField(serializers.Field):
    """``input``: a string, or a non-empty list of message items."""

    def to_internal_value(self, data: Any) -> str | list[dict[str, Any]]:
        if isinstance(data, str):
            return data
        if not isinstance(data, list) or not data:
            raise serializers.ValidationError("must be a string or a non-empty list of message items")
        items, errors, failed = [], [], False
        for item in data:
            message = MessageItemSerializer(data=item)
            if message.is_valid():
                items.append(dict(message.validated_data))
                errors.append({})
            else:
                failed = True
                errors.append(message.errors)
        if failed:
            raise serializers.ValidationError(errors)
        return items

    def to_representation(self, value: Any) -> Any:
        return value


@extend_schema_field(
    {
        "oneOf": [
            {"type": "string", "minLength": 1},
            {
                "type": "array",
                "minItems": 1,
                "maxItems": MAX_STOP_SEQUENCES,
                "items": {"type": "string", "minLength": 1},
            },
        ]
    }
)
class StopField(serializers.Field):
    def to_internal_value(self, data: Any) -> list[str]:
        values = [data] if isinstance(data, str) else data
        if (
            not isinstance(values, list)
            or not 1 <= len(values) <= MAX_STOP_SEQUENCES
            or not all(isinstance(v, str) and v for v in values)
        ):
            raise serializers.ValidationError(
                f"must be a non-empty string or a list of 1-{MAX_STOP_SEQUENCES} non-empty strings"
            )
        return list(values)

    def to_representation(self, value: Any) -> Any:
        return value


@extend_schema_field(
    {
        "type": "object",
        "maxProperties": MAX_METADATA_PAIRS,
        "propertyNames": {"maxLength": MAX_METADATA_KEY},
        "additionalProperties": {"type": "string", "maxLength": MAX_METADATA_VALUE},
        "description": f"At most {MAX_METADATA_PAIRS} pairs; keys of at most {MAX_METADATA_KEY} characters.",
    }
)
class MetadataField(serializers.Field):
    def to_internal_value(self, data: Any) -> dict[str, str]:
        if not isinstance(data, dict) or len(data) > MAX_METADATA_PAIRS:
            raise serializers.ValidationError(f"must be an object of at most {MAX_METADATA_PAIRS} string pairs")
        for key, value in data.items():
            if not isinstance(value, str) or len(key) > MAX_METADATA_KEY or len(value) > MAX_METADATA_VALUE:
                raise serializers.ValidationError(
                    f"keys are at most {MAX_METADATA_KEY} characters, values strings of at most {MAX_METADATA_VALUE}"
                )
        return dict(data)

    def to_representation(self, value: Any) -> Any:
        return value


@extend_schema_field({"type": "number", "exclusiveMinimum": 0, "maximum": 1})
class TopPField(StrictFloatField):
    """``top_p`` in (0, 1], the sampler's domain (``workers/backends/sampling.py``): 0 is refused up front."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(max_value=1.0, **kwargs)

    def to_internal_value(self, data: Any) -> float:
        value = super().to_internal_value(data)
        if value <= 0.0:
            raise serializers.ValidationError("must be greater than 0")
        return value


class ResponseRequestSerializer(StrictSerializer):
    """The response request of PROFILE.md section 3."""

    # A name is matched as sent: trimmed, a 201-character name could pass as 200.
    model = StrictCharField(min_length=1, max_length=200, trim_whitespace=False)
    input = ResponseInputField()
    instructions = StrictCharField(required=False, allow_null=True, allow_blank=True, trim_whitespace=False)
    max_output_tokens = StrictIntegerField(required=False, allow_null=True, min_value=1, max_value=1_000_000)
    temperature = StrictFloatField(required=False, allow_null=True, min_value=0.0, max_value=2.0)
    top_p = TopPField(required=False, allow_null=True)
    # Extensions (PROFILE.md section 9), as in transformers' generation config (docs/sampling.md).
    top_k = StrictIntegerField(
        required=False,
        allow_null=True,
        min_value=0,
        max_value=MAX_TOP_K,
        help_text="Extension: sample from the k most likely tokens (ties included); 0 keeps all; "
        "null: the model's generation config.",
    )
    min_p = StrictFloatField(
        required=False,
        allow_null=True,
        min_value=0.0,
        max_value=1.0,
        help_text="Extension: drop tokens less than min_p times as likely as the most likely one; 0 keeps all; "
        "null: the model's generation config.",
    )
    repetition_penalty = StrictFloatField(
        required=False,
        allow_null=True,
        min_value=MIN_REPETITION_PENALTY,
        max_value=MAX_REPETITION_PENALTY,
        help_text="Extension: divide positive, multiply negative scores of every token already in the prompt "
        "or output, greedy decoding included; 1 is off; null: the model's generation config.",
    )
    seed = StrictIntegerField(required=False, allow_null=True, min_value=0, max_value=MAX_SEED)
    stop = StopField(required=False, allow_null=True)
    stream = StrictBooleanField(required=False, default=False)
    store = StrictBooleanField(required=False, default=True)
    metadata = MetadataField(required=False, allow_null=True)


class ResponseCreateInputSerializer(ResponseRequestSerializer):
    """``POST /responses``: the response request and the background mode's fields (PROFILE.md section 9)."""

    background = StrictBooleanField(
        required=False,
        default=False,
        help_text="Extension of LMSP 1.0, as OpenAI's background mode: answer at once with the response "
        "`queued`; it runs as a task (durable, recovered by `on_restart`) and `GET /responses/{id}` follows it.",
    )
    on_restart = StrictChoiceField(
        choices=RestartPolicy.values,
        required=False,
        default=RestartPolicy.FAIL,
        help_text="Extension: what a restart does to the response's task, as for `POST /tasks` (the openai "
        "package sends it through `extra_body`); `retry` requires an `Idempotency-Key`.",
    )


class TaskCreateInputSerializer(StrictSerializer):
    """The task envelope of chapter 7.1."""

    type = StrictChoiceField(choices=TaskType.values)
    input = ResponseRequestSerializer()
    on_restart = StrictChoiceField(choices=RestartPolicy.values, required=False, default=RestartPolicy.FAIL)


class ListQuerySerializer(StrictSerializer):
    """``?limit=&after=`` of every list endpoint (query strings are text)."""

    limit = serializers.IntegerField(required=False, default=20, min_value=1, max_value=100)
    after = serializers.CharField(required=False, min_length=1, max_length=MAX_AFTER, trim_whitespace=False)


# The query parameters' schemas where a plain string would say less than the server checks.
MODEL_AFTER_SCHEMA = {"type": "string", "minLength": 1, "maxLength": MAX_AFTER}
TASK_ID_PATTERN = rf"^{TASK_PREFIX}[0-7][0-9A-HJKMNP-TV-Z]{{25}}$"
TASK_AFTER_SCHEMA = {"type": "string", "pattern": TASK_ID_PATTERN}
_STATUS = f"(?:{'|'.join(TaskStatus.values)})"
TASK_STATUS_SCHEMA = {"type": "string", "pattern": f"^{_STATUS}(?:,{_STATUS})*$"}


class TaskListQuerySerializer(ListQuerySerializer):
    status = serializers.CharField(required=False, trim_whitespace=False)

    def validate_after(self, value: str) -> str:
        # fullmatch: the id pattern's ``$`` would also match before a trailing newline.
        if not re.fullmatch(TASK_ID_PATTERN, value):
            raise serializers.ValidationError("must be a task id")
        return value

    def validate_status(self, value: str) -> list[str]:
        if not re.fullmatch(TASK_STATUS_SCHEMA["pattern"], value):
            raise serializers.ValidationError(f"must be one or more of {', '.join(TaskStatus.values)}, comma-separated")
        return value.split(",")


class PairInputSerializer(StrictSerializer):
    """A pairing code to trade for a new client's token (PROFILE.md section 1)."""

    # Not trimmed here: the service normalises the code and the name (so the schema's lengths hold as sent).
    code = StrictCharField(min_length=1, max_length=32, trim_whitespace=False)
    client_name = StrictCharField(min_length=1, max_length=100, trim_whitespace=False)


_CURSOR = re.compile(r"[0-9]{1,10}")
MAX_CURSOR = 2**31 - 1


def stream_cursor(request: HttpRequest) -> tuple[int | None, str]:
    """The resume cursor and where it came from; the header wins (a browser's reconnect sends it).

    Every cursor that is sent must be a sequence number, an empty one and
    the one the header outranks too: the schema says integer for both, and a
    value the server would not read is refused rather than ignored.
    """
    header = request.META.get("HTTP_LAST_EVENT_ID")
    sent = [
        (field, raw)
        for field, raw in (
            ("Last-Event-ID", header.strip() if header is not None else None),
            ("starting_after", request.GET.get("starting_after")),
        )
        if raw is not None
    ]
    cursors = [(_cursor_value(field, raw), field) for field, raw in sent]
    return cursors[0] if cursors else (None, "starting_after")


def _cursor_value(field: str, raw: str) -> int:
    if not _CURSOR.fullmatch(raw) or int(raw) > MAX_CURSOR:
        raise InvalidRequest(
            f"{field} must be the sequence_number of an event (a non-negative integer)",
            errors=[{"field": field, "message": "must be a non-negative integer"}],
        )
    return int(raw)


class TaskOutputSerializer(serializers.BaseSerializer):
    """A task; ``context["queue_positions"]`` holds the queued ones' places (``selectors.task_queue_positions``)."""

    def to_representation(self, instance: Any) -> dict[str, Any]:
        return task_object(instance, self.context.get("queue_positions", {}).get(instance.id))


class ResponseOutputSerializer(serializers.BaseSerializer):
    """A ``selectors.ResponseRead``: the row and what is live about it."""

    def to_representation(self, instance: Any) -> dict[str, Any]:
        return response_object(instance.response, instance.live)


class ModelOutputSerializer(serializers.BaseSerializer):
    def to_representation(self, instance: Any) -> dict[str, Any]:
        return {
            "id": instance.name,
            "object": "model",
            "created": int(instance.created_at.timestamp()),
            "owned_by": "local",
            "backend": instance.backend,
            "digest": instance.digest,
            "size_bytes": instance.size_bytes,
            "capabilities": instance.capabilities,
            "context_length": instance.config.get("max_position_embeddings"),
            "layout": instance.layout,
        }


class ClientOutputSerializer(serializers.BaseSerializer):
    """The reply of ``POST /pair``: the only time the token is shown."""

    def to_representation(self, instance: Any) -> dict[str, Any]:
        client, token = instance
        return {"object": "client", "name": client.name, "scopes": client.scopes, "token": token}


class StreamTokenOutputSerializer(serializers.BaseSerializer):
    """A minted stream token and the URL an ``EventSource`` opens with it."""

    def to_representation(self, instance: Any) -> dict[str, Any]:
        return {
            "object": "stream_token",
            "token": instance.token,
            "task_id": instance.task_id,
            "expires_at": unix_seconds(instance.expires_at),
            "events_url": f"{events_url(instance.task_id)}?{urlencode({'token': instance.token})}",
        }


def list_body(items: list[dict[str, Any]], has_more: bool) -> dict[str, Any]:
    """The list envelope of PROFILE.md section 7."""
    return {
        "object": "list",
        "data": items,
        "first_id": items[0]["id"] if items else None,
        "last_id": items[-1]["id"] if items else None,
        "has_more": has_more,
    }
