"""The request's accepted fields as the response object echoes them (PROFILE.md 10.1).

The response object is the core's (``tasks_app.core.wire``); which fields a
request may carry, and what is refused, is its adapter's
(``tasks_app.openai.surface``). What is echoed is only what was accepted,
with the defaults in force where the request left a field out.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

FUNCTION_TOOL = "function"


def response_echo(request: Mapping[str, Any]) -> dict[str, Any]:
    """The accepted fields as the response object shows them, OpenAI's defaults where the request left them.

    Function tools as normalized: both published schemas require ``description``, ``parameters`` and
    ``strict``; the arguments are held to the schema whatever ``strict`` says (``tool_calls``), so strict is
    what is in force. A null the schemas refuse (``user``, ``prompt_cache_options``) is left out instead.
    """
    text = dict(request.get("text") or {})
    text.setdefault("format", {"type": "text"})
    text.setdefault("verbosity", "medium")
    if isinstance(text["format"], Mapping) and text["format"].get("type") == "json_schema":
        # Open Responses requires a description and a boolean strict, where OpenAI takes a string or nothing:
        # "" is the description the model was given; constrained decoding enforces the schema either way.
        given = text["format"]
        text["format"] = {
            **given,
            "description": given.get("description") or "",
            "strict": given.get("strict") is not False,
        }
    return {
        "previous_response_id": request.get("previous_response_id"),
        "tools": [
            {"description": None, "parameters": None, **tool, "strict": tool.get("strict") is not False}
            if isinstance(tool, Mapping) and tool.get("type") == FUNCTION_TOOL
            else tool
            for tool in request.get("tools") or []
        ],
        "tool_choice": request.get("tool_choice") or "auto",
        "parallel_tool_calls": request.get("parallel_tool_calls", True) is not False,
        "max_tool_calls": request.get("max_tool_calls"),
        "text": text,
        "truncation": request.get("truncation") or "disabled",
        "top_logprobs": request.get("top_logprobs") or 0,
        "reasoning": request.get("reasoning") or {"effort": None, "summary": None},
        "service_tier": request.get("service_tier") or "default",
        "store": request.get("store", True) is not False,
        "safety_identifier": request.get("safety_identifier"),
        "prompt_cache_key": request.get("prompt_cache_key"),
        "prompt_cache_retention": request.get("prompt_cache_retention"),
        "image": request.get("image"),
        **{key: request[key] for key in ("user", "prompt_cache_options") if request.get(key) is not None},
    }
