"""Function tools (PROFILE.md 10.4): the one place that translates between a spec's tools and what a model
reads and writes (a request's own ``tools`` and ``tool_choice`` are read and checked by its protocol's
adapter, ``tasks_app.openai.tools``, into the generation spec).

A request's ``tools`` reach the model through its own chat template (Hugging
Face's ``tools`` argument), and its calls come back as text in its family's
format, which :mod:`tasks_app.generation.tool_call_parser` reads into ``function_call``
items. The formats, by family (:data:`FORMATS`, docs/tools.md):

- ``hermes`` (Hermes 2/3, Qwen2.5, Qwen3): ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``,
  one block per call;
- ``llama3_json`` (Llama 3.1-3.3): one ``{"name": ..., "parameters": {...}}``, alone or after
  ``<|python_tag|>``;
- ``mistral`` (Mistral v3 tokenizers: Nemo, 7B v0.3): ``[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]``,
  call ids of 9 letters and digits;
- ``mistral_args`` (Mistral v11+ tokenizers: Small 3.1/3.2, Devstral, Ministral 3):
  ``[TOOL_CALLS]name[ARGS]{...}``, one marker per call, the same ids;
- ``phi4_mini`` (Phi-4-mini): ``<|tool_call|>[{"name": ..., "arguments": {...}}]<|/tool_call|>``, the tools
  given to the template in the system message's ``tools``;
- ``functools`` (vLLM's template for Phi-4-mini): ``functools[{"name": ..., "arguments": {...}}, ...]``;
- ``generic``, for a template that knows no tools: a system instruction lists the tools and asks for the
  Hermes form.

The family is read from the template (:func:`tool_format_of_template`), or
set per model (``LMSP_TOOL_FORMATS``). ``tool_choice`` is enforced by the
same constrained decoding as structured output (:func:`tools_grammar`):
``required`` and a named function from the first token, ``auto`` from a
call's start marker on (name among the offered tools, arguments by the
tool's schema when it is ``strict``), ``none`` by a grammar that cannot
start a call; ``parallel_tool_calls: false`` allows one call.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from tasks_app.generation import structured_output
from tasks_app.generation.spec import CHOICE_NONE, CHOICE_REQUIRED, JSON_SCHEMA, Constraint, GenerationSpec, Tool

# A function's name: what a call may name. Each protocol's adapter checks its own limit (OpenAI's 64
# characters, Anthropic's 128), within this one.
NAME_RE = re.compile(r"^[a-zA-Z0-9_-]{1,128}\Z")
_ANY_OBJECT: dict[str, Any] = {"type": "object"}


@dataclass(frozen=True)
class ToolFormat:
    """How one family of models writes its calls (see the module docstring)."""

    name: str
    start: str
    """The text (often one special token) that opens the calls."""
    end: str = ""
    """The text that closes each call (``array`` False) or the list (``array`` True); may be empty."""
    array: bool = False
    """The calls are one JSON list after ``start`` (else one object per ``start`` ... ``end``)."""
    arguments_key: str = "arguments"
    bare_json: bool = False
    """A call may also be a JSON object at the very start of the output, with no marker (Llama 3)."""
    single: bool = False
    """The format holds one call only."""
    body_prefix: str = ""
    """What the model writes between ``start`` and the JSON (Hermes: a newline)."""
    body_suffix: str = ""
    call_id_length: int | None = None
    args_marker: str = ""
    """Calls written as ``name`` + this marker + the arguments' JSON, not as a JSON object (Mistral v11+)."""
    separator: str = "\n"
    """Between one call block and the next start marker (formats with a marker per call)."""
    tools_in_system: bool = False
    """The template reads the tools as JSON text in the system message's ``tools`` (Phi-4-mini)."""
    template_tools: bool = True
    """The template gets ``tools``; False: a system instruction carries them (``generic``)."""


