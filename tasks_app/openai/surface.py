"""OpenAI's request fields beyond LMSP's own, and what this service does with each (PROFILE.md 10.1).

One rule for every field: it is implemented; or accepted (and echoed in the
response object) when its value asks for nothing this service lacks; or
refused with ``400 unsupported_parameter`` naming it. A constraint (tools,
``tool_choice``, ``text.format``, limits) is never accepted and then not
enforced. The serializers check the shapes; this module holds the
decisions, so the table a reader looks for is in one place, and the Chat
Completions adapter asks the same questions of the request it translated.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from tasks_app.exceptions import InvalidRequest, UnsupportedParameter
from tasks_app.openai import text_format, tools

# Input item types and content part types: what the chat template can carry, and OpenAI's others.
SUPPORTED_ITEM_TYPES = ("message", "function_call", "function_call_output", "reasoning")
# An earlier turn's reasoning, echoed back (Codex CLI replays its whole history with `store: false`): the
# models served here have no reasoning mode, so it holds nothing of ours to render, and a reasoning model's
# template drops earlier turns' reasoning too. Accepted and left out of the context.
SKIPPED_ITEM_TYPES = ("reasoning",)
REFUSED_ITEM_TYPES = (
    "file_search_call",
    "web_search_call",
    "computer_call",
    "computer_call_output",
    "image_generation_call",
    "code_interpreter_call",
    "local_shell_call",
    "local_shell_call_output",
    "shell_call",
    "shell_call_output",
    "apply_patch_call",
    "apply_patch_call_output",
    "mcp_list_tools",
    "mcp_approval_request",
    "mcp_approval_response",
    "mcp_call",
    "custom_tool_call",
    "custom_tool_call_output",
    "item_reference",
    "compaction",
)
TEXT_PART_TYPES = ("input_text", "output_text", "refusal")
REFUSED_PART_TYPES = ("input_image", "input_file", "input_audio")

# Hosted tools run on OpenAI's side; this service runs only the client's own functions.
FUNCTION_TOOL = "function"
# Function tools grouped under a name (Codex CLI's `multi_agent_v1`): their functions are offered as any other.
NAMESPACE_TOOL = "namespace"
# Freeform tools whose input is text in a grammar: not built here, refused by name.
CUSTOM_TOOL = "custom"
HOSTED_TOOL_TYPES = (
    "web_search",
    "web_search_preview",
    "web_search_2025_08_26",
    "web_search_preview_2025_03_11",
    "file_search",
    "code_interpreter",
    "computer_use",
    "computer_use_preview",
    "image_generation",
    "mcp",
    "local_shell",
    "shell",
    "apply_patch",
    "tool_search",
    "computer",
)
# Chat Completions has no hosted tools to offer: there every tool but a function is refused.
REFUSED_TOOL_TYPES = (*HOSTED_TOOL_TYPES, CUSTOM_TOOL)
TOOL_CHOICE_MODES = ("none", "auto", "required")

# `include` values. Codex CLI sends `reasoning.encrypted_content` on every request: a model without a
# reasoning mode has no reasoning items, so there is nothing to include and nothing is withheld.
ACCEPTED_INCLUDES = ("reasoning.encrypted_content",)
# Every other value OpenAI documents asks for an output this service does not produce.
REFUSED_INCLUDES = (
    "file_search_call.results",
    "web_search_call.results",
    "web_search_call.action.sources",
    "message.input_image.image_url",
    "computer_call_output.output.image_url",
    "code_interpreter_call.outputs",
    "message.output_text.logprobs",
)

TEXT_FORMAT_TYPES = ("text", "json_object", "json_schema")
VERBOSITIES = ("low", "medium", "high")
TRUNCATIONS = ("disabled", "auto")
# Tiers that ask for a scheduling class; the one queue here is the default one.
ACCEPTED_SERVICE_TIERS = ("auto", "default")
SERVICE_TIERS = ("auto", "default", "flex", "scale", "priority")
REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh")
REASONING_SUMMARIES = ("auto", "concise", "detailed")
PROMPT_CACHE_RETENTIONS = ("in_memory", "24h")
COMPLETION_WINDOWS = ("soonest", "2h", "8h")
IMAGE_COMPRESSIONS = ("auto", "enabled", "disabled")
MAX_TOP_LOGPROBS = 20


def _refuse(param: str, why: str) -> UnsupportedParameter:
    return UnsupportedParameter(f"{param}: {why}", param=param)


def tool_type_check(tool: Any) -> None:
    """Chat Completions: a hosted or custom tool is refused by name; only the client's own functions run."""
    kind = tool.get("type") if isinstance(tool, Mapping) else None
    if kind in REFUSED_TOOL_TYPES:
        # The index is added by the caller's path; the field alone names it well enough for a client.
        raise UnsupportedParameter(f"tools: {kind} is a hosted tool; only function tools run here", param="tools")


def response_request_check(request: Mapping[str, Any]) -> None:
    """Refuse, by name, what a validated Responses request asks for and this service cannot do."""
    tools.tools_check(request)
    _text_check(request.get("text") or {})
    text_format.format_check(request)
    for index, value in enumerate(request.get("include") or ()):
        if value not in ACCEPTED_INCLUDES:
            raise _refuse(f"include[{index}]", f"{value!r} asks for output this service does not produce")
    if request.get("top_logprobs"):
        raise _refuse("top_logprobs", "log probabilities are not returned")
    if request.get("service_tier") not in (None, *ACCEPTED_SERVICE_TIERS):
        raise _refuse("service_tier", "one queue serves every request here; use 'auto' or 'default'")
    _options_check(request)
    if request.get("conversation"):
        if request.get("previous_response_id"):
            raise InvalidRequest(
                "conversation and previous_response_id cannot be used together: a response continues one or the other",
                errors=[{"field": "conversation", "message": "not with previous_response_id"}],
            )
        if request.get("store") is False:
            raise InvalidRequest(
                "a response in a conversation is stored with it: conversation requires store to be true",
                errors=[{"field": "store", "message": "must be true when conversation is given"}],
            )


def _text_check(text: Mapping[str, Any]) -> None:
    if text.get("verbosity") not in (None, "medium"):
        raise _refuse("text.verbosity", "the models served here have no verbosity control; use 'medium'")


def _options_check(request: Mapping[str, Any]) -> None:
    if request.get("context_management"):
        raise _refuse("context_management", "server-side compaction is not built; use truncation 'auto'")
    window = (request.get("background_options") or {}).get("completion_window", "soonest")
    if window != "soonest":
        raise _refuse("background_options.completion_window", "every task runs as soon as a worker is free")
    if (request.get("image") or {}).get("context_compression") == "enabled":
        raise _refuse("image.context_compression", "image input is not supported")
