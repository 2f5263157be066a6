"""The ``input`` of a response request (PROFILE.md section 3): content parts and input items, shapes only.

What an item or a part asks for that the service does not do is decided in
``tasks_app/openai/surface.py``; here only the shapes.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from drf_spectacular.utils import extend_schema_field
from rest_framework import serializers

from tasks_app.edge.strict_json import (
    StrictCharField,
    StrictChoiceField,
    StrictSerializer,
    parsed_list,
    validated_by,
)
from tasks_app.exceptions import UnsupportedParameter
from tasks_app.openai import surface

ROLES = ("user", "system", "developer", "assistant")
TEXT_PART_TYPES = ("input_text", "output_text")

# Any JSON value the body parser takes (no U+0000 anywhere): the schema's JsonValue component.
_ANY_JSON_VALUE = {"$ref": "#/components/schemas/JsonValue"}
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
            # Other members (an earlier answer's, echoed back) are ignored (PROFILE.md 10.1), whatever JSON they hold.
            "description": "Other members are ignored.",
            "additionalProperties": _ANY_JSON_VALUE,
        },
        {
            "type": "object",
            "required": ["type", "refusal"],
            "properties": {"type": {"type": "string", "enum": ["refusal"]}, "refusal": {"type": "string"}},
            "description": "Other members are ignored.",
            "additionalProperties": _ANY_JSON_VALUE,
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


class TextPartSerializer(StrictSerializer):
    """``input_text`` / ``output_text`` (an echoed output part: ``annotations`` and ``logprobs`` are ignored)."""

    type = StrictChoiceField(choices=("input_text", "output_text"))
    text = StrictCharField(allow_blank=True, trim_whitespace=False)
    annotations = serializers.ListField(required=False)
    logprobs = serializers.ListField(required=False, allow_null=True)


class RefusalPartSerializer(StrictSerializer):
    type = StrictChoiceField(choices=("refusal",))
    refusal = StrictCharField(allow_blank=True, trim_whitespace=False)


def _text_part(index: int, data: Any, path: str) -> dict[str, str]:
    """A content part as ``{"type", "text"}``: a refusal's text is what the assistant said."""
    kind = data.get("type") if isinstance(data, Mapping) else None
    if kind in surface.REFUSED_PART_TYPES:
        raise UnsupportedParameter(
            f"{path}[{index}].type: {kind} parts are not supported (text only)", param=f"{path}[{index}].type"
        )
    # Clients echo earlier answers back with more in a part than its own members (`role`, `refusal`,
    # `cache_control`...): those ask for nothing, so they are ignored, never refused (PROFILE.md 10.1).
    if kind == "refusal":
        part = validated_by(RefusalPartSerializer, {k: data[k] for k in ("type", "refusal") if k in data})
        return {"type": "output_text", "text": part["refusal"]}
    if isinstance(data, Mapping) and kind in TEXT_PART_TYPES:
        data = {key: data[key] for key in ("type", "text", "annotations", "logprobs") if key in data}
    part = validated_by(TextPartSerializer, data)
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
        return parsed_list(
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
    namespace = StrictCharField(required=False, allow_null=True, allow_blank=True, max_length=64, trim_whitespace=False)


class ReasoningItemSerializer(StrictSerializer):
    """An earlier turn's reasoning echoed back: checked, then left out of the context (``tasks_app.openai.surface``)."""

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
    None for an item that is checked and left out of the context (``surface.SKIPPED_ITEM_TYPES``)."""
    if not isinstance(data, Mapping):
        raise serializers.ValidationError("must be an object")
    kind = data.get("type", "message")
    if not isinstance(kind, str):
        raise serializers.ValidationError({"type": ["must be a string"]})
    if kind in surface.REFUSED_ITEM_TYPES:
        raise UnsupportedParameter(
            f"{path}[{index}].type: {kind} items are not supported here", param=f"{path}[{index}].type"
        )
    serializer_class = _ITEM_SERIALIZERS.get(kind)
    if serializer_class is None:
        raise serializers.ValidationError({"type": [f"must be one of {', '.join(surface.SUPPORTED_ITEM_TYPES)}"]})
    fields = {"content": MessageContentField(path=f"{path}[{index}].content")} if kind == "message" else {}
    serializer = serializer_class(data=data)
    serializer.fields.update(fields)
    if not serializer.is_valid():
        raise serializers.ValidationError(serializer.errors)
    if kind in surface.SKIPPED_ITEM_TYPES:
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
        items = parsed_list(data, "a string or a non-empty list of input items", input_item)
        kept = [item for item in items if item is not None]
        if not kept:
            raise serializers.ValidationError("must hold an item besides reasoning items (which are left out)")
        return kept

    def to_representation(self, value: Any) -> Any:
        return value