FORMATS: dict[str, ToolFormat] = {
    fmt.name: fmt
    for fmt in (
        ToolFormat("hermes", "<tool_call>", "</tool_call>", body_prefix="\n", body_suffix="\n"),
        ToolFormat("llama3_json", "<|python_tag|>", "", arguments_key="parameters", bare_json=True, single=True),
        ToolFormat("mistral", "[TOOL_CALLS]", "", array=True, call_id_length=9),
        ToolFormat("mistral_args", "[TOOL_CALLS]", "", call_id_length=9, args_marker="[ARGS]", separator=""),
        ToolFormat("phi4_mini", "<|tool_call|>", "<|/tool_call|>", array=True, tools_in_system=True),
        ToolFormat("functools", "functools", "", array=True),
        ToolFormat("generic", "<tool_call>", "</tool_call>", template_tools=False),
    )
}

# What gives a template's family away, most specific first.
_TEMPLATE_MARKS: tuple[tuple[str, str], ...] = (
    ("[ARGS]", "mistral_args"),
    ("[TOOL_CALLS]", "mistral"),
    ("<tool_call>", "hermes"),
    ("<|python_tag|>", "llama3_json"),
    ("Environment: ipython", "llama3_json"),
    ("functools[", "functools"),
    ("<|tool_call|>", "phi4_mini"),
    ("<|tool|>", "phi4_mini"),
)


def tool_format_of_template(source: str | None) -> ToolFormat:
    """The family a chat template's own text names; ``generic`` for one that knows no tools."""
    for mark, name in _TEMPLATE_MARKS:
        if source and mark in source:
            return FORMATS[name]
    return FORMATS["generic"]


def markers_of(fmt: ToolFormat) -> list[str]:
    """The texts a family's calls are marked with (which a model may have as single tokens)."""
    return [text for text in (fmt.start, fmt.end, fmt.args_marker) if text]


def tool_format_named(name: str) -> ToolFormat:
    try:
        return FORMATS[name]
    except KeyError:
        raise ValueError(f"unknown tool format {name!r}; one of {', '.join(FORMATS)}") from None


# --------------------------------------------------------------------------- #
# The prompt: tools as the template takes them
# --------------------------------------------------------------------------- #


def template_tools(spec: GenerationSpec) -> list[dict[str, Any]]:
    """The offered tools in Hugging Face's shape (``{"type": "function", "function": {...}}``).

    All offered tools are shown (as OpenAI shows them); the tool choice narrows what may be called.
    """
    shown = []
    for tool in spec.tools:
        function: dict[str, Any] = {"name": tool.name}
        if tool.description:
            function["description"] = tool.description
        function["parameters"] = tool.parameters or {"type": "object", "properties": {}}
        shown.append({"type": "function", "function": function})
    return shown


def tools_summary(spec: GenerationSpec) -> str:
    """The tools and the choice a task runs under, in a few words (the admin's task page)."""
    if not spec.tools:
        return "none"
    choice = spec.tool_choice
    names = ", ".join(tool.name for tool in spec.callable_tools) or "none"
    parallel = "" if choice.parallel else ", one call at most"
    return f"tool_choice {choice.mode} over {names}{parallel}: calls enforced by a grammar"


def generic_instruction(tools: Sequence[Mapping[str, Any]]) -> str:
    """The system text that offers tools to a model whose template knows none (the ``generic`` format)."""
    listed = "\n".join(json.dumps(tool["function"], ensure_ascii=False) for tool in tools)
    return (
        "You can call these functions:\n"
        f"{listed}\n"
        'To call one, write <tool_call>{"name": <function name>, "arguments": <arguments as a JSON object>}'
        "</tool_call>, one block per call, and nothing after the calls."
    )


# --------------------------------------------------------------------------- #
# The grammar: tool_choice enforced
# --------------------------------------------------------------------------- #


def _lark_string(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)


def _marker(text: str, token_ids: Mapping[str, int]) -> str:
    """A marker in the grammar: by token id where it is one token of the model (a text literal equal to a
    special token's text would let the mask allow that token and then refuse it), else as text."""
    if not text:
        return ""
    token = token_ids.get(text)
    return f"<[{token}]>" if token is not None else _lark_string(text)


def _call_rule(fmt: ToolFormat, tool: Tool, token_ids: Mapping[str, int]) -> str:
    """One call of ``tool`` as the family writes it (a JSON object, or the name, a marker and the arguments),
    arguments by its schema (strict or not: a client that gives a schema gets it); compact, as structured
    output is."""
    arguments = f"%json {json.dumps(_compact(tool.parameters or _ANY_OBJECT), ensure_ascii=False)}"
    if fmt.args_marker:
        return f"{_lark_string(tool.name)} {_marker(fmt.args_marker, token_ids)} {arguments}"
    head = _lark_string('{"name": ' + json.dumps(tool.name) + f', "{fmt.arguments_key}": ')
    return f'{head} {arguments} "}}"'


