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


def spec_request(generation: Mapping[str, Any] | None) -> dict[str, Any]:
    """A stored generation spec as the LMSP request that asks for it: what the response object of a request
    that came in another protocol echoes (its own shape stays in ``Response.request``, for its adapter)."""
    if not generation:
        return {}
    sampling = generation.get("sampling") or {}
    choice = generation.get("tool_choice") or {}
    tools = generation.get("tools") or []
    constraint = generation.get("constraint")
    echoed: dict[str, Any] = {
        "instructions": generation.get("system"),
        "max_output_tokens": generation.get("max_output_tokens"),
        **{
            key: sampling[key]
            for key in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "seed")
            if key in sampling
        },
        **{key: sampling[key] for key in ("frequency_penalty", "presence_penalty") if key in sampling},
    }
    if generation.get("stops"):
        echoed["stop"] = list(generation["stops"])
    if tools:
        echoed["tools"] = [
            {
                "type": FUNCTION_TOOL,
                "name": tool["name"],
                "description": tool.get("description"),
                "parameters": tool.get("parameters"),
                "strict": True,
            }
            for tool in tools
        ]
        mode = choice.get("mode", "auto")
        allowed = choice.get("allowed") or []
        if mode == "required" and len(allowed) == 1 and len(tools) > 1:
            echoed["tool_choice"] = {"type": FUNCTION_TOOL, "name": allowed[0]}
        else:
            echoed["tool_choice"] = mode
        echoed["parallel_tool_calls"] = choice.get("parallel", True)
    if constraint is not None:
        if constraint.get("kind") == "json_schema":
            echoed["text"] = {
                "format": {
                    "type": "json_schema",
                    "name": constraint.get("name") or "output",
                    "schema": constraint.get("schema"),
                    "strict": constraint.get("strict", True),
                }
            }
        else:
            echoed["text"] = {"format": {"type": "json_object"}}
    return echoed


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
        **_conversation_echo(request.get("conversation")),
    }


def _conversation_echo(given: Any) -> dict[str, Any]:
    # As OpenAI's response object has it: {"id"} whichever way the request named it; absent without one.
    if not given:
        return {}
    return {"conversation": {"id": given["id"] if isinstance(given, Mapping) else given}}
