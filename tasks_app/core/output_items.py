"""The output items of a run that may call tools: messages and function calls, in the order written.

A request without tools has one output item, a message opened when its run
starts (``lifecycle.task_start``). A request with tools (PROFILE.md 10.4)
gets an item for each stretch of text and each call, in the order the model
wrote them: text before a call is a ``message`` item, each call a
``function_call`` item, opened when its name is known and closed with its
whole arguments. :class:`OutputItems` keeps that list for one attempt and
turns what the tool-call parser reads (``tasks_app.generation.tool_call_parser``) into
the events that show it; the lifecycle writes those events with the batch
they belong to. :func:`fold` rebuilds the list from the stored events, so a
read, a recovery and a resumed run see what clients saw.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from django.db.models import F

from tasks_app.core import event_payloads
from tasks_app.core.wire import function_call_item, message_item
from tasks_app.events import Event, EventType
from tasks_app.generation.spec import ASSISTANT, Turn
from tasks_app.ids import new_call_id, new_function_call_id, new_message_id
from tasks_app.models import TaskEvent

MESSAGE = "message"
FUNCTION_CALL = "function_call"


@dataclass
class OutputItem:
    """One output item of an attempt: a message (``text``) or a function call (``name``, ``arguments``)."""

    type: str
    id: str
    index: int
    text: str = ""
    call_id: str = ""
    name: str = ""
    arguments: str = ""
    done: bool = False
    status: str = "in_progress"
    """As the item closed (``completed`` or ``incomplete``); ``in_progress`` while it is open."""
    namespace: str = ""
    """The ``namespace`` tool the called function is in ("" for a top-level function)."""

    def wire(self, status: str) -> dict[str, Any]:
        """The item's wire shape: its own status once closed, ``status`` while open."""
        shown = self.status if self.done else status
        if self.type == FUNCTION_CALL:
            item = function_call_item(self.id, self.call_id, self.name, self.arguments, shown)
            return {**item, "namespace": self.namespace} if self.namespace else item
        return message_item(self.id, self.text, shown)


class OutputItems:
    """The items of one attempt and the events that open, fill and close them.

    Each method returns the events its change writes; the caller commits them
    with its batch. ``call_id_length`` is the model family's call id length
    (Mistral's 9), None for ``call_`` ids.
    """

    def __init__(
        self,
        items: Sequence[OutputItem] = (),
        *,
        call_id_length: int | None = None,
        namespaces: Mapping[str, str] | None = None,
    ) -> None:
        self.items = list(items)
        self.call_id_length = call_id_length
        # A namespace's function is called by its own name (tasks_app.generation.tool_calls): its item names both.
        self.namespaces = dict(namespaces or {})

    def _open(self) -> OutputItem | None:
        last = self.items[-1] if self.items else None
        return last if last is not None and not last.done else None

    def text(self, text: str) -> list[Event]:
        """Message text: into the open message, or a new one after a call (or at the start)."""
        if not text:
            return []
        out: list[Event] = []
        item = self._open()
        if item is None or item.type != MESSAGE:
            out += self._close_open("completed")
            item = OutputItem(MESSAGE, new_message_id(), len(self.items))
            self.items.append(item)
            out += event_payloads.message_opened(item.id, item.index)
        item.text += text
        out.append(event_payloads.message_delta(item.id, item.index, text))
        return out

    def call_start(self, name: str) -> list[Event]:
        """A call whose name is known: the text before it is a finished message."""
        out = self._close_open("completed")
        item = OutputItem(
            FUNCTION_CALL,
            new_function_call_id(),
            len(self.items),
            call_id=new_call_id(self.call_id_length),
            name=name,
            namespace=self.namespaces.get(name, ""),
        )
        self.items.append(item)
        out.append(event_payloads.call_opened(item.id, item.index, item.call_id, name, item.namespace))
        return out

    def call_arguments(self, delta: str) -> list[Event]:
        item = self._open()
        if not delta or item is None or item.type != FUNCTION_CALL:
            return []
        item.arguments += delta
        return [event_payloads.call_arguments_delta(item.id, item.index, delta)]

    def call_end(self, arguments: str) -> list[Event]:
        """The call is written: ``arguments`` is its whole JSON text (the deltas joined, or more when the
        parser could only read them at the end)."""
        item = self._open()
        if item is None or item.type != FUNCTION_CALL:
            return []
        out = self.call_arguments(arguments[len(item.arguments) :]) if arguments.startswith(item.arguments) else []
        item.arguments = arguments
        item.done, item.status = True, "completed"
        out += event_payloads.call_closed(
            item.id, item.index, item.call_id, item.name, arguments, "completed", item.namespace
        )
        return out

    def finish(self, status: str) -> list[Event]:
        """The run ended: the item still open closes with ``status`` (``completed`` or ``incomplete``)."""
        return self._close_open(status)

    def _close_open(self, status: str) -> list[Event]:
        item = self._open()
        if item is None:
            return []
        item.done, item.status = True, status
        if item.type == MESSAGE:
            return event_payloads.message_closed(item.id, item.index, item.text, status)
        return event_payloads.call_closed(
            item.id, item.index, item.call_id, item.name, item.arguments, status, item.namespace
        )

    def output(self, open_status: str = "completed") -> list[dict[str, Any]]:
        """The items as the response shows them; one still open gets ``open_status``."""
        return [item.wire(open_status) for item in self.items]

    @property
    def has_calls(self) -> bool:
        return any(item.type == FUNCTION_CALL for item in self.items)


