"""The vocabulary of a task's log: its event types, the event, the encoder and the readers.

Every event type string lives here and nowhere else. The lifecycle writes
events built by ``tasks_app.core.event_payloads``; streams, selectors, the
schema and the admin read them through :class:`EventType` and the readers
below. This module imports no model and no wire shape: ``tasks_app.models``
builds its constraints from it.

An :class:`Event` is a type and its fields, without a number: the lifecycle
numbers events as it writes them (``encode`` puts ``type`` and
``sequence_number`` first, then the fields, as PROFILE.md section 4 shows
them).
"""

from __future__ import annotations

import enum
import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any


class EventType(enum.StrEnum):
    CREATED = "response.created"
    """Event 0: the task was accepted; carries the queued response object."""
    QUEUED = "response.queued"
    """The attempt was let go of and the task queued again (a rerun): the output shown so far is dropped."""
    IN_PROGRESS = "response.in_progress"
    """A worker started generating (each attempt opens with one)."""
    OUTPUT_ITEM_ADDED = "response.output_item.added"
    """The attempt's output message item opened, still empty."""
    CONTENT_PART_ADDED = "response.content_part.added"
    """The item's text part opened, still empty."""
    OUTPUT_TEXT_DELTA = "response.output_text.delta"
    """A piece of generated text; the deltas of an attempt joined are its text."""
    FUNCTION_CALL_ARGUMENTS_DELTA = "response.function_call_arguments.delta"
    """A piece of a function call's arguments (PROFILE.md 10.4), as the model writes them."""
    FUNCTION_CALL_ARGUMENTS_DONE = "response.function_call_arguments.done"
    """A function call's name and whole arguments, once the call is written."""
    OUTPUT_TEXT_DONE = "response.output_text.done"
    """The item's whole text, once generation ended normally."""
    CONTENT_PART_DONE = "response.content_part.done"
    """The text part, closed."""
    OUTPUT_ITEM_DONE = "response.output_item.done"
    """The output item, closed with its final status."""
    COMPLETED = "response.completed"
    """Terminal: the response finished normally."""
    INCOMPLETE = "response.incomplete"
    """Terminal: the response stopped at a limit (``incomplete_details``)."""
    FAILED = "response.failed"
    """Terminal: the task failed; the response carries the problem."""
    CANCELLED = "response.cancelled"
    """Terminal: the task was cancelled; the response keeps the text shown so far."""


E = EventType

# A tuple, in this order: the schema lists them so, and the database's
# one-terminal-event constraint was created with them so.
TERMINAL: tuple[EventType, ...] = (E.COMPLETED, E.INCOMPLETE, E.FAILED, E.CANCELLED)


@dataclass(frozen=True)
class Event:
    """One event to write: its type and fields; the lifecycle gives it its number."""

    type: EventType
    fields: Mapping[str, Any] = field(default_factory=dict)


def encode(event_type: str, sequence_number: int, fields: Mapping[str, Any]) -> str:
    """The stored (and streamed) JSON of one event: type and number first."""
    body = {"type": str(event_type), "sequence_number": sequence_number, **fields}
    return json.dumps(body, ensure_ascii=False, separators=(",", ":"))


@dataclass(frozen=True)
class Encoded:
    """An event encoded ahead of its number: :meth:`payload` is ``encode`` of it, byte for byte.

    The lifecycle encodes the events it knows before it takes the write lock,
    and only joins the number in once the compare-and-set has given it one:
    JSON encoding is no longer done while every other writer waits.
    """

    type: str
    head: str
    tail: str

    def payload(self, sequence_number: int) -> str:
        return f"{self.head}{int(sequence_number)}{self.tail}"


def encoded(event: Event) -> Encoded:
    """``event`` encoded with its number left out (see :class:`Encoded`)."""
    kind = str(event.type)
    head = json.dumps({"type": kind}, ensure_ascii=False, separators=(",", ":"))[:-1] + ',"sequence_number":'
    whole = encode(kind, 0, event.fields)
    if not whole.startswith(head + "0") or "type" in event.fields or "sequence_number" in event.fields:
        raise ValueError(f"event fields may not carry type or sequence_number: {sorted(event.fields)}")
    return Encoded(kind, head, whole[len(head) + 1 :])


# --------------------------------------------------------------------------- #
# Readers
# --------------------------------------------------------------------------- #


def opened_item_id(payload: str) -> str:
    """The item id of a stored ``response.output_item.added`` event."""
    return json.loads(payload)["item"]["id"]


def delta_text(payloads: Iterable[str]) -> str:
    """The text that stored ``response.output_text.delta`` events hold, joined in order."""
    return "".join(json.loads(payload)["delta"] for payload in payloads)


def output_text(output: Iterable[Any] | None) -> str:
    """The text of a response's output items, as a client reads it."""
    return "".join(
        part.get("text", "")
        for item in output or []
        if isinstance(item, dict)
        for part in item.get("content") or []
        if isinstance(part, dict) and part.get("type") == "output_text"
    )
