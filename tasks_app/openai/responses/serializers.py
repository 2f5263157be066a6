"""The Responses request (PROFILE.md section 3) and the response object: input and output serializers.

Input serializers check shape and JSON types strictly (``tasks_app.edge.strict_json``)
and refuse unknown fields by name; they hold no business rules. What each value makes
the service do, or refuse, is decided in ``tasks_app/openai/surface.py``. The request's
``input`` is in ``input_items``, its ``tools`` and ``tool_choice`` in ``tools``.
"""

from __future__ import annotations

from typing import Any

from drf_spectacular.utils import extend_schema_field
from rest_framework import serializers

from tasks_app.core.wire import response_object
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
from tasks_app.openai.responses.input_items import ResponseInputField
from tasks_app.openai.responses.tool_serializers import FORMAT_NAME, ResponseToolsField, ToolChoiceField
from tasks_app.states import RestartPolicy

MAX_STOP_SEQUENCES = 4
MAX_METADATA_PAIRS = 16
MAX_METADATA_KEY = 64
MAX_METADATA_VALUE = 512
MAX_SEED = 2**64 - 1
# More than any vocabulary: a top_k at or above a model's vocabulary keeps every token.
MAX_TOP_K = 1_000_000
# The sampler's range (workers/backends/sampling/, which this layer may not import):
# outside it a penalised float32 score can overflow.
MIN_REPETITION_PENALTY = 0.01
MAX_REPETITION_PENALTY = 100.0


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


_CONVERSATION_ID_SCHEMA = {"type": "string", "minLength": 1, "maxLength": 200}


@extend_schema_field(
    {
        "oneOf": [
            _CONVERSATION_ID_SCHEMA,
            {
                "type": "object",
                "required": ["id"],
                "properties": {"id": _CONVERSATION_ID_SCHEMA},
                "additionalProperties": False,
            },
        ]
    }
)
class ConversationRefField(serializers.Field):
    """``conversation``: a conversation's id, or ``{"id": ...}`` (the openai package sends either)."""

    def to_internal_value(self, data: Any) -> str | dict[str, str]:
        value = data.get("id") if isinstance(data, dict) and set(data) == {"id"} else data
        if not isinstance(value, str) or not 1 <= len(value) <= 200:
            raise serializers.ValidationError('must be a conversation id or {"id": <conversation id>}')
        return data

    def to_representation(self, value: Any) -> Any:
        return value


@extend_schema_field({"type": "number", "exclusiveMinimum": 0, "maximum": 1})
class TopPField(StrictFloatField):
    """``top_p`` in (0, 1], the sampler's domain (``workers/backends/sampling/``): 0 is refused up front."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(max_value=1.0, **kwargs)

    def to_internal_value(self, data: Any) -> float:
        value = super().to_internal_value(data)
        if value <= 0.0:
            raise serializers.ValidationError("must be greater than 0")
        return value


class TextFormatSerializer(StrictSerializer):
    type = StrictChoiceField(
        choices=surface.TEXT_FORMAT_TYPES,
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
        choices=surface.VERBOSITIES, required=False, allow_null=True
    )


class ReasoningSerializer(StrictSerializer):
    effort = StrictChoiceField(choices=surface.REASONING_EFFORTS, required=False, allow_null=True)
    summary = StrictChoiceField(choices=surface.REASONING_SUMMARIES, required=False, allow_null=True)
    generate_summary = StrictChoiceField(choices=surface.REASONING_SUMMARIES, required=False, allow_null=True)


class StreamOptionsSerializer(StrictSerializer):
    include_obfuscation = StrictBooleanField(required=False)


class BackgroundOptionsSerializer(StrictSerializer):
    completion_window = documented_as(StrictChoiceField, {"type": "string", "enum": ["soonest"]})(
        choices=surface.COMPLETION_WINDOWS, required=False
    )
    continuation_id = StrictCharField(required=False, allow_blank=True, max_length=512)


class ImageOptionsSerializer(StrictSerializer):
    context_compression = documented_as(StrictChoiceField, {"type": "string", "enum": ["auto", "disabled"]})(
        choices=surface.IMAGE_COMPRESSIONS, required=False
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
        choices=surface.TRUNCATIONS,
        required=False,
        allow_null=True,
        help_text="`disabled` (default): a prompt that leaves no room for output fails with "
        "`context_length_exceeded`; `auto`: whole items are dropped from the start of the conversation "
        "(never `instructions` or this request's own input) until it fits.",
    )
    include = documented_as(
        serializers.ListField,
        {"type": "array", "items": {"type": "string", "enum": list(surface.ACCEPTED_INCLUDES)}},
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
        max_value=surface.MAX_TOP_LOGPROBS,
        help_text="Only 0: log probabilities are not returned.",
    )
    user = StrictCharField(required=False, allow_null=True, allow_blank=True, max_length=512, trim_whitespace=False)
    safety_identifier = StrictCharField(
        required=False, allow_null=True, allow_blank=True, max_length=512, trim_whitespace=False
    )
    prompt_cache_key = StrictCharField(
        required=False, allow_null=True, allow_blank=True, max_length=512, trim_whitespace=False
    )
    prompt_cache_retention = StrictChoiceField(choices=surface.PROMPT_CACHE_RETENTIONS, required=False, allow_null=True)
    prompt_cache_options = LooseObjectField(required=False, allow_null=True, help_text="A hint: accepted.")
    service_tier = documented_as(StrictChoiceField, {"type": "string", "enum": list(surface.ACCEPTED_SERVICE_TIERS)})(
        choices=surface.SERVICE_TIERS,
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
    conversation = ConversationRefField(
        required=False,
        allow_null=True,
        help_text='A conversation of this client (PROFILE.md 12.1), its id or `{"id"}`: its items come before '
        "this input, and this input and the output are added to it when the response completes (or is "
        "incomplete); not with `previous_response_id`. A second response on it while one runs is "
        "`409 conversation_busy`.",
    )
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


class ResponseOutputSerializer(serializers.BaseSerializer):
    """A ``selectors.ResponseRead``: the row and what is live about it."""

    def to_representation(self, instance: Any) -> dict[str, Any]:
        return response_object(instance.response, instance.live)
