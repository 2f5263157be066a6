"""Conversation items both ways: a Responses input item into the item the API lists and the turn a model reads.

The one place the Conversations API's shapes meet the service's own words
(``tasks_app.services.conversations`` stores both forms). An item the client
sends is first checked as a Responses input item (``input_items.input_item``,
the same rules as a request's ``input``); its ``id`` is always a new one of
ours, so an item echoed back twice is two items, each with its own id.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from tasks_app.core.wire import unix_seconds
from tasks_app.ids import new_function_call_id, new_function_call_output_id, new_message_id
from tasks_app.models import Conversation, ConversationItem
from tasks_app.openai.responses.translate import FUNCTION_CALL, FUNCTION_CALL_OUTPUT, input_items, turns_of_items
from tasks_app.services.conversations import ConversationEntry, ConversationUse

ASSISTANT_ROLE = "assistant"


def conversation_entries(items: Iterable[Mapping[str, Any]]) -> list[ConversationEntry]:
    """Checked input items (``input_item``'s shape) as the entries a conversation stores."""
    return [ConversationEntry(item=_listed(item), turn=turns_of_items([item])[0]) for item in items]


def conversation_use(request: Mapping[str, Any]) -> ConversationUse | None:
    """A validated Responses request's ``conversation`` (an id or ``{"id"}``) with its input as entries."""
    given = request.get("conversation")
    if not given:
        return None
    conversation_id = given["id"] if isinstance(given, Mapping) else given
    return ConversationUse(conversation_id=conversation_id, entries=conversation_entries(input_items(request["input"])))


def _listed(item: Mapping[str, Any]) -> dict[str, Any]:
    kind = item.get("type", "message")
    if kind == FUNCTION_CALL:
        return {
            "id": new_function_call_id(),
            "type": FUNCTION_CALL,
            "call_id": item["call_id"],
            "name": item["name"],
            "arguments": item["arguments"],
            "status": "completed",
        }
    if kind == FUNCTION_CALL_OUTPUT:
        return {
            "id": new_function_call_output_id(),
            "type": FUNCTION_CALL_OUTPUT,
            "call_id": item["call_id"],
            "output": item["output"],
            "status": "completed",
        }
    role = item["role"]
    content = item["content"]
    if isinstance(content, str):
        content = [{"type": "output_text" if role == ASSISTANT_ROLE else "input_text", "text": content}]
    # An output_text part is listed as the SDKs parse one: with its (empty) annotations.
    parts = [{**part, "annotations": []} if part["type"] == "output_text" else dict(part) for part in content]
    return {"id": new_message_id(), "type": "message", "role": role, "status": "completed", "content": parts}


def conversation_object(conversation: Conversation) -> dict[str, Any]:
    return {
        "id": conversation.pk,
        "object": "conversation",
        "created_at": unix_seconds(conversation.created_at),
        "metadata": dict(conversation.metadata or {}),
    }


def conversation_deleted(conversation_id: str) -> dict[str, Any]:
    return {"id": conversation_id, "object": "conversation.deleted", "deleted": True}


def conversation_item_object(item: ConversationItem) -> dict[str, Any]:
    return dict(item.item)
