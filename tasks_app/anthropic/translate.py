"""A Messages request (PROFILE.md 11.1) as the service's generation spec: the one place it is read.

The request's top level was checked by its serializer; here every block is
read, checked and translated in one pass, and anything refused is named by
its path (``messages.3.content.0.type``). What asks for nothing this service
lacks (``cache_control`` marks, ``thinking``, ``metadata``, the output
``effort``, echoed ``thinking`` blocks) is accepted; what asks for what it
lacks (images, documents, server-run tools that a choice requires, code
execution containers) is refused by name, never accepted and ignored.

Two things Claude Code sends shape the prompt:

- its ``system`` starts with an attribution line (``x-anthropic-billing-header:
  cc_version=...``) that changes from conversation to conversation: it is
  metadata for Anthropic's billing, not an instruction, and left in the
  prompt it would make every conversation's prompt differ from its first
  tokens on (no prefix shared with any other); it is left out;
- with tool search on, most tools come ``defer_loading: true`` and reach
  the model only once a ``tool_reference`` block (in a tool's result) names
  them, as Anthropic's own API does: until then they are not in the prompt.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from tasks_app.exceptions import InvalidRequest, UnsupportedParameter
from tasks_app.generation import structured_output
from tasks_app.generation.spec import (
    ASSISTANT,
    CHOICE_AUTO,
    CHOICE_NONE,
    CHOICE_REQUIRED,
    JSON_SCHEMA,
    TOOL,
    USER,
    Constraint,
    GenerationSpec,
    Sampling,
    Tool,
    ToolChoice,
    Turn,
)
from tasks_app.generation.tool_calls import NAME_RE

BILLING_HEADER = "x-anthropic-billing-header:"
CUSTOM_TOOL = "custom"
# A server-side tool search could load any deferred tool: offered one, every deferred tool is shown.
SERVER_TOOL_SEARCH_PREFIX = "tool_search_tool"
TOOL_KEYS = {
    "type",
    "name",
    "description",
    "input_schema",
    "cache_control",
    "defer_loading",
    "strict",
    "input_examples",
    "eager_input_streaming",
    "allowed_callers",
}
TOOL_CHOICE_TYPES = ("auto", "any", "tool", "none")
THINKING_TYPES = ("enabled", "disabled", "adaptive")
OUTPUT_CONFIG_KEYS = {"effort", "format"}
# Blocks a client echoes from an earlier answer, with nothing in them for the prompt.
ECHOED_BLOCKS = ("thinking", "redacted_thinking")
# Blocks this service cannot read: refused by name.
UNREADABLE_BLOCKS = ("image", "document", "search_result", "container_upload")


@dataclass(frozen=True)
class _Tools:
    spec_tools: tuple[Tool, ...]
    """The tools the model is shown."""
    client: tuple[Tool, ...]
    """Every client tool (shown or deferred): what a choice may name."""
    server: frozenset[str]
    """The names of tools that run on Anthropic's side (or a type this service does not know)."""


def _bad(message: str, field: str) -> InvalidRequest:
    return InvalidRequest(message, errors=[{"field": field, "message": message}])


def _refused(message: str, param: str) -> UnsupportedParameter:
    return UnsupportedParameter(f"{param}: {message}", param=param)


def message_spec(request: Mapping[str, Any]) -> GenerationSpec:
    """The generation spec of a checked Messages request (or a token count's, which has no limit)."""
    _refuse_remote(request)
    turns, referenced, system_messages = _turns(request["messages"])
    tools = _tools(request.get("tools") or [], referenced)
    choice = _tool_choice(request.get("tool_choice"), tools)
    shown = tools.spec_tools
    if choice.allowed and choice.allowed[0] not in {tool.name for tool in shown}:
        # A choice that names a deferred tool loads it.
        shown = (*shown, *(tool for tool in tools.client if tool.name == choice.allowed[0]))
    thinking = request.get("thinking")
    if thinking is not None and thinking.get("type") not in THINKING_TYPES:
        raise _bad(f"thinking.type must be one of {', '.join(THINKING_TYPES)}", "thinking.type")
    system = _system(request.get("system"), system_messages)
    return GenerationSpec(
        model=request["model"],
        turns=tuple(turns),
        system=system,
        sampling=Sampling(
            temperature=request.get("temperature"), top_p=request.get("top_p"), top_k=request.get("top_k")
        ),
        stops=_stops(request.get("stop_sequences") or []),
        max_output_tokens=request.get("max_tokens"),
        tools=shown,
        tool_choice=choice,
        constraint=_constraint(request.get("output_config")),
    )


