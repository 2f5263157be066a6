"""A Responses request into the generation spec: the one place its field names become the service's own.

A task's ``input`` is a Responses request too, and a Chat Completions request
is first translated into one (``tasks_app.openai.chat_completions.translate``),
so every request of the OpenAI surface comes to the worker through
:func:`accepted_spec`: the request has passed its serializer, what it asks
and this service cannot do is refused by name, and what is left is
translated (:func:`generation_spec_of` itself refuses nothing).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from typing import Any

from tasks_app.generation.spec import ASSISTANT, SYSTEM, TOOL, USER, GenerationSpec, Sampling, Turn
from tasks_app.openai.surface import response_request_check
from tasks_app.openai.text_format import spec_constraint
from tasks_app.openai.tools import spec_tool_choice, spec_tools

FUNCTION_CALL = "function_call"
FUNCTION_CALL_OUTPUT = "function_call_output"


def accepted_spec(request: Mapping[str, Any]) -> GenerationSpec:
    """The spec of a request its serializer validated, once what it asks and this service cannot do
    is refused by name (``response_request_check``): the one translation every accept goes through."""
    response_request_check(request)
    return generation_spec_of(request)


def generation_spec_of(request: Mapping[str, Any]) -> GenerationSpec:
    """What ``request`` asks the model for, in the service's own words."""
    stop = request.get("stop")
    stops = (stop,) if isinstance(stop, str) else tuple(stop or ())
    return GenerationSpec(
        model=request["model"],
        system=request.get("instructions") or None,
        turns=tuple(turns_of_items(input_items(request.get("input")))),
        truncate=request.get("truncation") == "auto",
        sampling=Sampling(
            temperature=request.get("temperature"),
            top_p=request.get("top_p"),
            top_k=request.get("top_k"),
            min_p=request.get("min_p"),
            repetition_penalty=request.get("repetition_penalty"),
            frequency_penalty=request.get("frequency_penalty"),
            presence_penalty=request.get("presence_penalty"),
            seed=request.get("seed"),
        ),
        stops=tuple(s for s in stops if s),
        max_output_tokens=request.get("max_output_tokens"),
        tools=spec_tools(request),
        tool_choice=spec_tool_choice(request),
        constraint=spec_constraint(request),
        cache_key=request.get("prompt_cache_key") or None,
        continues=request.get("previous_response_id") or None,
    )


def input_items(given: str | list[Mapping[str, Any]] | None) -> list[Mapping[str, Any]]:
    """A request's ``input`` as a list of items (a string is one user message)."""
    if given is None:
        return []
    if isinstance(given, str):
        return [{"type": "message", "role": "user", "content": given}]
    return list(given)


def turns_of_items(items: Iterable[Mapping[str, Any]]) -> list[Turn]:
    """Input items as turns: ``developer`` speaks as ``system`` (templates know only the latter), a
    content list is joined from its text parts, a ``function_call`` is an assistant's call and its
    ``function_call_output`` the tool's answer."""
    turns = []
    for item in items:
        kind = item.get("type", "message")
        if kind == FUNCTION_CALL:
            turns.append(Turn(ASSISTANT, call_id=item["call_id"], name=item["name"], arguments=item["arguments"]))
        elif kind == FUNCTION_CALL_OUTPUT:
            turns.append(Turn(TOOL, text=_output_text(item["output"]), call_id=item["call_id"]))
        else:
            content = item.get("content")
            if isinstance(content, list):
                content = "".join(part.get("text", "") for part in content)
            role = item.get("role", USER)
            turns.append(Turn(SYSTEM if role == "developer" else role, text=content or ""))
    return turns


def _output_text(output: Any) -> str:
    # A tool's output is text, or (Responses) a list of content parts: its text parts, joined.
    if isinstance(output, str):
        return output
    if isinstance(output, list):
        return "".join(part.get("text", "") for part in output if isinstance(part, Mapping))
    return json.dumps(output)
