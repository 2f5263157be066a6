"""Idempotency keys (chapter 9.2): a key's request digest and stored reply."""

from __future__ import annotations

from django.db import models
from django.db.models import Q

from tasks_app.fields import JSONTextField
from tasks_app.models.clients import Client


class IdempotencyState(models.TextChoices):
    IN_PROGRESS = "in_progress", "in_progress"
    """The first request with this key is still being served."""
    COMPLETED = "completed", "completed"
    """The reply is stored and is replayed for the same body."""


class IdempotencyKey(models.Model):
    """An Idempotency-Key with its request digest and stored reply."""

    client = models.ForeignKey(Client, on_delete=models.CASCADE, related_name="+")
    endpoint = models.CharField(max_length=50)
    key = models.CharField(max_length=255)
    request_hash = models.CharField(max_length=64)
    state = models.CharField(max_length=20, choices=IdempotencyState.choices)
    response_status = models.IntegerField(null=True, blank=True)
    response_body = JSONTextField(null=True, blank=True)
    response_headers = JSONTextField(default=dict, blank=True)
    # The task a still-unanswered request started (POST /responses): if the
    # process that waited on it died, a retry with the key can still be
    # answered once the task has ended.
    task = models.ForeignKey("Task", null=True, blank=True, on_delete=models.SET_NULL, related_name="+")
    created_at = models.DateTimeField()
    expires_at = models.DateTimeField()

    class Meta:
        db_table = "idempotency_keys"
        constraints = [
            # Concurrent first uses are resolved here, not by a read-then-write.
            models.UniqueConstraint(fields=["client", "endpoint", "key"], name="idempotency_key_unique"),
            models.CheckConstraint(condition=Q(state__in=IdempotencyState.values), name="idempotency_state_valid"),
            models.CheckConstraint(
                condition=Q(state=IdempotencyState.IN_PROGRESS) | Q(response_status__isnull=False),
                name="idempotency_completed_has_reply",
            ),
        ]
        indexes = [models.Index(fields=["expires_at"], name="idempotency_expiry")]

    def __str__(self) -> str:
        return f"{self.endpoint}:{self.key}"
