"""What a run knows of its generation as far as the event log goes: its text, its pending batch, its
snapshot, and, for a run that may call tools, the parser and the output items."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tasks_app.core.lifecycle import Partial
from tasks_app.core.output_items import OutputItems
from tasks_app.core.wire import usage_object
from tasks_app.events import Event
from tasks_app.generation.tool_call_parser import (
    CALL_ARGUMENTS,
    CALL_END,
    CALL_START,
    MalformedToolCall,
    Op,
    ToolCallParser,
)
from tasks_app.selectors.tasks import task_output_items
from workers.backends.base import Chunk, Generation
from workers.heartbeat import Heartbeat
from workers.run_metrics import RunMetrics


def run_usage(generation: Generation | None) -> dict[str, Any] | None:
    if generation is None:
        return None
    return usage_object(generation.prompt_tokens, generation.output_tokens, cached_tokens=generation.cached_tokens)


@dataclass
class ToolRun:
    """A run whose model may call tools (PROFILE.md 10.4): its text read for calls as it comes, and the
    output items (messages and calls) that reading makes, with their events not yet committed."""

    parser: ToolCallParser
    items: OutputItems
    pending_events: list[Event] = field(default_factory=list)

    def read(self, raw: str) -> None:
        """Text the model wrote; raises ``MalformedToolCall`` for a call that breaks once opened."""
        self._apply(self.parser.feed(raw))

    def end(self, *, incomplete: bool) -> None:
        """The generation ended: what the parser held is decided, and the item still open closes.

        Cut by the token limit (``incomplete``), what the parser held is dropped, never text (a call whose
        name is known is open, and closes ``incomplete``)."""
        self._apply(self.parser.finish(cut=incomplete))
        if self.parser.call_open and not incomplete:
            raise MalformedToolCall("the model's tool call is malformed: the output ended inside it")
        self.pending_events += self.items.finish("incomplete" if incomplete else "completed")

    def _apply(self, ops: list[Op]) -> None:
        for kind, value in ops:
            if kind == CALL_START:
                self.pending_events += self.items.call_start(value)
            elif kind == CALL_ARGUMENTS:
                self.pending_events += self.items.call_arguments(value)
            elif kind == CALL_END:
                self.pending_events += self.items.call_end(value)
            else:
                self.pending_events += self.items.text(value)


@dataclass
class Run:
    """The state of one generation as far as the event log knows it."""

    task_id: str
    worker: str
    item_id: str
    heartbeat: Heartbeat
    metrics: RunMetrics
    generation: Generation | None = None
    model_name: str = ""
    chunk: Chunk | None = None
    """The last chunk read from the engine: its state is the next snapshot's."""
    committed_text: list[str] = field(default_factory=list)
    pending: list[str] = field(default_factory=list)
    pending_tokens: int = 0
    last_token_at: float = 0.0
    # Generated ids already in snapshot rows, and whether the prompt is.
    stored_tokens: int = 0
    prompt_stored: bool = False
    _snapshot_tokens: int = 0
    tools: ToolRun | None = None
    """Set for a run whose model may call tools once its generation is set up."""
    calls_tools: bool = False
    """The request may call tools: its output is items (messages and calls), not one message."""

    def snapshot(self) -> dict[str, Any]:
        """The next snapshot row: new token ids and the small state (see ``TaskSnapshot``).

        Prompt ids go into the first row only, generated ids into the row of
        the batch that made them, and the released text is not stored at all
        (the committed deltas are it), so a batch copies nothing that grows
        with the output.
        """
        assert self.generation is not None
        chunk = self.chunk
        if chunk is None or chunk.state is None:
            # Before the engine has the generation: this thread is the only one touching it.
            new_ids, state = self.generation.snapshot_since(self.stored_tokens, with_prompt=not self.prompt_stored)
        else:
            # The model thread is ahead: the state and ids as of the chunk's last step.
            new_ids = self.generation.generated_ids[self.stored_tokens : chunk.output_tokens]
            state = dict(chunk.state)
            if not self.prompt_stored:
                state["prompt_ids"] = list(self.generation.prompt_ids)
        self._snapshot_tokens = self.stored_tokens + len(new_ids)
        row_state: dict[str, Any] = {"item_id": self.item_id, "backend": state}
        if self.tools is not None:
            # The model's own text of this batch (markers and all): a resumed run's parser reads it again.
            row_state["raw"] = "".join(self.pending)
        return {"token_ids": new_ids, "state": row_state}

    def snapshot_stored(self) -> None:
        """The row from the last :meth:`snapshot` was committed."""
        self.stored_tokens = self._snapshot_tokens
        self.prompt_stored = True

    def text(self) -> str:
        return "".join(self.committed_text)

    def partial(self) -> Partial:
        """What the event log shows of this attempt, for a run that stops early."""
        if self.calls_tools:
            # Only what was committed: the items as the event log has them.
            items = task_output_items(task_id=self.task_id)
            return Partial(self.item_id, "", run_usage(self.generation), items=items)
        return Partial(self.item_id, self.text(), run_usage(self.generation))

    @property
    def output_tokens(self) -> int:
        """Tokens as far as this thread has read them (the engine may be ahead)."""
        if self.chunk is not None:
            return self.chunk.output_tokens
        return self.generation.output_tokens if self.generation is not None else 0
