"""The requests of Ollama's native API (PROFILE.md 11.2): shapes only.

What each value makes the service do, or refuse, is decided where the
request is translated (``tasks_app.ollama.translate``). Unknown fields are
refused by name (Ollama's own server ignores them; a client that sends a
field expects it to act).
"""

from __future__ import annotations

from typing import Any

from rest_framework import serializers

from tasks_app.edge.strict_json import (
    LooseObjectField,
    StrictBooleanField,
    StrictCharField,
    StrictFloatField,
    StrictIntegerField,
    StrictSerializer,
)
from tasks_app.openai.responses.serializers import (
    MAX_REPETITION_PENALTY,
    MAX_SEED,
    MAX_TOP_K,
    MIN_REPETITION_PENALTY,
    TopPField,
)

ROLES = ("system", "user", "assistant", "tool")
# Ollama's default seed: a random one each time.
RANDOM_SEED = -1


class AnyJSONField(serializers.Field):
    """A value of any JSON type, read by the translation (``format``, ``keep_alive``, ``think``)."""

    def to_internal_value(self, data: Any) -> Any:
        return data

    def to_representation(self, value: Any) -> Any:
        return value


class OptionsSerializer(StrictSerializer):
    """Ollama's ``options`` (its ``api.Options`` and runner options), each read by the translation."""

    # Sampling.
    num_predict = StrictIntegerField(required=False, allow_null=True)
    # The sampler's domains (workers/backends/sampling/settings.py), as on the other protocols' routes: a value
    # outside one would fail the task after its accept.
    temperature = StrictFloatField(required=False, allow_null=True, min_value=0)
    top_p = TopPField(required=False, allow_null=True)
    top_k = StrictIntegerField(required=False, allow_null=True, min_value=0, max_value=MAX_TOP_K)
    min_p = StrictFloatField(required=False, allow_null=True, min_value=0, max_value=1)
    typical_p = StrictFloatField(required=False, allow_null=True)
    tfs_z = StrictFloatField(required=False, allow_null=True)
    repeat_penalty = StrictFloatField(
        required=False, allow_null=True, min_value=MIN_REPETITION_PENALTY, max_value=MAX_REPETITION_PENALTY
    )
    repeat_last_n = StrictIntegerField(required=False, allow_null=True)
    presence_penalty = StrictFloatField(required=False, allow_null=True, min_value=-2, max_value=2)
    frequency_penalty = StrictFloatField(required=False, allow_null=True, min_value=-2, max_value=2)
    mirostat = StrictIntegerField(required=False, allow_null=True)
    mirostat_tau = StrictFloatField(required=False, allow_null=True)
    mirostat_eta = StrictFloatField(required=False, allow_null=True)
    penalize_newline = StrictBooleanField(required=False, allow_null=True)
    seed = StrictIntegerField(required=False, allow_null=True, min_value=RANDOM_SEED, max_value=MAX_SEED)
    stop = serializers.ListField(child=StrictCharField(allow_blank=True), required=False, allow_null=True)
    # The runner's: how the model is loaded and run.
    num_ctx = StrictIntegerField(required=False, allow_null=True)
    num_keep = StrictIntegerField(required=False, allow_null=True)
    num_batch = StrictIntegerField(required=False, allow_null=True)
    num_gpu = StrictIntegerField(required=False, allow_null=True)
    main_gpu = StrictIntegerField(required=False, allow_null=True)
    num_thread = StrictIntegerField(required=False, allow_null=True)
    numa = StrictBooleanField(required=False, allow_null=True)
    low_vram = StrictBooleanField(required=False, allow_null=True)
    use_mmap = StrictBooleanField(required=False, allow_null=True)
    use_mlock = StrictBooleanField(required=False, allow_null=True)
    vocab_only = StrictBooleanField(required=False, allow_null=True)
    logits_all = StrictBooleanField(required=False, allow_null=True)
    embedding_only = StrictBooleanField(required=False, allow_null=True)


class ToolCallFunctionSerializer(StrictSerializer):
    name = StrictCharField()
    arguments = AnyJSONField(required=False)
    index = StrictIntegerField(required=False)


class ToolCallSerializer(StrictSerializer):
    function = ToolCallFunctionSerializer()
    id = StrictCharField(required=False)
    type = StrictCharField(required=False)


class MessageSerializer(StrictSerializer):
    role = serializers.ChoiceField(choices=ROLES)
    content = StrictCharField(required=False, allow_blank=True, allow_null=True, trim_whitespace=False)
    thinking = StrictCharField(required=False, allow_blank=True, allow_null=True, trim_whitespace=False)
    images = serializers.ListField(required=False, allow_null=True)
    tool_calls = serializers.ListField(child=ToolCallSerializer(), required=False, allow_null=True)
    tool_name = StrictCharField(required=False, allow_blank=True, allow_null=True)
    tool_call_id = StrictCharField(required=False, allow_blank=True, allow_null=True)


class FunctionSerializer(StrictSerializer):
    name = StrictCharField()
    description = StrictCharField(required=False, allow_blank=True, allow_null=True)
    parameters = LooseObjectField(required=False, allow_null=True)


class ToolSerializer(StrictSerializer):
    type = StrictCharField(required=False)
    function = FunctionSerializer()


class _GenerationSerializer(StrictSerializer):
    model = StrictCharField()
    stream = StrictBooleanField(required=False, allow_null=True)
    format = AnyJSONField(required=False, allow_null=True)
    options = OptionsSerializer(required=False, allow_null=True)
    keep_alive = AnyJSONField(required=False, allow_null=True)
    think = AnyJSONField(required=False, allow_null=True)
    logprobs = StrictBooleanField(required=False, allow_null=True)
    top_logprobs = StrictIntegerField(required=False, allow_null=True)


class ChatRequestSerializer(_GenerationSerializer):
    """``POST /api/chat``."""

    # A ListField, not many=True: a list serializer's allow_null reaches its items too, and a null item is no
    # message (or tool).
    messages = serializers.ListField(child=MessageSerializer(), required=False, allow_null=True)
    tools = serializers.ListField(child=ToolSerializer(), required=False, allow_null=True)


class GenerateRequestSerializer(_GenerationSerializer):
    """``POST /api/generate``."""

    prompt = StrictCharField(required=False, allow_blank=True, allow_null=True, trim_whitespace=False)
    suffix = StrictCharField(required=False, allow_blank=True, allow_null=True, trim_whitespace=False)
    system = StrictCharField(required=False, allow_blank=True, allow_null=True, trim_whitespace=False)
    template = StrictCharField(required=False, allow_blank=True, allow_null=True, trim_whitespace=False)
    context = serializers.ListField(child=StrictIntegerField(), required=False, allow_null=True)
    raw = StrictBooleanField(required=False, allow_null=True)
    images = serializers.ListField(required=False, allow_null=True)
    width = StrictIntegerField(required=False, allow_null=True)
    height = StrictIntegerField(required=False, allow_null=True)
    steps = StrictIntegerField(required=False, allow_null=True)


class ModelNameSerializer(StrictSerializer):
    """``POST /api/show`` (``model``, or the older ``name``; ``verbose`` asks for nothing more here)."""

    model = StrictCharField(required=False)
    name = StrictCharField(required=False)
    verbose = StrictBooleanField(required=False, allow_null=True)


class PullRequestSerializer(StrictSerializer):
    """``POST /api/pull``."""

    model = StrictCharField(required=False)
    name = StrictCharField(required=False)
    stream = StrictBooleanField(required=False, allow_null=True)
    insecure = StrictBooleanField(required=False, allow_null=True)
