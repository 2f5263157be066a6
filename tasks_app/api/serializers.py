"""Input and output serializers of the API.

Input serializers check shape and JSON types strictly (``"5"`` is not an
integer, ``1`` is not a boolean) and refuse unknown fields by name; they hold
no business rules. Output serializers only render the wire objects.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Mapping
from typing import Any
from urllib.parse import urlencode

from django.core.validators import RegexValidator
from django.http import HttpRequest
from drf_spectacular.utils import extend_schema_field
from rest_framework import serializers

from tasks_app.core.wire import events_url, response_object, task_object, unix_seconds
from tasks_app.exceptions import InvalidRequest, UnsupportedParameter
from tasks_app.ids import TASK_PREFIX
from tasks_app.models import TaskType
from tasks_app.openai import surface as request_surface
from tasks_app.states import RestartPolicy, TaskStatus

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
    "oneOf": [
        {
            "type": "object",
            "required": ["type", "text"],
            "properties": {
                "type": {"type": "string", "enum": list(TEXT_PART_TYPES)},
                "text": {"type": "string"},
                "annotations": {"type": "array"},
                "logprobs": {"type": ["array", "null"]},
            },
            # Other members (an earlier answer's, echoed back) are ignored (PROFILE.md 10.1).
            "description": "Other members are ignored.",
        },
        {
            "type": "object",
            "required": ["type", "refusal"],
            "properties": {"type": {"type": "string", "enum": ["refusal"]}, "refusal": {"type": "string"}},
            "description": "Other members are ignored.",
        },
    ]
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
        "id": {"type": "string", "maxLength": 200},
        "status": {"type": "string", "enum": ["in_progress", "completed", "incomplete"]},
    },
    "additionalProperties": False,
}


class StrictSerializer(serializers.Serializer):
    """Refuses fields it does not declare, naming each one.

    For a validation it builds only the fields the data names and those that act when absent
    (required, or with a default). DRF deep-copies every declared field into each serializer
    instance; the Responses request declares some fifty, nested, and copying them all was the
    largest single cost of an accept (bench/accept.py, issue 26's note). Anything that reads
    ``fields`` before validating (the schema, a caller adding a field) gets every field.
    """

    # The data keys the fields were built for; None: every declared field was built.
    _built_for: frozenset[str] | None = None

    def get_fields(self) -> dict[str, serializers.Field]:
        if self._built_for is None:
            return super().get_fields()
        wanted = {
            name: field
            for name, field in self._declared_fields.items()
            if name in self._built_for or field.required or field.default is not serializers.empty
        }
        return copy.deepcopy(wanted)

    def _build_fields_for(self, data: Mapping[str, Any]) -> None:
        keys = frozenset(data)
        if "fields" not in self.__dict__:
            self._built_for = keys
        elif self._built_for is not None and not keys <= self._built_for:
            # A list's child serializer validates every item with one instance: widen it for this one.
            self._built_for |= keys
            del self.__dict__["fields"]

    def to_internal_value(self, data: Any) -> Any:
        unknown: list[str] = []
        if isinstance(data, Mapping):
            self._build_fields_for(data)
            unknown = sorted(set(data) - set(self._declared_fields) - set(self.fields))
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
    """``input_text`` / ``output_text`` (an echoed output part: ``annotations`` and ``logprobs`` are ignored)."""

    type = StrictChoiceField(choices=("input_text", "output_text"))
    text = StrictCharField(allow_blank=True, trim_whitespace=False)
    annotations = serializers.ListField(required=False)
    logprobs = serializers.ListField(required=False, allow_null=True)


class RefusalPartSerializer(StrictSerializer):
    type = StrictChoiceField(choices=("refusal",))
    refusal = StrictCharField(allow_blank=True, trim_whitespace=False)


def _parsed_list(data: Any, what: str, parse) -> list[Any]:
    """Each element of a non-empty list through ``parse``, the errors of all of them at their indexes."""
    if not isinstance(data, list) or not data:
        raise serializers.ValidationError(f"must be {what}")
    values, errors, failed = [], [], False
    for index, element in enumerate(data):
        try:
            values.append(parse(index, element))
            errors.append({})
        except serializers.ValidationError as error:
            failed = True
            errors.append(error.detail)
    if failed:
        raise serializers.ValidationError(errors)
    return values


def _indexed(data: list[Any], parse) -> list[Any]:
    """Each element through ``parse``, the errors keyed by index (as DRF's ListField names them: ``tools.1``)."""
    values, errors = [], {}
    for index, element in enumerate(data):
        try:
            values.append(parse(index, element))
        except serializers.ValidationError as error:
            errors[index] = error.detail
    if errors:
        raise serializers.ValidationError(errors)
    return values


def _validated_by(serializer_class, data: Any) -> dict[str, Any]:
    serializer = serializer_class(data=data)
    if not serializer.is_valid():
        raise serializers.ValidationError(serializer.errors)
    return dict(serializer.validated_data)


def _text_part(index: int, data: Any, path: str) -> dict[str, str]:
    """A content part as ``{"type", "text"}``: a refusal's text is what the assistant said."""
    kind = data.get("type") if isinstance(data, Mapping) else None
    if kind in request_surface.REFUSED_PART_TYPES:
        raise UnsupportedParameter(
            f"{path}[{index}].type: {kind} parts are not supported (text only)", param=f"{path}[{index}].type"
        )
    # Clients echo earlier answers back with more in a part than its own members (`role`, `refusal`,
    # `cache_control`...): those ask for nothing, so they are ignored, never refused (PROFILE.md 10.1).
    if kind == "refusal":
        part = _validated_by(RefusalPartSerializer, {k: data[k] for k in ("type", "refusal") if k in data})
        return {"type": "output_text", "text": part["refusal"]}
    if isinstance(data, Mapping) and kind in TEXT_PART_TYPES:
        data = {key: data[key] for key in ("type", "text", "annotations", "logprobs") if key in data}
    part = _validated_by(TextPartSerializer, data)
    return {"type": part["type"], "text": part["text"]}


@extend_schema_field(_CONTENT_SCHEMA)
class MessageContentField(serializers.Field):
    """``content``: a string, or a non-empty list of text parts (``path`` names it in a refusal)."""

    def __init__(self, *, path: str = "content", **kwargs: Any) -> None:
        self.path = path
        super().__init__(**kwargs)

    def to_internal_value(self, data: Any) -> str | list[dict[str, str]]:
        if isinstance(data, str):
            return data
        return _parsed_list(
            data, "a string or a non-empty list of text parts", lambda i, part: _text_part(i, part, self.path)
        )

    def to_representation(self, value: Any) -> Any:
        return value


ITEM_STATUSES = ("in_progress", "completed", "incomplete")


class MessageItemSerializer(StrictSerializer):
    """A message; ``id`` and ``status`` come with an output item a client echoes back."""

    type = StrictChoiceField(choices=("message",), required=False, default="message")
    role = StrictChoiceField(choices=ROLES)
    content = MessageContentField()
    id = StrictCharField(required=False, allow_blank=True, max_length=200, trim_whitespace=False)
    status = StrictChoiceField(choices=ITEM_STATUSES, required=False)


class FunctionCallItemSerializer(StrictSerializer):
    """A call the model made, as the client echoes it back (``arguments`` is a JSON text)."""

    type = StrictChoiceField(choices=("function_call",))
    call_id = StrictCharField(min_length=1, max_length=200, trim_whitespace=False)
    name = StrictCharField(min_length=1, max_length=200, trim_whitespace=False)
    arguments = StrictCharField(allow_blank=True, trim_whitespace=False)
    id = StrictCharField(required=False, allow_blank=True, max_length=200, trim_whitespace=False)
    status = StrictChoiceField(choices=ITEM_STATUSES, required=False)
    # A call of a namespace's function: the model knows it by its own name (tasks_app.generation.tool_calls).
    namespace = StrictCharField(required=False, allow_null=True, max_length=64, trim_whitespace=False)


class ReasoningItemSerializer(StrictSerializer):
    """An earlier turn's reasoning echoed back: checked, then left out of the context (request_surface)."""

    type = StrictChoiceField(choices=("reasoning",))
    id = StrictCharField(required=False, allow_blank=True, max_length=200, trim_whitespace=False)
    summary = serializers.ListField(child=serializers.DictField(), required=False)
    content = serializers.ListField(child=serializers.DictField(), required=False, allow_null=True)
    encrypted_content = StrictCharField(required=False, allow_null=True, allow_blank=True, trim_whitespace=False)
    status = StrictChoiceField(choices=ITEM_STATUSES, required=False, allow_null=True)


@extend_schema_field({"oneOf": [{"type": "string"}, {"type": "array", "minItems": 1, "items": _TEXT_PART_SCHEMA}]})
class ToolOutputField(MessageContentField):
    """A function's result: a string, or text parts (joined)."""

    def to_internal_value(self, data: Any) -> str:
        value = super().to_internal_value(data)
        return value if isinstance(value, str) else "".join(part["text"] for part in value)


class FunctionCallOutputItemSerializer(StrictSerializer):
    type = StrictChoiceField(choices=("function_call_output",))
    call_id = StrictCharField(min_length=1, max_length=200, trim_whitespace=False)
    output = ToolOutputField(path="output")
    id = StrictCharField(required=False, allow_blank=True, max_length=200, trim_whitespace=False, allow_null=True)
    status = StrictChoiceField(choices=ITEM_STATUSES, required=False, allow_null=True)


_ITEM_SERIALIZERS = {
    "message": MessageItemSerializer,
    "function_call": FunctionCallItemSerializer,
    "function_call_output": FunctionCallOutputItemSerializer,
    "reasoning": ReasoningItemSerializer,
}


def input_item(index: int, data: Any, path: str = "input") -> dict[str, Any] | None:
    """One input item in our stored shape: no ``id``/``status``, content parts as ``{"type", "text"}``;
    None for an item that is checked and left out of the context (``request_surface.SKIPPED_ITEM_TYPES``)."""
    if not isinstance(data, Mapping):
        raise serializers.ValidationError("must be an object")
    kind = data.get("type", "message")
    if not isinstance(kind, str):
        raise serializers.ValidationError({"type": ["must be a string"]})
    if kind in request_surface.REFUSED_ITEM_TYPES:
        raise UnsupportedParameter(
            f"{path}[{index}].type: {kind} items are not supported here", param=f"{path}[{index}].type"
        )
    serializer_class = _ITEM_SERIALIZERS.get(kind)
    if serializer_class is None:
        raise serializers.ValidationError(
            {"type": [f"must be one of {', '.join(request_surface.SUPPORTED_ITEM_TYPES)}"]}
        )
    fields = {"content": MessageContentField(path=f"{path}[{index}].content")} if kind == "message" else {}
    serializer = serializer_class(data=data)
    serializer.fields.update(fields)
    if not serializer.is_valid():
        raise serializers.ValidationError(serializer.errors)
    if kind in request_surface.SKIPPED_ITEM_TYPES:
        return None
    item = dict(serializer.validated_data)
    item.pop("id", None)
    item.pop("status", None)
    item.pop("namespace", None)
    return item


_REASONING_ITEM_SCHEMA = {
    "type": "object",
    "required": ["type"],
    "properties": {
        "type": {"type": "string", "enum": ["reasoning"]},
        "id": {"type": "string", "maxLength": 200},
        "summary": {"type": "array", "items": {"type": "object"}},
        "content": {"type": ["array", "null"], "items": {"type": "object"}},
        "encrypted_content": {"type": ["string", "null"]},
        "status": {"type": ["string", "null"], "enum": [*ITEM_STATUSES, None]},
    },
    "additionalProperties": False,
    "description": "An earlier turn's reasoning echoed back: accepted and left out of the context.",
}
_INPUT_ITEM_SCHEMA = {
    "oneOf": [
        _MESSAGE_ITEM_SCHEMA,
        {
            "type": "object",
            "required": ["type", "call_id", "name", "arguments"],
            "properties": {
                "type": {"type": "string", "enum": ["function_call"]},
                "call_id": {"type": "string", "minLength": 1, "maxLength": 200},
                "name": {"type": "string", "minLength": 1, "maxLength": 200},
                "arguments": {"type": "string"},
                "id": {"type": "string", "maxLength": 200},
                "status": {"type": "string", "enum": list(ITEM_STATUSES)},
                "namespace": {"type": ["string", "null"], "maxLength": 64},
            },
            "additionalProperties": False,
        },
        {
            "type": "object",
            "required": ["type", "call_id", "output"],
            "properties": {
                "type": {"type": "string", "enum": ["function_call_output"]},
                "call_id": {"type": "string", "minLength": 1, "maxLength": 200},
                "output": {"oneOf": [{"type": "string"}, {"type": "array", "minItems": 1, "items": _TEXT_PART_SCHEMA}]},
            },
            "additionalProperties": False,
        },
        _REASONING_ITEM_SCHEMA,
    ]
}


@extend_schema_field(
    {
        "oneOf": [
            {"type": "string"},
            {
                "type": "array",
                "minItems": 1,
                "items": _INPUT_ITEM_SCHEMA,
                "contains": {"not": _REASONING_ITEM_SCHEMA},
            },
        ],
        "description": "A string, or a non-empty list of input items: messages (with or without `type`; "
        "output items echoed back with their `id` and `status`), `function_call` and `function_call_output`; "
        "`reasoning` items echoed back are accepted and left out (the models here have no reasoning mode).",
    }
)
class ResponseInputField(serializers.Field):
    """``input``: a string, or a non-empty list of input items."""

    def to_internal_value(self, data: Any) -> str | list[dict[str, Any]]:
        if isinstance(data, str):
            return data
        items = _parsed_list(data, "a string or a non-empty list of input items", input_item)
        kept = [item for item in items if item is not None]
        if not kept:
            raise serializers.ValidationError("must hold an item besides reasoning items (which are left out)")
        return kept

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


MAX_TOOLS = 128


def documented_as(field_class: type[serializers.Field], schema: dict[str, Any]) -> type[serializers.Field]:
    """``field_class`` documented as ``schema``: the values the service accepts, where the field lets
    more through so that ``request_surface`` can refuse them by name (``unsupported_parameter``)."""
    return extend_schema_field(schema)(type(f"Documented{field_class.__name__}", (field_class,), {}))


@extend_schema_field({"type": "object"})
class LooseObjectField(serializers.Field):
    """A JSON object taken as it is (a hint whose content nothing here reads)."""

    def to_internal_value(self, data: Any) -> dict[str, Any]:
        if not isinstance(data, dict):
            raise serializers.ValidationError("must be an object")
        return data

    def to_representation(self, value: Any) -> Any:
        return value


@extend_schema_field({"enum": [None], "description": "Only null: any other value is `unsupported_parameter`."})
class NullOnlyField(serializers.Field):
    """An OpenAI field for a feature this service lacks: null is its absence, any value is refused by name."""

    def validate_empty_values(self, data: Any) -> tuple[bool, Any]:
        if data is None:
            return True, None
        return super().validate_empty_values(data)

    def to_internal_value(self, data: Any) -> None:
        raise UnsupportedParameter(f"{self.field_name}: {self.help_text or 'not supported'}", param=self.field_name)

    def to_representation(self, value: Any) -> Any:
        return value


# OpenAI's rule for a format's and a function's name.
FORMAT_NAME = RegexValidator(r"^[a-zA-Z0-9_-]{1,64}\Z", "letters, digits, _ and -, at most 64")


class FunctionToolSerializer(StrictSerializer):
    """A function tool in the Responses shape."""

    type = StrictChoiceField(choices=(request_surface.FUNCTION_TOOL,))
    name = StrictCharField(min_length=1, max_length=64, trim_whitespace=False, validators=[FORMAT_NAME])
    description = StrictCharField(required=False, allow_null=True, allow_blank=True, trim_whitespace=False)
    parameters = LooseObjectField(required=False, allow_null=True)
    strict = StrictBooleanField(required=False, allow_null=True)


class NamespaceToolSerializer(StrictSerializer):
    """Function tools grouped under a name (OpenAI's ``namespace`` tool; Codex CLI's ``multi_agent_v1``)."""

    type = StrictChoiceField(choices=(request_surface.NAMESPACE_TOOL,))
    name = StrictCharField(min_length=1, max_length=64, trim_whitespace=False, validators=[FORMAT_NAME])
    description = StrictCharField(required=False, allow_null=True, allow_blank=True, trim_whitespace=False)
    tools = serializers.JSONField()

    def validate_tools(self, value: Any) -> list[dict[str, Any]]:
        # Parsed by ResponseToolsField, which knows the path a refusal names.
        return value


_FUNCTION_TOOL_SCHEMA = {
    "type": "object",
    "required": ["type", "name"],
    "properties": {
        "type": {"type": "string", "enum": [request_surface.FUNCTION_TOOL]},
        "name": {"type": "string", "pattern": "^[a-zA-Z0-9_-]{1,64}$"},
        "description": {"type": ["string", "null"]},
        "parameters": {"type": ["object", "null"]},
        "strict": {"type": ["boolean", "null"]},
    },
    "additionalProperties": False,
}


@extend_schema_field(
    {
        "type": "array",
        "maxItems": MAX_TOOLS,
        "items": {
            "oneOf": [
                _FUNCTION_TOOL_SCHEMA,
                {
                    "type": "object",
                    "required": ["type", "name", "tools"],
                    "properties": {
                        "type": {"type": "string", "enum": [request_surface.NAMESPACE_TOOL]},
                        "name": {"type": "string", "pattern": "^[a-zA-Z0-9_-]{1,64}$"},
                        "description": {"type": ["string", "null"]},
                        "tools": {"type": "array", "minItems": 1, "items": _FUNCTION_TOOL_SCHEMA},
                    },
                    "additionalProperties": False,
                },
                {
                    "type": "object",
                    "required": ["type"],
                    "properties": {"type": {"type": "string", "enum": list(request_surface.HOSTED_TOOL_TYPES)}},
                    "description": "A hosted tool: accepted under `tool_choice` `auto` or `none`, never called.",
                },
            ]
        },
    }
)
class ResponseToolsField(serializers.Field):
    """``tools``: functions, namespaces of functions, and hosted tools (offered, never run here).

    A hosted tool is taken as sent (its options are OpenAI's; nothing here
    reads them) and echoed; ``custom`` (freeform grammar) tools are refused by
    name, as a tool type this service does not build.
    """

    def to_internal_value(self, data: Any) -> list[dict[str, Any]]:
        if not isinstance(data, list) or len(data) > MAX_TOOLS:
            raise serializers.ValidationError(f"must be a list of at most {MAX_TOOLS} tools")
        return _indexed(data, lambda index, tool: self._tool(f"tools[{index}]", tool))

    def _tool(self, path: str, data: Any, *, nested: bool = False) -> dict[str, Any]:
        kind = data.get("type") if isinstance(data, Mapping) else None
        if kind == request_surface.CUSTOM_TOOL:
            raise UnsupportedParameter(
                f"{path}.type: custom (freeform grammar) tools are not supported; offer a function tool",
                param=f"{path}.type",
            )
        if kind in request_surface.HOSTED_TOOL_TYPES and not nested:
            return dict(data)
        if kind == request_surface.NAMESPACE_TOOL and not nested:
            namespace = _validated_by(NamespaceToolSerializer, data)
            functions = namespace["tools"]
            if not isinstance(functions, list) or not functions:
                raise serializers.ValidationError({"tools": ["must be a non-empty list of function tools"]})
            try:
                namespace["tools"] = _indexed(
                    functions, lambda index, tool: self._tool(f"{path}.tools[{index}]", tool, nested=True)
                )
            except serializers.ValidationError as error:
                raise serializers.ValidationError({"tools": error.detail}) from None
            return namespace
        if kind == request_surface.FUNCTION_TOOL:
            return _validated_by(FunctionToolSerializer, data)
        if kind in request_surface.HOSTED_TOOL_TYPES:
            raise UnsupportedParameter(f"{path}.type: a namespace holds function tools only", param=f"{path}.type")
        if not isinstance(data, Mapping):
            raise serializers.ValidationError("must be an object")
        kinds = ("function",) if nested else ("function", "namespace", *request_surface.HOSTED_TOOL_TYPES)
        raise serializers.ValidationError({"type": [f"must be one of {', '.join(kinds)}"]})

    def to_representation(self, value: Any) -> Any:
        return value


@extend_schema_field(
    {
        "oneOf": [
            {"type": "string", "enum": list(request_surface.TOOL_CHOICE_MODES)},
            {
                "type": "object",
                "required": ["type", "name"],
                "properties": {
                    "type": {"type": "string", "enum": ["function"]},
                    "name": {"type": "string", "minLength": 1, "maxLength": 64, "pattern": "^[a-zA-Z0-9_-]{1,64}$"},
                },
                "additionalProperties": False,
            },
            {
                "type": "object",
                "required": ["type", "mode", "tools"],
                "properties": {
                    "type": {"type": "string", "enum": ["allowed_tools"]},
                    "mode": {"type": "string", "enum": ["auto", "required"]},
                    "tools": {"type": "array", "items": {"type": "object"}},
                },
                "additionalProperties": False,
            },
        ]
    }
)
class ToolChoiceField(serializers.Field):
    """``none``, ``auto``, ``required``, a named function, or ``allowed_tools``."""

    def to_internal_value(self, data: Any) -> Any:
        if isinstance(data, str):
            if data not in request_surface.TOOL_CHOICE_MODES:
                raise serializers.ValidationError(f"must be one of {', '.join(request_surface.TOOL_CHOICE_MODES)}")
            return data
        if not isinstance(data, dict):
            raise serializers.ValidationError("must be a string or an object")
        kind = data.get("type")
        name = data.get("name")
        if kind == "function" and set(data) == {"type", "name"} and isinstance(name, str) and 1 <= len(name) <= 64:
            return data
        if (
            kind == "allowed_tools"
            and set(data) == {"type", "mode", "tools"}
            and data["mode"] in ("auto", "required")
            and isinstance(data["tools"], list)
        ):
            return data
        if kind in request_surface.REFUSED_TOOL_TYPES:
            raise UnsupportedParameter(f"tool_choice: {kind} is a hosted tool", param="tool_choice")
        raise serializers.ValidationError(
            "must be {'type': 'function', 'name': ...} or {'type': 'allowed_tools', 'mode': ..., 'tools': [...]}"
        )

    def to_representation(self, value: Any) -> Any:
        return value


class TextFormatSerializer(StrictSerializer):
    type = StrictChoiceField(
        choices=request_surface.TEXT_FORMAT_TYPES,
        help_text="`json_object` and `json_schema` are enforced by constrained decoding (docs/structured-output.md).",
    )
    name = StrictCharField(
        required=False, max_length=64, validators=[FORMAT_NAME], help_text="Required with `json_schema`."
    )
    schema = LooseObjectField(
        required=False,
        help_text="A JSON Schema; one the grammar engine cannot compile is `invalid_request` naming the reason.",
    )
    strict = StrictBooleanField(required=False, allow_null=True)
    description = StrictCharField(required=False, allow_blank=True, trim_whitespace=False)


class TextConfigSerializer(StrictSerializer):
    """``text``: the output's format (plain text, or JSON enforced by constrained decoding) and verbosity."""

    format = TextFormatSerializer(required=False)
    verbosity = documented_as(StrictChoiceField, {"type": "string", "enum": ["medium"]})(
        choices=request_surface.VERBOSITIES, required=False, allow_null=True
    )


class ReasoningSerializer(StrictSerializer):
    effort = StrictChoiceField(choices=request_surface.REASONING_EFFORTS, required=False, allow_null=True)
    summary = StrictChoiceField(choices=request_surface.REASONING_SUMMARIES, required=False, allow_null=True)
    generate_summary = StrictChoiceField(choices=request_surface.REASONING_SUMMARIES, required=False, allow_null=True)


class StreamOptionsSerializer(StrictSerializer):
    include_obfuscation = StrictBooleanField(required=False)


class BackgroundOptionsSerializer(StrictSerializer):
    completion_window = documented_as(StrictChoiceField, {"type": "string", "enum": ["soonest"]})(
        choices=request_surface.COMPLETION_WINDOWS, required=False
    )
    continuation_id = StrictCharField(required=False, allow_blank=True, max_length=512)


class ImageOptionsSerializer(StrictSerializer):
    context_compression = documented_as(StrictChoiceField, {"type": "string", "enum": ["auto", "disabled"]})(
        choices=request_surface.IMAGE_COMPRESSIONS, required=False
    )


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
    # PROFILE.md 10.1: the rest of OpenAI's request. What each value makes the service do (or refuse)
    # is decided in tasks_app/openai/surface.py; here only the shapes.
    previous_response_id = StrictCharField(
        required=False,
        allow_null=True,
        min_length=1,
        max_length=200,
        help_text="Continue the conversation of a stored response of this client (PROFILE.md 10.2): its "
        "context, input and output come before this input; its instructions do not.",
    )
    tools = ResponseToolsField(
        required=False,
        allow_null=True,
        help_text="Function tools (PROFILE.md 10.4, docs/tools.md): shown to the model through its chat template; "
        "its calls come back as `function_call` items, enforced by constrained decoding (the name among the "
        "tools `tool_choice` allows, the arguments by `parameters`). A `namespace` tool's functions are offered "
        "like the others (a call names its `namespace`). Hosted tools (`web_search`, ...) are accepted under "
        "`tool_choice` `auto` or `none` and never called; `custom` tools are refused.",
    )
    tool_choice = ToolChoiceField(required=False, allow_null=True)
    parallel_tool_calls = StrictBooleanField(required=False, allow_null=True)
    max_tool_calls = StrictIntegerField(
        required=False, allow_null=True, min_value=1, help_text="Bounds built-in tool calls; none run here."
    )
    text = TextConfigSerializer(required=False, allow_null=True)
    truncation = StrictChoiceField(
        choices=request_surface.TRUNCATIONS,
        required=False,
        allow_null=True,
        help_text="`disabled` (default): a prompt that leaves no room for output fails with "
        "`context_length_exceeded`; `auto`: whole items are dropped from the start of the conversation "
        "(never `instructions` or this request's own input) until it fits.",
    )
    include = documented_as(
        serializers.ListField,
        {"type": "array", "items": {"type": "string", "enum": list(request_surface.ACCEPTED_INCLUDES)}},
    )(
        child=StrictCharField(max_length=200),
        required=False,
        allow_null=True,
        help_text="`reasoning.encrypted_content` (Codex CLI sends it): accepted; the models here have no "
        "reasoning mode, so there are no reasoning items to include. Every other value OpenAI documents asks "
        "for output this service does not produce: refused by name.",
    )
    top_logprobs = documented_as(StrictIntegerField, {"type": "integer", "minimum": 0, "maximum": 0})(
        required=False,
        allow_null=True,
        min_value=0,
        max_value=request_surface.MAX_TOP_LOGPROBS,
        help_text="Only 0: log probabilities are not returned.",
    )
    user = StrictCharField(required=False, allow_null=True, allow_blank=True, max_length=512, trim_whitespace=False)
    safety_identifier = StrictCharField(
        required=False, allow_null=True, allow_blank=True, max_length=512, trim_whitespace=False
    )
    prompt_cache_key = StrictCharField(
        required=False, allow_null=True, allow_blank=True, max_length=512, trim_whitespace=False
    )
    prompt_cache_retention = StrictChoiceField(
        choices=request_surface.PROMPT_CACHE_RETENTIONS, required=False, allow_null=True
    )
    prompt_cache_options = LooseObjectField(required=False, allow_null=True, help_text="A hint: accepted.")
    service_tier = documented_as(
        StrictChoiceField, {"type": "string", "enum": list(request_surface.ACCEPTED_SERVICE_TIERS)}
    )(
        choices=request_surface.SERVICE_TIERS,
        required=False,
        allow_null=True,
        help_text="One queue serves every request: `auto` and `default` only.",
    )
    reasoning = ReasoningSerializer(
        required=False, allow_null=True, help_text="Accepted and echoed: the models served here do not reason."
    )
    stream_options = StreamOptionsSerializer(required=False, allow_null=True)
    client_metadata = LooseObjectField(
        required=False,
        allow_null=True,
        help_text="What the client says about itself (Codex CLI sends it on every request): stored with the "
        "request, not echoed, as OpenAI does.",
    )
    background_options = BackgroundOptionsSerializer(required=False, allow_null=True)
    image = ImageOptionsSerializer(required=False, allow_null=True)
    # OpenAI's fields for what this service does not have: only their absence (null) is accepted.
    prompt = NullOnlyField(required=False, help_text="Refused: no stored prompt templates.")
    conversation = NullOnlyField(required=False, help_text="Refused: use `previous_response_id`.")
    moderation = NullOnlyField(required=False, help_text="Refused: no moderation model.")
    access_programs = NullOnlyField(required=False, help_text="Refused.")
    context_management = documented_as(serializers.ListField, {"type": "array", "maxItems": 0})(
        child=LooseObjectField(),
        required=False,
        allow_null=True,
        help_text="Only `[]`: server-side compaction is not built (`truncation: auto` drops old items).",
    )
    # Extensions: OpenAI's Chat Completions penalties, on the sampler beside repetition_penalty.
    frequency_penalty = StrictFloatField(
        required=False,
        allow_null=True,
        min_value=-2.0,
        max_value=2.0,
        help_text="Extension: subtract this times the number of times a token was generated so far.",
    )
    presence_penalty = StrictFloatField(
        required=False,
        allow_null=True,
        min_value=-2.0,
        max_value=2.0,
        help_text="Extension: subtract this from every token generated at least once so far.",
    )


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
