"""Reads of conversations and their items (PROFILE.md 12.1; docs/conversations.md).

Conversations are strictly per client, ``admin`` scope included: a response
started by one client adds items to the conversation it names, so no client
reads or continues another's; another client's id is ``404
conversation_not_found``, never 403. Only ``added`` items are listed: a
running response's input is pending until it finishes.
"""

from __future__ import annotations

from typing import Literal

from tasks_app.exceptions import ConversationItemNotFound, ConversationNotFound
from tasks_app.models import Client, Conversation, ConversationItem, ConversationItemState
from tasks_app.selectors.tasks import Page


def conversation_get_own(*, client: Client, conversation_id: str) -> Conversation:
    conversation = Conversation.objects.filter(pk=conversation_id, client=client).first()
    if conversation is None:
        raise ConversationNotFound(f"No conversation with id {conversation_id!r}")
    return conversation


def conversation_item_get(*, conversation: Conversation, item_id: str) -> ConversationItem:
    item = ConversationItem.objects.filter(
        conversation=conversation, item_id=item_id, state=ConversationItemState.ADDED
    ).first()
    if item is None:
        raise ConversationItemNotFound(f"Conversation {conversation.pk} has no item with id {item_id!r}")
    return item


def conversation_items_list(
    *, conversation: Conversation, after: str | None, limit: int, order: Literal["asc", "desc"]
) -> Page:
    """One page of the conversation's items in ``order`` (``desc``: newest first, OpenAI's default);
    ``after`` is the id of the last item of the previous page (an item of this conversation)."""
    rows = ConversationItem.objects.filter(conversation=conversation, state=ConversationItemState.ADDED)
    if after:
        position = rows.filter(item_id=after).values_list("pk", flat=True).first()
        if position is None:
            raise ConversationItemNotFound(
                f"after: conversation {conversation.pk} has no item {after!r}",
                errors=[{"field": "after", "message": "not an item of this conversation"}],
            )
        rows = rows.filter(pk__gt=position) if order == "asc" else rows.filter(pk__lt=position)
    items = list(rows.order_by("pk" if order == "asc" else "-pk")[: limit + 1])
    return Page(items=items[:limit], has_more=len(items) > limit)


def conversation_items_shown(*, conversation: Conversation, limit: int) -> tuple[list[ConversationItem], int]:
    """The admin's view of a conversation: its newest ``limit`` items, pending ones included, oldest first, and
    how many items it holds in all."""
    rows = ConversationItem.objects.filter(conversation=conversation)
    newest = list(rows.order_by("-pk")[:limit])
    return newest[::-1], rows.count()