def _refuse_remote(request: Mapping[str, Any]) -> None:
    if request.get("container") is not None:
        raise _refused("code execution containers run on Anthropic's servers; this service has none", "container")
    if request.get("mcp_servers"):
        raise _refused(
            "remote MCP servers are called by Anthropic's servers; offer their tools as tools", "mcp_servers"
        )


def _system(system: Any, from_messages: Sequence[str]) -> str | None:
    if system is None:
        texts: list[str] = []
    elif isinstance(system, str):
        texts = [system]
    else:
        texts = []
        for index, block in enumerate(system):
            field = f"system.{index}"
            if not isinstance(block, Mapping) or block.get("type") != "text" or not isinstance(block.get("text"), str):
                raise _bad("a system block must be a text block: {'type': 'text', 'text': ...}", field)
            texts.append(block["text"])
    kept = [text for text in [*texts, *from_messages] if text and not text.startswith(BILLING_HEADER)]
    return "\n\n".join(kept) if kept else None


def _stops(stops: Sequence[str]) -> tuple[str, ...]:
    for index, stop in enumerate(stops):
        if not stop:
            raise _bad("a stop sequence must not be empty", f"stop_sequences.{index}")
    return tuple(stops)


def _constraint(config: Mapping[str, Any] | None) -> Constraint | None:
    if not config:
        return None
    unknown = sorted(set(config) - OUTPUT_CONFIG_KEYS)
    if unknown:
        raise _bad(f"output_config has no field {unknown[0]!r}", f"output_config.{unknown[0]}")
    output_format = config.get("format")
    if output_format is None:
        return None
    if not isinstance(output_format, Mapping) or output_format.get("type") != JSON_SCHEMA:
        raise _bad("output_config.format must be {'type': 'json_schema', 'schema': {...}}", "output_config.format")
    schema = output_format.get("schema")
    if not isinstance(schema, Mapping):
        raise _bad("output_config.format needs a schema (a JSON Schema object)", "output_config.format.schema")
    problem = structured_output.schema_problem(schema)
    if problem is not None:
        raise _bad(f"the schema cannot be enforced: {problem}", "output_config.format.schema")
    return Constraint(JSON_SCHEMA, schema=schema, name="output", strict=True)


# --------------------------------------------------------------------------- messages


def _blocks(content: Any, field: str) -> list[Mapping[str, Any]]:
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list):
        raise _bad("content must be a string or a list of content blocks", field)
    for index, block in enumerate(content):
        if not isinstance(block, Mapping) or not isinstance(block.get("type"), str):
            raise _bad("a content block must be an object with a type", f"{field}.{index}")
    return content


def _text_of(block: Mapping[str, Any], field: str) -> str:
    if not isinstance(block.get("text"), str):
        raise _bad("a text block needs text (a string)", f"{field}.text")
    return block["text"]


def _system_text(block: Mapping[str, Any], field: str) -> str:
    if block["type"] != "text":
        raise _bad("a system message holds text blocks only", f"{field}.type")
    return _text_of(block, field)


def _turns(messages: Sequence[Any]) -> tuple[list[Turn], set[str], list[str]]:
    """The conversation's turns, the tools its results reference, and text of ``role: system`` messages."""
    turns: list[Turn] = []
    referenced: set[str] = set()
    system: list[str] = []
    names: dict[str, str] = {}
    if not messages:
        raise _bad("messages must not be empty", "messages")
    for index, message in enumerate(messages):
        field = f"messages.{index}"
        if not isinstance(message, Mapping):
            raise _bad("a message must be an object with role and content", field)
        unknown = sorted(set(message) - {"role", "content"})
        if unknown:
            raise _bad(f"a message has no field {unknown[0]!r}", f"{field}.{unknown[0]}")
        role = message.get("role")
        blocks = _blocks(message.get("content"), f"{field}.content")
        if role == "user":
            turns += _user_turns(blocks, f"{field}.content", names, referenced)
        elif role == "assistant":
            turns += _assistant_turns(blocks, f"{field}.content", names)
        elif role == "system":
            # Claude Code sends one for model names it does not know: it is read as more of the system prompt.
            system += [_system_text(block, f"{field}.content.{i}") for i, block in enumerate(blocks)]
        else:
            raise _bad("role must be 'user' or 'assistant'", f"{field}.role")
    last = messages[-1].get("role")
    if last == "assistant":
        raise _refused(
            "a last assistant message (a prefill the answer continues) is not supported; end with a user message",
            f"messages.{len(messages) - 1}",
        )
    return turns, referenced, system


