"""OpenAI's function tools on a request (PROFILE.md 10.4): which functions it offers, what its
``tool_choice`` and ``parallel_tool_calls`` ask, and what is refused before anything is queued.

Both OpenAI surfaces send them (a chat request's ``{"type": "function", "function": {...}}`` is
translated to the Responses shape first): read here into the generation spec's tools and tool choice,
which is all the worker sees (``tasks_app.generation.tool_calls`` makes the prompt and the grammar).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from tasks_app.exceptions import InvalidRequest
from tasks_app.generation import structured_output
from tasks_app.generation.spec import CHOICE_AUTO, CHOICE_NONE, CHOICE_REQUIRED, Tool, ToolChoice

NONE = CHOICE_NONE
AUTO = CHOICE_AUTO
REQUIRED = CHOICE_REQUIRED
NAMESPACE = "namespace"
# OpenAI's function names: at most 64 characters (``tool_calls.NAME_RE`` allows what any protocol does).
NAME_RE = re.compile(r"^[a-zA-Z0-9_-]{1,64}\Z")


def _offered(request: Mapping[str, Any]) -> list[tuple[str, Mapping[str, Any], str | None]]:
    """Each function the request offers: its path in ``tools``, the tool, and the namespace it is in.

    A ``namespace`` tool only groups functions: each is offered to the model
    under its own name (names are unique across the request, so a call's
    name alone says which function it is), and its call's item names the
    ``namespace`` beside the ``name``, as OpenAI's does (Codex CLI dispatches
    by the pair).
    Hosted tools are not offered: the model chooses among what runs here, as
    if it chose not to call the others.
    """
    offered = []
    for index, tool in enumerate(request.get("tools") or ()):
        kind = tool.get("type", "function")
        if kind == "function":
            offered.append((f"tools[{index}]", tool, None))
        elif kind == NAMESPACE:
            offered += [
                (f"tools[{index}].tools[{inner}]", function, tool.get("name"))
                for inner, function in enumerate(tool.get("tools") or ())
                if function.get("type", "function") == "function"
            ]
    return offered


def function_tools(request: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    """The stored request's function tools (``{"type": "function", "name", ...}``), a namespace's included."""
    return [tool for _, tool, _ in _offered(request)]


def hosted_tools(request: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    """The tools of types this service does not run (offered by default by agents; never shown to the model)."""
    return [tool for tool in request.get("tools") or () if tool.get("type", "function") not in ("function", NAMESPACE)]


def _choice_name(choice: Mapping[str, Any]) -> str | None:
    # Responses: {"type": "function", "name"}; Chat: {"type": "function", "function": {"name"}}.
    return choice.get("name") or (choice.get("function") or {}).get("name")


def spec_tools(request: Mapping[str, Any]) -> tuple[Tool, ...]:
    """The functions a checked request offers, as the generation spec holds them."""
    return tuple(
        Tool(
            name=tool["name"],
            description=tool.get("description") or None,
            parameters=tool.get("parameters"),
            namespace=namespace,
        )
        for _, tool, namespace in _offered(request)
    )


def spec_tool_choice(request: Mapping[str, Any]) -> ToolChoice:
    """The choice a checked request makes; ``none`` when it offers no function."""
    names = tuple(tool["name"] for tool in function_tools(request))
    parallel = request.get("parallel_tool_calls", True) is not False
    choice = request.get("tool_choice") or AUTO
    if not names:
        return ToolChoice(NONE, (), parallel)
    if isinstance(choice, str):
        return ToolChoice(choice, names, parallel)
    if choice.get("type") == "allowed_tools":
        allowed = {_choice_name(tool) for tool in choice.get("tools") or ()}
        return ToolChoice(choice.get("mode", AUTO), tuple(n for n in names if n in allowed), parallel)
    name = _choice_name(choice)
    # A named function is one call of it (as OpenAI and vLLM force it), whatever parallel_tool_calls says.
    return ToolChoice(REQUIRED, tuple(n for n in names if n == name), parallel=False)


def tools_check(request: Mapping[str, Any], *, chat: bool = False) -> None:
    """Refuse, naming the field, tools and choices that cannot be enforced (before anything is queued).

    Names must be unique and OpenAI-shaped (a namespace's functions among
    all the others: the model calls them by name); every tool's
    ``parameters`` must compile to a grammar (a call's arguments are
    constrained by it); a named or allowed tool must be one the request
    offers; a choice that requires a call needs a function to call (a hosted
    tool offered beside it is never called here).
    """
    offered = _offered(request)
    choice = request.get("tool_choice")
    choice_param = "tool_choice"
    where = ".function" if chat else ""
    if not offered:
        if choice in (None, NONE, AUTO):
            return
        if hosted_tools(request):
            raise InvalidRequest(
                "tool_choice asks for a tool call, but the request offers only hosted tools, which do not run here",
                errors=[{"field": choice_param, "message": "requires tools that run here (hosted tools do not)"}],
            )
        raise InvalidRequest(
            "tool_choice asks for a tool call, but the request has no tools",
            errors=[{"field": choice_param, "message": "requires tools"}],
        )
    seen: set[str] = set()
    for path, tool, _ in offered:
        name = tool.get("name") or ""
        field = f"{path}{where}.name"
        if not NAME_RE.match(name):
            raise InvalidRequest(
                f"tool name {name!r} must be 1-64 letters, digits, _ or -",
                errors=[{"field": field, "message": "letters, digits, _ and -, at most 64"}],
            )
        if name in seen:
            raise InvalidRequest(
                f"two tools are named {name!r} (a namespace's functions are called by their own names)",
                errors=[{"field": field, "message": "tool names must be unique"}],
            )
        seen.add(name)
        _parameters_check(tool, f"{path}{where}.parameters")
    if isinstance(choice, Mapping):
        _named_choice_check(choice, seen)


def _named_choice_check(choice: Mapping[str, Any], offered: set[str]) -> None:
    """A named function or ``allowed_tools`` names only functions the request offers."""
    allowed = choice.get("type") == "allowed_tools"
    for tool in choice.get("tools") or () if allowed else ():
        kind = tool.get("type") if isinstance(tool, Mapping) else None
        if kind not in (None, "function", NAMESPACE):
            raise InvalidRequest(
                f"tool_choice allows {kind!r}, a hosted tool, which does not run here",
                errors=[{"field": "tool_choice", "message": f"no tool named {kind!r} runs here (a hosted tool)"}],
            )
    wanted = [_choice_name(tool) for tool in choice.get("tools") or ()] if allowed else [_choice_name(choice)]
    for name in wanted:
        if name not in offered:
            raise InvalidRequest(
                f"tool_choice names {name!r}, which is not among the request's tools",
                errors=[{"field": "tool_choice", "message": f"no tool named {name!r}"}],
            )
    if allowed and not wanted and choice.get("mode") == REQUIRED:
        raise InvalidRequest(
            "tool_choice allowed_tools requires a call but allows no tool",
            errors=[{"field": "tool_choice", "message": "allows no tool"}],
        )


def _parameters_check(tool: Mapping[str, Any], field: str) -> None:
    parameters = tool.get("parameters")
    if parameters is None:
        return
    problem = structured_output.schema_problem(parameters)
    if problem:
        raise InvalidRequest(
            f"the parameters of tool {tool.get('name')!r} cannot be enforced: {problem}",
            errors=[{"field": field, "message": problem}],
        )