# Event types that change an attempt's items, and the ones that only say so again.
FOLDED = (
    EventType.OUTPUT_ITEM_ADDED,
    EventType.OUTPUT_TEXT_DELTA,
    EventType.FUNCTION_CALL_ARGUMENTS_DELTA,
    EventType.OUTPUT_ITEM_DONE,
)


def fold(payloads: Iterable[str]) -> list[OutputItem]:
    """An attempt's items from its stored events (``FOLDED`` types, in order), as clients saw them."""
    items: dict[str, OutputItem] = {}
    for payload in payloads:
        event = json.loads(payload)
        kind = event["type"]
        if kind == EventType.OUTPUT_ITEM_ADDED:
            wire = event["item"]
            items[wire["id"]] = OutputItem(
                wire["type"],
                wire["id"],
                int(event["output_index"]),
                call_id=wire.get("call_id", ""),
                name=wire.get("name", ""),
                namespace=wire.get("namespace", ""),
            )
        elif kind == EventType.OUTPUT_ITEM_DONE:
            item = items.get(event["item"]["id"])
            if item is not None:
                item.done, item.status = True, event["item"]["status"]
                if item.type == FUNCTION_CALL:
                    item.arguments = event["item"]["arguments"]
        else:
            item = items.get(event["item_id"])
            if item is None:
                continue
            if kind == EventType.OUTPUT_TEXT_DELTA:
                item.text += event["delta"]
            else:
                item.arguments += event["delta"]
    return sorted(items.values(), key=lambda item: item.index)


def stopped_output(items: Sequence[OutputItem]) -> list[dict[str, Any]]:
    """What a stopped attempt keeps (failed, cancelled, recovered): its items, the open one ``incomplete``;
    an empty message (opened, nothing written) is left out, as a run without tools leaves it out."""
    return [item.wire("incomplete") for item in items if item.type != MESSAGE or item.text]


def has_function_calls(output: Sequence[Mapping[str, Any]] | None) -> bool:
    return any(isinstance(item, Mapping) and item.get("type") == FUNCTION_CALL for item in output or ())


def shown_text(output: Sequence[Mapping[str, Any]] | None) -> str:
    """Output items as the admin's page shows them: each message's text, each call as
    ``→ name(arguments)``, one item per line (the page's live pane appends events the same way)."""
    shown = []
    for item in output or ():
        if item.get("type") == FUNCTION_CALL:
            # A call still being written is left open, as the live pane leaves it until its arguments are done.
            closing = "" if item.get("status") == "in_progress" else ")"
            shown.append(f"\u2192 {item.get('name')}({item.get('arguments', '')}{closing}")
        elif item.get("type") == MESSAGE:
            shown.append(
                "".join(p.get("text", "") for p in item.get("content") or () if p.get("type") == "output_text")
            )
    return "\n".join(shown)


def task_output_items(*, task_id: str) -> list[OutputItem]:
    """The current attempt's output items as its committed events show them (messages and calls)."""
    return task_outputs_items(task_ids=[task_id]).get(task_id, [])


def task_outputs_items(*, task_ids: Sequence[str]) -> dict[str, list[OutputItem]]:
    """:func:`task_output_items` of many tasks in two queries: ``{task id: items}``.

    Tasks whose current attempt opened no output item (claimed, then
    cancelled or failed before its start) are left out, even when an earlier
    attempt opened one: that output was dropped when the task ran again.
    """
    if not task_ids:
        return {}
    added = TaskEvent.objects.filter(
        task_id__in=task_ids, type=EventType.OUTPUT_ITEM_ADDED, sequence_number__gt=F("task__attempt_after")
    )
    first_of: dict[str, int] = {}
    for task_id, sequence in added.values_list("task_id", "sequence_number"):
        first_of[task_id] = min(sequence, first_of.get(task_id, sequence))
    if not first_of:
        # None opened an item (claimed, then cancelled or failed before its start): no output to read.
        return {}
    payloads: dict[str, list[str]] = {task_id: [] for task_id in first_of}
    # The earliest opening bounds every task's events, so the index skips older attempts' output.
    rows = TaskEvent.objects.filter(
        task_id__in=list(first_of), type__in=FOLDED, sequence_number__gte=min(first_of.values())
    ).order_by("task_id", "sequence_number")
    for task_id, sequence, payload in rows.values_list("task_id", "sequence_number", "payload").iterator():
        if sequence >= first_of[task_id]:
            payloads[task_id].append(payload)
    return {task_id: fold(task_payloads) for task_id, task_payloads in payloads.items()}


def output_turns(output: Sequence[Mapping[str, Any]]) -> list[Turn]:
    """A response's output items as the turns a later turn reads: its message's text, its calls."""
    return [turn for item in output or () if (turn := output_turn(item)) is not None]


def output_turn(item: Mapping[str, Any]) -> Turn | None:
    """One output item as the turn a later turn reads (None: an item no model reads)."""
    if item.get("type") == MESSAGE:
        parts = item.get("content", ())
        return Turn(
            ASSISTANT, text="".join(part.get("text", "") for part in parts if part.get("type") == "output_text")
        )
    if item.get("type") == FUNCTION_CALL:
        return Turn(ASSISTANT, call_id=item["call_id"], name=item["name"], arguments=item["arguments"])
    return None