def _user_turns(
    blocks: Sequence[Mapping[str, Any]], field: str, names: Mapping[str, str], referenced: set[str]
) -> list[Turn]:
    turns: list[Turn] = []
    texts: list[str] = []
    for index, block in enumerate(blocks):
        kind, where = block["type"], f"{field}.{index}"
        if kind == "text":
            texts.append(_text_of(block, where))
        elif kind == "tool_result":
            if texts:
                turns.append(Turn(USER, "\n\n".join(texts)))
                texts = []
            turns.append(_tool_result(block, where, names, referenced))
        elif kind in UNREADABLE_BLOCKS:
            raise _refused(f"{kind} blocks are not supported: this service's models read text only", f"{where}.type")
        else:
            raise _bad(f"a user message cannot hold a {kind!r} block", f"{where}.type")
    if texts:
        turns.append(Turn(USER, "\n\n".join(texts)))
    return turns


def _tool_result(block: Mapping[str, Any], field: str, names: Mapping[str, str], referenced: set[str]) -> Turn:
    call_id = block.get("tool_use_id")
    if not isinstance(call_id, str) or call_id not in names:
        raise _bad("tool_use_id must name a tool_use block of an earlier assistant message", f"{field}.tool_use_id")
    content = block.get("content")
    texts: list[str] = []
    if isinstance(content, str):
        texts.append(content)
    elif isinstance(content, list):
        for index, part in enumerate(content):
            where = f"{field}.content.{index}"
            kind = part.get("type") if isinstance(part, Mapping) else None
            if kind == "text":
                texts.append(_text_of(part, where))
            elif kind == "tool_reference" and isinstance(part.get("tool_name"), str):
                referenced.add(part["tool_name"])
                texts.append(f"Tool {part['tool_name']} is now available.")
            elif kind in UNREADABLE_BLOCKS:
                raise _refused(f"{kind} blocks are not supported: this service's models read text only", where)
            else:
                raise _bad("a tool result's content holds text or tool_reference blocks", where)
    elif content is not None:
        raise _bad("content must be a string or a list of blocks", f"{field}.content")
    text = "\n\n".join(texts)
    if block.get("is_error") is True:
        text = f"Error: {text}"
    return Turn(TOOL, text, call_id=call_id, name=names[call_id])


def _assistant_turns(blocks: Sequence[Mapping[str, Any]], field: str, names: dict[str, str]) -> list[Turn]:
    turns: list[Turn] = []
    for index, block in enumerate(blocks):
        kind, where = block["type"], f"{field}.{index}"
        if kind == "text":
            text = _text_of(block, where)
            if text:
                turns.append(Turn(ASSISTANT, text))
        elif kind == "tool_use":
            call_id, name, arguments = block.get("id"), block.get("name"), block.get("input")
            if not isinstance(call_id, str) or not call_id:
                raise _bad("a tool_use block needs an id", f"{where}.id")
            if not isinstance(name, str) or not name:
                raise _bad("a tool_use block needs a name", f"{where}.name")
            if not isinstance(arguments, Mapping):
                raise _bad("a tool_use block's input must be an object", f"{where}.input")
            names[call_id] = name
            turns.append(Turn(ASSISTANT, call_id=call_id, name=name, arguments=json.dumps(arguments)))
        elif kind in ECHOED_BLOCKS:
            continue
        else:
            raise _refused(f"{kind} blocks (a server tool's) are not supported in an assistant message", where)
    return turns


# --------------------------------------------------------------------------- tools


