"""The requests of ``POST /messages`` and ``POST /messages/count_tokens`` (PROFILE.md 11.1): shapes only.

The top level is checked here (JSON types, unknown fields refused by name);
the content blocks, tools and tool choice are read, checked and translated in
one pass by ``tasks_app.anthropic.translate``, which names the path of any
block at fault (``messages.2.content.0.tool_use_id``).
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

# The most a request may offer; Claude Code offers 12-21 tools, its MCP servers more.
MAX_TOOLS = 512
MAX_STOP_SEQUENCES = 64
MAX_MESSAGES = 100_000


class _JsonListField(serializers.ListField):
    """A JSON list of anything (its elements are read by the translation)."""

    child = serializers.JSONField()


class SystemField(serializers.Field):
    """``system``: a string, or a list of text blocks (their ``cache_control`` marks are hints)."""

    def to_internal_value(self, data: Any) -> Any:
        if isinstance(data, str) or isinstance(data, list):
            return data
        raise serializers.ValidationError("must be a string or a list of text blocks")

    def to_representation(self, value: Any) -> Any:
        return value


class ToolChoiceField(LooseObjectField):
    """``tool_choice``: ``{"type": "auto"|"any"|"tool"|"none", "name"?, "disable_parallel_tool_use"?}``."""


class _Common(StrictSerializer):
    """What a Messages request and a token count share."""

    model = StrictCharField(max_length=200)
    messages = _JsonListField(max_length=MAX_MESSAGES)
    system = SystemField(required=False)
    tools = _JsonListField(required=False, max_length=MAX_TOOLS)
    tool_choice = ToolChoiceField(required=False)
    # Hints and settings that ask for nothing the service lacks: accepted (PROFILE.md 11.1).
    thinking = LooseObjectField(required=False, allow_null=True)
    output_config = LooseObjectField(required=False, allow_null=True)
    cache_control = LooseObjectField(required=False, allow_null=True)
    context_management = LooseObjectField(required=False, allow_null=True)
    speed = StrictCharField(required=False, allow_null=True)
    # Code execution containers and remote MCP servers run on Anthropic's side: refused when given.
    container = serializers.JSONField(required=False, allow_null=True)
    mcp_servers = _JsonListField(required=False, allow_null=True)


class MessageRequestSerializer(_Common):
    max_tokens = StrictIntegerField(min_value=1)
    stream = StrictBooleanField(required=False, default=False)
    stop_sequences = serializers.ListField(
        child=StrictCharField(trim_whitespace=False), required=False, max_length=MAX_STOP_SEQUENCES
    )
    temperature = StrictFloatField(required=False, min_value=0.0, max_value=1.0)
    top_p = StrictFloatField(required=False, min_value=0.0, max_value=1.0)
    top_k = StrictIntegerField(required=False, min_value=1)
    metadata = LooseObjectField(required=False, allow_null=True)
    service_tier = StrictCharField(required=False)
    inference_geo = StrictCharField(required=False, allow_null=True)
    diagnostics = LooseObjectField(required=False, allow_null=True)
    # Extension (as on POST /responses): what happens to the generation if the service restarts under it.
    on_restart = serializers.ChoiceField(choices=("fail", "resume"), required=False, default="fail")


class CountTokensRequestSerializer(_Common):
    pass
