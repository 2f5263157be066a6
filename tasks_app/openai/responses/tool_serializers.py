"""``tools`` and ``tool_choice`` of a response request (PROFILE.md 10.4, docs/tools.md), shapes only.

Which tools are offered, refused or accepted and never called is decided in
``tasks_app/openai/surface.py``; here only the shapes.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from django.core.validators import RegexValidator
from drf_spectacular.utils import extend_schema_field
from rest_framework import serializers

from tasks_app.edge.strict_json import (
    LooseObjectField,
    StrictBooleanField,
    StrictCharField,
    StrictChoiceField,
    StrictSerializer,
    indexed,
    validated_by,
)
from tasks_app.exceptions import UnsupportedParameter
from tasks_app.openai import surface

MAX_TOOLS = 128


# OpenAI's rule for a format's and a function's name.
FORMAT_NAME = RegexValidator(r"^[a-zA-Z0-9_-]{1,64}\Z", "letters, digits, _ and -, at most 64")


class FunctionToolSerializer(StrictSerializer):
    """A function tool in the Responses shape."""

    type = StrictChoiceField(choices=(surface.FUNCTION_TOOL,))
    name = StrictCharField(min_length=1, max_length=64, trim_whitespace=False, validators=[FORMAT_NAME])
    description = StrictCharField(required=False, allow_null=True, allow_blank=True, trim_whitespace=False)
    parameters = LooseObjectField(required=False, allow_null=True)
    strict = StrictBooleanField(required=False, allow_null=True)


class NamespaceToolSerializer(StrictSerializer):
    """Function tools grouped under a name (OpenAI's ``namespace`` tool; Codex CLI's ``multi_agent_v1``)."""

    type = StrictChoiceField(choices=(surface.NAMESPACE_TOOL,))
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
        "type": {"type": "string", "enum": [surface.FUNCTION_TOOL]},
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
                        "type": {"type": "string", "enum": [surface.NAMESPACE_TOOL]},
                        "name": {"type": "string", "pattern": "^[a-zA-Z0-9_-]{1,64}$"},
                        "description": {"type": ["string", "null"]},
                        "tools": {"type": "array", "minItems": 1, "items": _FUNCTION_TOOL_SCHEMA},
                    },
                    "additionalProperties": False,
                },
                {
                    "type": "object",
                    "required": ["type"],
                    "properties": {"type": {"type": "string", "enum": list(surface.HOSTED_TOOL_TYPES)}},
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
        return indexed(data, lambda index, tool: self._tool(f"tools[{index}]", tool))

    def _tool(self, path: str, data: Any, *, nested: bool = False) -> dict[str, Any]:
        kind = data.get("type") if isinstance(data, Mapping) else None
        if kind == surface.CUSTOM_TOOL:
            raise UnsupportedParameter(
                f"{path}.type: custom (freeform grammar) tools are not supported; offer a function tool",
                param=f"{path}.type",
            )
        if kind in surface.HOSTED_TOOL_TYPES and not nested:
            return dict(data)
        if kind == surface.NAMESPACE_TOOL and not nested:
            namespace = validated_by(NamespaceToolSerializer, data)
            functions = namespace["tools"]
            if not isinstance(functions, list) or not functions:
                raise serializers.ValidationError({"tools": ["must be a non-empty list of function tools"]})
            try:
                namespace["tools"] = indexed(
                    functions, lambda index, tool: self._tool(f"{path}.tools[{index}]", tool, nested=True)
                )
            except serializers.ValidationError as error:
                raise serializers.ValidationError({"tools": error.detail}) from None
            return namespace
        if kind == surface.FUNCTION_TOOL:
            return validated_by(FunctionToolSerializer, data)
        if kind in surface.HOSTED_TOOL_TYPES:
            raise UnsupportedParameter(f"{path}.type: a namespace holds function tools only", param=f"{path}.type")
        if not isinstance(data, Mapping):
            raise serializers.ValidationError("must be an object")
        kinds = ("function",) if nested else ("function", "namespace", *surface.HOSTED_TOOL_TYPES)
        raise serializers.ValidationError({"type": [f"must be one of {', '.join(kinds)}"]})

    def to_representation(self, value: Any) -> Any:
        return value


@extend_schema_field(
    {
        "oneOf": [
            {"type": "string", "enum": list(surface.TOOL_CHOICE_MODES)},
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
            if data not in surface.TOOL_CHOICE_MODES:
                raise serializers.ValidationError(f"must be one of {', '.join(surface.TOOL_CHOICE_MODES)}")
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
        if kind in surface.REFUSED_TOOL_TYPES:
            raise UnsupportedParameter(f"tool_choice: {kind} is a hosted tool", param="tool_choice")
        raise serializers.ValidationError(
            "must be {'type': 'function', 'name': ...} or {'type': 'allowed_tools', 'mode': ..., 'tools': [...]}"
        )

    def to_representation(self, value: Any) -> Any:
        return value
