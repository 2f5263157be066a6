"""The generation spec: a request as this service understands it, whatever protocol it came in.

Each protocol's adapter translates its request into one :class:`GenerationSpec`
when the request is accepted (``tasks_app.openai.responses.translate`` for a
Responses request, a task's ``input`` and, through it, a Chat Completions
request), and the spec is stored beside the raw request
(``Response.generation``). It is all a worker reads to run the task: the
messages, the sampling values, the stops and the limit, the normalized tool
choice and tools, the output constraint, and the conversation it continues.
No protocol's field name reaches the worker or the runtimes; what a protocol
says back (a finish reason, an output item) is translated by its adapter.

The stored form is plain JSON with a ``version``: a task stored by one
release is run by the next (a reader of an older version goes here, beside
:meth:`GenerationSpec.from_json`).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

VERSION = 1

# The roles of a turn. A tool call is an assistant turn with a ``call``; its result a ``tool`` turn.
SYSTEM = "system"
USER = "user"
ASSISTANT = "assistant"
TOOL = "tool"
ROLES = (SYSTEM, USER, ASSISTANT, TOOL)

# What a tool choice lets the model do.
CHOICE_NONE = "none"
CHOICE_AUTO = "auto"
CHOICE_REQUIRED = "required"

# What an output constraint asks for.
ANY_JSON_OBJECT = "json_object"
JSON_SCHEMA = "json_schema"


@dataclass(frozen=True)
class Turn:
    """One turn of the conversation, in the order the model reads them.

    A text turn has ``text``; a tool call is an ``assistant`` turn with
    ``call_id``, ``name`` and ``arguments`` (the JSON text of the call, as the
    model wrote it or the client echoed it); a tool's result is a ``tool``
    turn with the ``call_id`` it answers and its ``text``.
    """

    role: str
    text: str = ""
    call_id: str | None = None
    name: str | None = None
    arguments: str | None = None

    @property
    def is_call(self) -> bool:
        return self.role == ASSISTANT and self.name is not None

    def to_json(self) -> dict[str, Any]:
        return {key: value for key, value in asdict(self).items() if value not in (None, "") or key == "role"}


@dataclass(frozen=True)
class Sampling:
    """The sampling values a request sets; None leaves the model's own default (its generation config)."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    seed: int | None = None


@dataclass(frozen=True)
class Tool:
    """A function the model may call: its name, what it does, and its arguments' JSON Schema."""

    name: str
    description: str | None = None
    parameters: Mapping[str, Any] | None = None
    namespace: str | None = None
    """The group the client offered it in (its call's output item names it beside the name)."""


@dataclass(frozen=True)
class ToolChoice:
    """What the model may do with the tools: ``none``, ``auto`` or ``required``, among ``allowed``."""

    mode: str = CHOICE_AUTO
    allowed: tuple[str, ...] = ()
    """The names a call may take (all offered tools unless the request narrowed them)."""
    parallel: bool = True
    """More than one call in a turn."""

    @property
    def max_calls(self) -> int | None:
        return None if self.parallel else 1


@dataclass(frozen=True)
class Constraint:
    """An output the model must produce: any JSON object, or JSON a schema accepts."""

    kind: str
    schema: Mapping[str, Any] | None = None
    name: str | None = None
    strict: bool = True