def _tools(tools: Sequence[Any], referenced: set[str]) -> _Tools:
    client: list[tuple[Tool, bool]] = []
    server: set[str] = set()
    server_search = False
    seen: set[str] = set()
    for index, tool in enumerate(tools):
        field = f"tools.{index}"
        if not isinstance(tool, Mapping):
            raise _bad("a tool must be an object", field)
        kind = _tool_kind(tool, field)
        name = tool.get("name")
        if not isinstance(name, str) or not NAME_RE.match(name):
            raise _bad("a tool's name must be 1-128 letters, digits, _ or -", f"{field}.name")
        if name in seen:
            raise _bad(f"two tools are named {name!r}", f"{field}.name")
        seen.add(name)
        if kind != CUSTOM_TOOL:
            # Run on Anthropic's side (web search, code execution) or defined by it: offered, never shown
            # to the model; a choice that requires one is refused (_tool_choice).
            server.add(name)
            server_search = server_search or kind.startswith(SERVER_TOOL_SEARCH_PREFIX)
            continue
        unknown = sorted(set(tool) - TOOL_KEYS)
        if unknown:
            raise _bad(f"a tool has no field {unknown[0]!r}", f"{field}.{unknown[0]}")
        schema = tool.get("input_schema")
        if not isinstance(schema, Mapping) or schema.get("type") != "object":
            raise _bad("input_schema must be a JSON Schema object with type 'object'", f"{field}.input_schema")
        problem = structured_output.schema_problem(schema)
        if problem is not None:
            raise _bad(f"the input schema cannot be enforced: {problem}", f"{field}.input_schema")
        description = tool.get("description")
        if description is not None and not isinstance(description, str):
            raise _bad("description must be a string", f"{field}.description")
        deferred = tool.get("defer_loading") is True
        client.append((Tool(name=name, description=description, parameters=dict(schema)), deferred))
    shown = tuple(tool for tool, deferred in client if not deferred or server_search or tool.name in referenced)
    return _Tools(spec_tools=shown, client=tuple(tool for tool, _ in client), server=frozenset(server))


def _tool_kind(tool: Mapping[str, Any], field: str) -> str:
    kind = tool.get("type")
    if kind is None:
        return CUSTOM_TOOL
    if not isinstance(kind, str) or not kind:
        raise _bad("a tool's type must be a non-empty string (or null for a client tool)", f"{field}.type")
    return kind


def _tool_choice(choice: Mapping[str, Any] | None, tools: _Tools) -> ToolChoice:
    shown = tuple(tool.name for tool in tools.spec_tools)
    if choice is None:
        return ToolChoice(mode=CHOICE_AUTO, allowed=shown)
    kind = _tool_choice_check(choice)
    parallel = choice.get("disable_parallel_tool_use") is not True
    if kind in ("none", "auto"):
        return ToolChoice(mode=CHOICE_NONE if kind == "none" else CHOICE_AUTO, allowed=shown, parallel=parallel)
    if kind == "any":
        if not shown and tools.server:
            raise _refused("'any' requires a tool this service can run; only server tools were offered", "tool_choice")
        if not shown:
            raise _bad("tool_choice 'any' requires tools", "tool_choice")
        return ToolChoice(mode=CHOICE_REQUIRED, allowed=shown, parallel=parallel)
    name = choice.get("name")
    if name in tools.server:
        raise _refused(f"{name!r} runs on Anthropic's servers; this service cannot call it", "tool_choice.name")
    if name not in {tool.name for tool in tools.client}:
        raise _bad(f"tool_choice names {name!r}, which is not among the tools", "tool_choice.name")
    return ToolChoice(mode=CHOICE_REQUIRED, allowed=(name,), parallel=parallel)


def _tool_choice_check(choice: Mapping[str, Any]) -> str:
    kind = choice.get("type")
    if kind not in TOOL_CHOICE_TYPES:
        raise _bad(f"tool_choice.type must be one of {', '.join(TOOL_CHOICE_TYPES)}", "tool_choice.type")
    unknown = sorted(set(choice) - {"type", "name", "disable_parallel_tool_use"})
    if unknown:
        raise _bad(f"tool_choice has no field {unknown[0]!r}", f"tool_choice.{unknown[0]}")
    if not isinstance(choice.get("name", ""), str):
        raise _bad("tool_choice.name must be a string", "tool_choice.name")
    if not isinstance(choice.get("disable_parallel_tool_use", False), bool):
        raise _bad("disable_parallel_tool_use must be a boolean", "tool_choice.disable_parallel_tool_use")
    return kind
