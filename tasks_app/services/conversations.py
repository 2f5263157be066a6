"""Conversations of OpenAI's Conversations API (PROFILE.md 12.1; docs/conversations.md, decision 0016).

A conversation is a list of items the client adds (``conversation_items_add``)
and the responses that name it add to: a response with ``conversation``
reads the added items as its context, copied into its generation spec at
accept time as ``previous_response_id``'s context is (decision 0004), so the
worker never reads the conversation and a restart changes nothing; its input
items wait as ``pending`` rows until it ends, when the lifecycle adds them
with its output, or drops them, in the transaction of its terminal event
(``tasks_app.core.conversation_log``).

One response at a time: a second response started on a conversation while
one has not finished is refused, ``409 conversation_busy`` (decided in
decision 0016: a wait would hold an HTTP request or a worker for as long
as the first one runs, and its context would be the first one's output,
which the second request's author has not seen).

The items are in the protocol's own shape (what the API lists) beside the
turn each one is to a model (``Turn``): the adapter that received them
translated both (``tasks_app.openai.conversations``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from django.db import transaction
from django.utils import timezone

from tasks_app.exceptions import ConversationBusy, ConversationItemNotFound, ConversationNotFound
from tasks_app.generation.spec import Turn
from tasks_app.ids import new_conversation_id
from tasks_app.models import Client, Conversation, ConversationItem, ConversationItemState, Response
from tasks_app.services.continuations import Continuation
from tasks_app.states import RESPONSE_UNFINISHED


@dataclass(frozen=True)
class ConversationEntry:
    """An item to add: as the API shows it (with its ``id``), and the turn it is to a model (None: no turn)."""

    item: Mapping[str, Any]
    turn: Turn | None


@dataclass(frozen=True)
class ConversationUse:
    """A request's ``conversation``: which one, and the request's input items as the entries it adds."""

    conversation_id: str
    entries: Sequence[ConversationEntry]


def conversation_create(
    *, client: Client, metadata: Mapping[str, str] | None, entries: Sequence[ConversationEntry] = ()
) -> Conversation:
    now = timezone.now()
    with transaction.atomic():
        conversation = Conversation.objects.create(
            id=new_conversation_id(), client=client, metadata=dict(metadata or {}), created_at=now, updated_at=now
        )
        _items_insert(conversation.pk, entries, now=now)
    return conversation


def conversation_update(*, conversation: Conversation, metadata: Mapping[str, str] | None) -> Conversation:
    """Replace the conversation's metadata (OpenAI's update: the whole object; null empties it)."""
    conversation.metadata = dict(metadata or {})
    conversation.updated_at = timezone.now()
    conversation.save(update_fields=["metadata", "updated_at"])
    return conversation


def conversation_delete(*, conversation: Conversation) -> None:
    """Delete the conversation and its items; the responses that used it stay as they are (a running one adds
    nothing when it ends: ``tasks_app.core.conversation_log``)."""
    with transaction.atomic():
        ConversationItem.objects.filter(conversation=conversation).delete()
        Conversation.objects.filter(pk=conversation.pk).delete()


def conversation_items_add(
    *, conversation: Conversation, entries: Sequence[ConversationEntry]
) -> list[ConversationItem]:
    """Add items at the end, in order; a response running meanwhile adds its own after them when it ends."""
    now = timezone.now()
    with transaction.atomic():
        if not Conversation.objects.filter(pk=conversation.pk).update(updated_at=now):
            raise ConversationNotFound(f"No conversation with id {conversation.pk!r}")
        return _items_insert(conversation.pk, entries, now=now)


def conversation_item_delete(*, conversation: Conversation, item_id: str) -> Conversation:
    now = timezone.now()
    with transaction.atomic():
        deleted, _ = ConversationItem.objects.filter(
            conversation=conversation, item_id=item_id, state=ConversationItemState.ADDED
        ).delete()
        if not deleted:
            raise ConversationItemNotFound(f"Conversation {conversation.pk} has no item with id {item_id!r}")
        Conversation.objects.filter(pk=conversation.pk).update(updated_at=now)
    conversation.updated_at = now
    return conversation


def conversation_join(*, client: Client, use: ConversationUse) -> Continuation:
    """What a response starting on ``use``'s conversation continues: its added items' turns, in order, and the
    worker that ran the last response on it (routing to its prefix cache).

    Runs inside the accepting transaction: the conversation's row is locked (PostgreSQL; SQLite's write
    transaction already excludes every other writer), so two responses racing to start on it cannot both
    find it idle. ``ConversationNotFound`` for an unknown or another client's conversation,
    ``ConversationBusy`` while another response on it has not finished.
    """
    locked = (
        Conversation.objects.select_for_update()
        .filter(pk=use.conversation_id, client=client)
        .values_list("last_worker", flat=True)
    )
    worker = locked.first()
    if worker is None:
        raise ConversationNotFound(
            f"No conversation with id {use.conversation_id!r}",
            errors=[{"field": "conversation", "message": "no conversation of this client has this id"}],
        )
    running = (
        Response.objects.filter(conversation_id=use.conversation_id, status__in=RESPONSE_UNFINISHED)
        .values_list("pk", flat=True)
        .first()
    )
    if running is not None:
        raise ConversationBusy(
            f"conversation {use.conversation_id} has a response that has not finished ({running}); "
            "start the next one when it has",
            errors=[{"field": "conversation", "message": f"response {running} on it has not finished"}],
        )
    turns = ConversationItem.objects.filter(
        conversation_id=use.conversation_id, state=ConversationItemState.ADDED, turn__isnull=False
    ).order_by("pk")
    context = [Turn(**turn) for turn in turns.values_list("turn", flat=True)]
    return Continuation(context=context, worker=worker)


def conversation_items_pend(*, use: ConversationUse, response_id: str) -> None:
    """The request's input items, pending until its response ends (in the accepting transaction)."""
    _items_insert(use.conversation_id, use.entries, now=timezone.now(), response_id=response_id)


def _items_insert(
    conversation_id: str, entries: Sequence[ConversationEntry], *, now: datetime, response_id: str = ""
) -> list[ConversationItem]:
    return ConversationItem.objects.bulk_create(
        ConversationItem(
            conversation_id=conversation_id,
            item_id=entry.item["id"],
            item=dict(entry.item),
            turn=None if entry.turn is None else entry.turn.to_json(),
            state=ConversationItemState.PENDING if response_id else ConversationItemState.ADDED,
            response_id=response_id,
            created_at=now,
        )
        for entry in entries
    )
