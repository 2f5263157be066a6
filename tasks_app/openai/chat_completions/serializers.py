"""The request of ``POST /chat/completions`` (PROFILE.md 10.3): shapes only.

What each value makes the service do, or refuse, is decided where the
request is translated into a response request (``tasks_app/openai/chat_completions/translate.py``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from drf_spectacular.utils import extend_schema_field
from rest_framework import serializers

from tasks_app.edge.strict_json import (
    LooseObjectField,
    NullOnlyField,
    StrictBooleanField,
    StrictCharField,
    StrictChoiceField,
    StrictFloatField,
    StrictIntegerField,
    StrictSerializer,
    documented_as,
)
from tasks_app.openai import surface
from tasks_app.openai.responses.serializers import (
    MAX_REPETITION_PENALTY,
    MAX_SEED,
    MAX_TOP_K,
    MIN_REPETITION_PENALTY,
    MetadataField,
    StopField,
    TopPField,
)
from tasks_app.openai.responses.tool_serializers import FORMAT_NAME, MAX_TOOLS

CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")
# Parts a chat message may hold that are not text: OpenAI's, refused by name.
REFUSED_CHAT_PART_TYPES = ("image_url", "input_audio", "file")
CHAT_TEXT_PART_TYPES = ("text", "refusal")

_CHAT_PART_SCHEMA = {
    "oneOf": [
        {
            "type": "object",
            "required": ["type", "text"],
            "properties": {"type": {"type": "string", "enum": ["text"]}, "text": {"type": "string"}},
            "description": "Other members (an earlier answer's, echoed back) are ignored.",
        },
        {
            "type": "object",
            "required": ["type", "refusal"],
            "properties": {"type": {"type": "string", "enum": ["refusal"]}, "refusal": {"type": "string"}},
            "description": "Other members are ignored.",
        },
    ]
}


@extend_schema_field(
    {
        "oneOf": [{"type": "string"}, {"type": "array", "items": _CHAT_PART_SCHEMA}, {"type": "null"}],
        "description": "A string, text parts, or (an assistant message with tool_calls) null.",
    }
)
class ChatContentField(serializers.Field):
    """A message's ``content``: a string, or its parts (text and refusal parts checked; the parts
    OpenAI has for images, audio and files kept as ``{"type": ...}`` for the adapter to refuse by name).

    Clients send earlier answers back with more in a part than its text: the JS Agents SDK spreads the
    assistant message's own members (``role``, ``refusal``, ``tool_calls``...) into it, others add
    ``annotations`` or ``cache_control``. Those are ignored (PROFILE.md 10.1); a refusal names the member
    at fault (``messages.2.content.0.text``).
    """

    def __init__(self, **kwargs: Any) -> None:
        kwargs.setdefault("allow_null", True)
        super().__init__(**kwargs)

    def to_internal_value(self, data: Any) -> str | list[dict[str, str]]:
        if isinstance(data, str):
            return data
        if not isinstance(data, list):
            raise serializers.ValidationError("must be a string or a list of text parts")
        parts = []
        for index, part in enumerate(data):
            if not isinstance(part, Mapping):
                raise serializers.ValidationError({index: "must be an object: {'type': 'text', 'text': ...}"})
            kind = part.get("type")
            if kind in REFUSED_CHAT_PART_TYPES:
                parts.append({"type": kind})
                continue
            if kind not in CHAT_TEXT_PART_TYPES:
                raise serializers.ValidationError({index: {"type": f"must be 'text' or 'refusal', got {kind!r}"}})
            key = "refusal" if kind == "refusal" else "text"
            if not isinstance(part.get(key), str):
                raise serializers.ValidationError({index: {key: f"a {kind} part's {key} must be a string"}})
            parts.append({"type": kind, "text": part[key]})
        return parts

    def to_representation(self, value: Any) -> Any:
        return value


class ToolCallFunctionSerializer(StrictSerializer):
    name = StrictCharField(min_length=1, max_length=64, trim_whitespace=False)
    arguments = StrictCharField(allow_blank=True, trim_whitespace=False)


class ToolCallSerializer(StrictSerializer):
    """A call the assistant made, as the client sends its history back."""

    id = StrictCharField(min_length=1, max_length=200, trim_whitespace=False)
    type = StrictChoiceField(choices=("function",))
    function = ToolCallFunctionSerializer()


class ChatMessageSerializer(StrictSerializer):
    """One message; which keys a role may carry is checked by the adapter's translation."""

    role = StrictChoiceField(choices=CHAT_ROLES)
    content = ChatContentField(required=False)
    name = StrictCharField(required=False, allow_blank=True, max_length=200, trim_whitespace=False)
    tool_calls = serializers.ListField(child=ToolCallSerializer(), required=False, allow_null=True)
    tool_call_id = StrictCharField(required=False, min_length=1, max_length=200, trim_whitespace=False)
    refusal = StrictCharField(required=False, allow_null=True, allow_blank=True, trim_whitespace=False)


