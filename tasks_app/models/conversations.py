"""Conversations of OpenAI's Conversations API (PROFILE.md 12.1) and their items."""

from __future__ import annotations

from django.db import models
from django.db.models import Q

from tasks_app.fields import JSONTextField
from tasks_app.models.clients import Client


class Conversation(models.Model):
    """A conversation of OpenAI's Conversations API (PROFILE.md 12.1): its items are ``ConversationItem`` rows.

    Kept until its client deletes it (or ``LMSP_CONVERSATION_RETENTION_DAYS``
    after its last change); deleting it takes its items, never the responses
    that added them.
    """

    id = models.CharField(max_length=31, primary_key=True)
    client = models.ForeignKey(Client, on_delete=models.PROTECT, related_name="conversations")
    metadata = JSONTextField(default=dict, blank=True)
    last_worker = models.CharField(
        max_length=200,
        blank=True,
        default="",
        help_text="The worker (node/pid) that ran the newest response added to it: its node holds the prefix cache",
    )
    created_at = models.DateTimeField()
    updated_at = models.DateTimeField(help_text="Its newest change: created, metadata, an item added or deleted")

    class Meta:
        db_table = "conversations"
        indexes = [
            models.Index(fields=["client", "-id"], name="conversation_client_newest"),
            # Retention finds idle conversations by their last change.
            models.Index(fields=["updated_at"], name="conversation_idle"),
        ]

    def __str__(self) -> str:
        return self.id


class ConversationItemState(models.TextChoices):
    ADDED = "added", "added"
    """Part of the conversation: listed, read by the responses that use it."""
    PENDING = "pending", "pending (its response has not finished)"
    """An input item of a response still running: added with its output when it finishes, dropped if it fails."""


class ConversationItem(models.Model):
    """One item of a conversation, in order of ``id``: the item as the API shows it, and the turn it is to a model.

    ``response_id`` is a plain column: deleting a response leaves the items it added.
    """

    id = models.BigAutoField(primary_key=True)
    # Indexed with the id below: items are read per conversation, in order.
    conversation = models.ForeignKey(Conversation, on_delete=models.CASCADE, related_name="items", db_index=False)
    item_id = models.CharField(max_length=64, help_text="The item's id (msg_..., fc_..., fco_...)")
    item = JSONTextField(help_text="The item as the API returns it")
    turn = JSONTextField(
        null=True, blank=True, help_text="The turn the model reads (tasks_app.generation.spec.Turn); null: none"
    )
    state = models.CharField(max_length=10, choices=ConversationItemState.choices, default=ConversationItemState.ADDED)
    response_id = models.CharField(
        max_length=31, blank=True, default="", help_text="The response that added it; empty: added by the client"
    )
    created_at = models.DateTimeField()

    class Meta:
        db_table = "conversation_items"
        constraints = [
            models.UniqueConstraint(fields=["conversation", "item_id"], name="conversation_item_id_unique"),
            models.CheckConstraint(
                condition=Q(state__in=ConversationItemState.values), name="conversation_item_state_valid"
            ),
        ]
        indexes = [
            models.Index(fields=["conversation", "id"], name="conversation_item_order"),
            # A finishing response settles its pending items.
            models.Index(
                fields=["response_id"],
                condition=Q(state=ConversationItemState.PENDING),
                name="conversation_item_pending",
            ),
        ]

    def __str__(self) -> str:
        return self.item_id