@dataclass(frozen=True)
class GenerationSpec:
    """A request as the worker runs it (module docstring)."""

    model: str
    turns: tuple[Turn, ...] = ()
    system: str | None = None
    """The request's own instructions: shown first, never dropped, not carried into a later turn."""
    context_turns: int = 0
    """How many of ``turns`` came from the conversation this request continues (its first ones)."""
    truncate: bool = False
    """A prompt over the context may lose its oldest turns (all but the newest one) to fit."""
    sampling: Sampling = field(default_factory=Sampling)
    stops: tuple[str, ...] = ()
    max_output_tokens: int | None = None
    """The most tokens to generate; more than the model can hold is served as the most it can."""
    tools: tuple[Tool, ...] = ()
    tool_choice: ToolChoice = field(default_factory=ToolChoice)
    constraint: Constraint | None = None
    cache_key: str | None = None
    """The client's own name for the conversation (a prompt cache key), for routing."""
    continues: str | None = None
    """The stored response whose conversation this request continues (its turns are copied in at accept)."""

    # --------------------------------------------------------------- reading it

    @property
    def calls_tools(self) -> bool:
        """The model may call a tool (with none offered, or ``none`` chosen, its output is one message)."""
        return bool(self.tools) and self.tool_choice.mode != CHOICE_NONE

    @property
    def callable_tools(self) -> tuple[Tool, ...]:
        """The tools a call may name, in the order they were offered."""
        allowed = set(self.tool_choice.allowed)
        return tuple(tool for tool in self.tools if tool.name in allowed)

    @property
    def namespaces(self) -> dict[str, str]:
        return {tool.name: tool.namespace for tool in self.tools if tool.namespace}

    @property
    def droppable_turns(self) -> int:
        """How many turns truncation may drop: all but the newest one (what this turn asks), if any."""
        return max(len(self.turns) - 1, 0) if self.truncate else 0

    def continued(self, context: Sequence[Turn]) -> GenerationSpec:
        """This request after the turns of the conversation it continues."""
        return replace(self, turns=(*context, *self.turns), context_turns=len(context))

    def conversation_turns(self, output: Sequence[Turn]) -> list[Turn]:
        """The conversation as a later turn continues it: every turn of this one, then its answer."""
        return [*self.turns, *output]

    def conversation_key(self) -> str:
        """What every turn of a conversation begins with, hashed ("" with nothing to key); a cache key
        names the conversation itself (with the model: a key is the client's own word)."""
        if self.cache_key:
            return _digest(["cache_key", self.model, self.cache_key])
        if not self.turns:
            return ""
        first = self.turns[0]
        start = [first.role, first.text] if not first.is_call else first.to_json()
        return _digest([self.model, self.system, [asdict(tool) for tool in self.tools], start])

    def continues_conversation(self) -> bool:
        """Whether turns came before this request's own (copied, or echoed by the client), or a cache key
        names its conversation: only such a request is routed by its key."""
        return bool(self.cache_key) or self.context_turns > 0 or any(t.role in (ASSISTANT, TOOL) for t in self.turns)

    # --------------------------------------------------------------- stored form

    def to_json(self) -> dict[str, Any]:
        return {
            "version": VERSION,
            "model": self.model,
            "system": self.system,
            "turns": [turn.to_json() for turn in self.turns],
            "context_turns": self.context_turns,
            "truncate": self.truncate,
            "sampling": {key: value for key, value in asdict(self.sampling).items() if value is not None},
            "stops": list(self.stops),
            "max_output_tokens": self.max_output_tokens,
            "tools": [{key: value for key, value in asdict(tool).items() if value is not None} for tool in self.tools],
            "tool_choice": asdict(self.tool_choice) | {"allowed": list(self.tool_choice.allowed)},
            "constraint": None if self.constraint is None else asdict(self.constraint),
            "cache_key": self.cache_key,
            "continues": self.continues,
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> GenerationSpec:
        if data.get("version") != VERSION:
            raise ValueError(f"generation spec version {data.get('version')!r} is not one this release reads")
        choice = data.get("tool_choice") or {}
        constraint = data.get("constraint")
        return cls(
            model=data["model"],
            system=data.get("system"),
            turns=tuple(Turn(**turn) for turn in data.get("turns") or ()),
            context_turns=int(data.get("context_turns") or 0),
            truncate=bool(data.get("truncate")),
            sampling=Sampling(**(data.get("sampling") or {})),
            stops=tuple(data.get("stops") or ()),
            max_output_tokens=data.get("max_output_tokens"),
            tools=tuple(Tool(**tool) for tool in data.get("tools") or ()),
            tool_choice=ToolChoice(
                mode=choice.get("mode", CHOICE_AUTO),
                allowed=tuple(choice.get("allowed") or ()),
                parallel=choice.get("parallel", True),
            ),
            constraint=None if constraint is None else Constraint(**constraint),
            cache_key=data.get("cache_key"),
            continues=data.get("continues"),
        )


def _digest(parts: Any) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:32]