class ChatFunctionSerializer(StrictSerializer):
    name = StrictCharField(min_length=1, max_length=64, trim_whitespace=False, validators=[FORMAT_NAME])
    description = StrictCharField(required=False, allow_null=True, allow_blank=True, trim_whitespace=False)
    parameters = LooseObjectField(required=False, allow_null=True)
    strict = StrictBooleanField(required=False, allow_null=True)


class ChatToolSerializer(StrictSerializer):
    type = StrictChoiceField(choices=(surface.FUNCTION_TOOL,))
    function = ChatFunctionSerializer()

    def to_internal_value(self, data: Any) -> Any:
        surface.tool_type_check(data)
        return super().to_internal_value(data)


@extend_schema_field(
    {
        "oneOf": [
            {"type": "string", "enum": list(surface.TOOL_CHOICE_MODES)},
            {
                "type": "object",
                "required": ["type", "function"],
                "properties": {
                    "type": {"type": "string", "enum": ["function"]},
                    "function": {
                        "type": "object",
                        "required": ["name"],
                        "properties": {
                            "name": {
                                "type": "string",
                                "minLength": 1,
                                "maxLength": 64,
                                "pattern": "^[a-zA-Z0-9_-]{1,64}$",
                            }
                        },
                        "additionalProperties": False,
                    },
                },
                "additionalProperties": False,
            },
        ]
    }
)
class ChatToolChoiceField(serializers.Field):
    """``none``, ``auto``, ``required``, or ``{"type": "function", "function": {"name": ...}}``."""

    def to_internal_value(self, data: Any) -> Any:
        if isinstance(data, str) and data in surface.TOOL_CHOICE_MODES:
            return data
        if (
            isinstance(data, dict)
            and data.get("type") == "function"
            and set(data) == {"type", "function"}
            and isinstance(data["function"], dict)
            and set(data["function"]) == {"name"}
            and isinstance(data["function"]["name"], str)
            and 1 <= len(data["function"]["name"]) <= 64
        ):
            return data
        if isinstance(data, dict) and data.get("type") == "allowed_tools":
            return data
        raise serializers.ValidationError(
            "must be 'none', 'auto', 'required' or {'type': 'function', 'function': {'name': ...}}"
        )

    def to_representation(self, value: Any) -> Any:
        return value


class JsonSchemaFormatSerializer(StrictSerializer):
    name = StrictCharField(max_length=64, validators=[FORMAT_NAME])
    schema = LooseObjectField(required=False)
    strict = StrictBooleanField(required=False, allow_null=True)
    description = StrictCharField(required=False, allow_blank=True, trim_whitespace=False)


class ResponseFormatSerializer(StrictSerializer):
    type = StrictChoiceField(
        choices=surface.TEXT_FORMAT_TYPES,
        help_text="`json_object` and `json_schema` are enforced by constrained decoding (docs/structured-output.md).",
    )
    json_schema = JsonSchemaFormatSerializer(required=False)


class ChatStreamOptionsSerializer(StrictSerializer):
    include_usage = StrictBooleanField(required=False)
    include_obfuscation = StrictBooleanField(required=False)


_CONTENT = {"oneOf": [{"type": "string"}, {"type": "array", "items": _CHAT_PART_SCHEMA}]}
_TOOL_CALL = {
    "type": "object",
    "required": ["id", "type", "function"],
    "properties": {
        "id": {"type": "string", "minLength": 1, "maxLength": 200},
        "type": {"type": "string", "enum": ["function"]},
        "function": {
            "type": "object",
            "required": ["name", "arguments"],
            "properties": {
                "name": {"type": "string", "minLength": 1, "maxLength": 64},
                "arguments": {"type": "string"},
            },
            "additionalProperties": False,
        },
    },
    "additionalProperties": False,
}
_NAME = {"type": "string", "maxLength": 200}
_MESSAGE_SCHEMA = {
    "oneOf": [
        {
            "type": "object",
            "required": ["role", "content"],
            "properties": {
                "role": {"type": "string", "enum": ["system", "developer", "user"]},
                "content": _CONTENT,
                "name": _NAME,
            },
            "additionalProperties": False,
        },
        {
            "type": "object",
            "required": ["role"],
            "properties": {
                "role": {"type": "string", "enum": ["assistant"]},
                "content": {"oneOf": [*_CONTENT["oneOf"], {"type": "null"}]},
                "name": _NAME,
                "tool_calls": {"type": ["array", "null"], "items": _TOOL_CALL},
                "refusal": {"type": ["string", "null"]},
            },
            "additionalProperties": False,
        },
        {
            "type": "object",
            "required": ["role", "content", "tool_call_id"],
            "properties": {
                "role": {"type": "string", "enum": ["tool"]},
                "content": _CONTENT,
                "tool_call_id": {"type": "string", "minLength": 1, "maxLength": 200},
            },
            "additionalProperties": False,
        },
    ]
}


@extend_schema_field({"type": "array", "minItems": 1, "items": _MESSAGE_SCHEMA})
class ChatMessagesField(serializers.ListField):
    """The conversation: which keys each role may carry is the adapter's check (and this schema's)."""