def tools_grammar(spec: GenerationSpec, fmt: ToolFormat, *, token_ids: Mapping[str, int]) -> str | None:
    """The llguidance grammar that enforces the spec's tool choice in ``fmt``; None without tools.

    ``token_ids`` maps a marker's text to its token id where the model has it
    as one token. With a JSON constraint, the answer an ``auto`` or ``none``
    choice allows instead of calls is that JSON.
    """
    if not spec.tools:
        return None
    choice = spec.tool_choice
    callable_tools = spec.callable_tools
    structured = spec.constraint is not None
    special = fmt.start in token_ids
    start = _marker(fmt.start, token_ids)
    end = _marker(fmt.end, token_ids)
    many = not fmt.single and choice.parallel
    # The calls after their first start marker: the first marker is the trigger of an auto choice.
    if fmt.array:
        rest = ('"[" call ("," " " call)* "]"' if many else '"[" call "]"') + (f" {end}" if end else "")
        again = ""
    else:
        one = " ".join(
            p
            for p in (
                _lark_string(fmt.body_prefix) if fmt.body_prefix else "",
                "call",
                _lark_string(fmt.body_suffix) if fmt.body_suffix else "",
                end,
            )
            if p
        )
        rest = one
        separator = _lark_string(fmt.separator) if fmt.separator else ""
        again = f" ({separator} {start} {one})*" if many else ""
    lines = ["%llguidance {}"]
    alternatives = " | ".join(f"call_{i}" for i in range(len(callable_tools)))
    if callable_tools:
        lines.append(f"call: {alternatives}")
        lines += [f"call_{i}: {_call_rule(fmt, tool, token_ids)}" for i, tool in enumerate(callable_tools)]
    lines.append(f"calls_rest: {rest}{again}")
    no_marker = f"/(.|\\n)*/ & ~/(.|\\n)*{_regex_text(fmt.start)}(.|\\n)*/"
    if structured:
        assert spec.constraint is not None
        lines.append(f"answer: %json {json.dumps(_answer_schema(spec.constraint), ensure_ascii=False)}")
    if choice.mode == CHOICE_REQUIRED:
        # Llama 3's template asks for the bare JSON object: that is what a required call is.
        lines.insert(1, "start: call" if fmt.bare_json else f"start: {start} calls_rest")
    elif choice.mode == CHOICE_NONE or not callable_tools:
        lines.insert(1, "start: answer" if structured else "start: TEXT")
        lines.append(f"TEXT: {no_marker}")
    elif structured:
        lines.insert(1, f"start: answer | {start} calls_rest")
    elif fmt.bare_json:
        lines.insert(1, f"start: TEXT | {start} calls_rest | call")
        lines.append(f"TEXT: ({no_marker}) & ~/[ \\t\\n]*\\{{(.|\\n)*/")
    elif special:
        lines.insert(1, f"start: TEXT | ANY {start} calls_rest")
        lines += [f"TEXT: {no_marker}", "ANY: /(.|\\n)*/"]
    else:
        # A text marker: the text before it ends where the marker does (a lazy lexeme).
        lines.insert(1, "start: TEXT | trigger calls_rest")
        lines += [f"trigger[lazy]: ANY {start}", f"TEXT: {no_marker}", "ANY: /(.|\\n)*/"]
    return "\n".join(lines) + "\n"


def _regex_text(text: str) -> str:
    return re.escape(text).replace("/", "\\/")


def _answer_schema(constraint: Constraint) -> Mapping[str, Any]:
    if constraint.kind == JSON_SCHEMA:
        return _compact(constraint.schema or _ANY_OBJECT)
    return _compact(_ANY_OBJECT)


def _compact(schema: Mapping[str, Any]) -> dict[str, Any]:
    """``schema`` compiled as structured output compiles it (compact JSON, no invented keys)."""
    return structured_output.grammar_schema(schema)