class ChatCompletionRequestSerializer(StrictSerializer):
    """The Chat Completions request (PROFILE.md 10.3)."""

    model = StrictCharField(min_length=1, max_length=200, trim_whitespace=False)
    messages = ChatMessagesField(child=ChatMessageSerializer(), min_length=1)
    max_tokens = StrictIntegerField(required=False, allow_null=True, min_value=1, max_value=1_000_000)
    max_completion_tokens = StrictIntegerField(required=False, allow_null=True, min_value=1, max_value=1_000_000)
    temperature = StrictFloatField(required=False, allow_null=True, min_value=0.0, max_value=2.0)
    top_p = TopPField(required=False, allow_null=True)
    seed = StrictIntegerField(required=False, allow_null=True, min_value=0, max_value=MAX_SEED)
    stop = StopField(required=False, allow_null=True)
    n = documented_as(StrictIntegerField, {"type": "integer", "enum": [1]})(
        required=False, allow_null=True, min_value=1, max_value=128, help_text="Only 1."
    )
    stream = StrictBooleanField(required=False, default=False)
    stream_options = ChatStreamOptionsSerializer(required=False, allow_null=True)
    frequency_penalty = StrictFloatField(required=False, allow_null=True, min_value=-2.0, max_value=2.0)
    presence_penalty = StrictFloatField(required=False, allow_null=True, min_value=-2.0, max_value=2.0)
    tools = serializers.ListField(child=ChatToolSerializer(), required=False, allow_null=True, max_length=MAX_TOOLS)
    tool_choice = ChatToolChoiceField(required=False, allow_null=True)
    parallel_tool_calls = StrictBooleanField(required=False, allow_null=True)
    response_format = ResponseFormatSerializer(required=False, allow_null=True)
    user = StrictCharField(required=False, allow_null=True, allow_blank=True, max_length=512, trim_whitespace=False)
    safety_identifier = StrictCharField(
        required=False, allow_null=True, allow_blank=True, max_length=512, trim_whitespace=False
    )
    prompt_cache_key = StrictCharField(
        required=False, allow_null=True, allow_blank=True, max_length=512, trim_whitespace=False
    )
    prompt_cache_retention = StrictChoiceField(choices=surface.PROMPT_CACHE_RETENTIONS, required=False, allow_null=True)
    prompt_cache_options = LooseObjectField(required=False, allow_null=True)
    metadata = MetadataField(required=False, allow_null=True)
    store = documented_as(StrictBooleanField, {"type": "boolean", "enum": [False]})(
        required=False, allow_null=True, help_text="Only false: stored chat completions are not built."
    )
    logprobs = documented_as(StrictBooleanField, {"type": "boolean", "enum": [False]})(
        required=False, allow_null=True, help_text="Only false: log probabilities are not returned."
    )
    top_logprobs = documented_as(StrictIntegerField, {"type": "integer", "minimum": 0, "maximum": 0})(
        required=False, allow_null=True, min_value=0, max_value=surface.MAX_TOP_LOGPROBS
    )
    logit_bias = documented_as(LooseObjectField, {"type": "object", "maxProperties": 0})(
        required=False, allow_null=True, help_text="Only `{}`: biases are not applied."
    )
    reasoning_effort = StrictChoiceField(
        choices=surface.REASONING_EFFORTS,
        required=False,
        allow_null=True,
        help_text="Accepted: the models served here do not reason.",
    )
    verbosity = documented_as(StrictChoiceField, {"type": "string", "enum": ["medium"]})(
        choices=surface.VERBOSITIES, required=False, allow_null=True
    )
    service_tier = documented_as(StrictChoiceField, {"type": "string", "enum": list(surface.ACCEPTED_SERVICE_TIERS)})(
        choices=surface.SERVICE_TIERS, required=False, allow_null=True
    )
    modalities = documented_as(serializers.ListField, {"type": "array", "items": {"type": "string", "enum": ["text"]}})(
        child=StrictCharField(), required=False, allow_null=True
    )
    # Chat fields for features this service lacks: only null (their absence) is accepted.
    audio = NullOnlyField(required=False, help_text="audio output is not supported")
    prediction = NullOnlyField(required=False, help_text="predicted outputs are not supported")
    web_search_options = NullOnlyField(required=False, help_text="web search is not available")
    moderation = NullOnlyField(required=False, help_text="no moderation model runs here")
    functions = NullOnlyField(required=False, help_text="the deprecated functions field is not supported; use tools")
    function_call = NullOnlyField(
        required=False, help_text="the deprecated function_call field is not supported; use tool_choice"
    )
    # Extensions, as on responses (vLLM takes the same names).
    top_k = StrictIntegerField(required=False, allow_null=True, min_value=0, max_value=MAX_TOP_K)
    min_p = StrictFloatField(required=False, allow_null=True, min_value=0.0, max_value=1.0)
    repetition_penalty = StrictFloatField(
        required=False, allow_null=True, min_value=MIN_REPETITION_PENALTY, max_value=MAX_REPETITION_PENALTY
    )
