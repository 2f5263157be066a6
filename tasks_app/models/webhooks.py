"""Webhook endpoints and the outbox of their deliveries (docs/webhooks.md)."""

from __future__ import annotations

from django.db import models
from django.db.models import Q

from tasks_app.models.clients import Client


class WebhookDeliveryStatus(models.TextChoices):
    PENDING = "pending", "pending"
    """Not delivered yet: attempted (again) once ``next_attempt_at`` has come."""
    DELIVERED = "delivered", "delivered"
    """The receiver answered an attempt with a 2xx."""
    FAILED = "failed", "failed"
    """Given up: no attempt succeeded within LMSP_WEBHOOK_MAX_AGE_SECONDS of the event."""


class WebhookEndpoint(models.Model):
    """A client's webhook endpoint (docs/webhooks.md): where its tasks' terminal events are POSTed."""

    id = models.CharField(max_length=31, primary_key=True)
    client = models.ForeignKey(Client, on_delete=models.CASCADE, related_name="webhook_endpoints")
    name = models.CharField(max_length=200)
    url = models.CharField(max_length=2048)
    event_types = models.JSONField(default=list, help_text="The event types delivered here")
    # Kept (HMAC needs it), shown only in the replies of create and rotate; never in the admin.
    secret = models.CharField(max_length=64)
    # After a rotation that keeps it for 24 hours, deliveries are signed with both.
    previous_secret = models.CharField(max_length=64, blank=True, default="")
    previous_secret_expires_at = models.DateTimeField(null=True, blank=True)
    created_at = models.DateTimeField()
    updated_at = models.DateTimeField()

    class Meta:
        db_table = "webhook_endpoints"
        constraints = [
            models.CheckConstraint(condition=Q(secret__startswith="whsec_"), name="webhook_endpoint_secret_whsec"),
        ]
        indexes = [models.Index(fields=["client", "-id"], name="webhook_endpoint_client_newest")]

    def __str__(self) -> str:
        return self.id


class WebhookDelivery(models.Model):
    """One event for one endpoint: the outbox row the deliverer sends until it is delivered or given up.

    Written in the transaction that ends the task (``tasks_app.core.lifecycle``),
    so an event is delivered exactly when its task's end was committed.
    ``response_id`` and ``task_id`` are plain columns: deleting a response
    does not take its pending delivery with it.
    """

    id = models.CharField(max_length=32, primary_key=True, help_text="The webhook-id header, the same on every attempt")
    # Indexed with the id below (an endpoint's deliveries, newest first).
    endpoint = models.ForeignKey(WebhookEndpoint, on_delete=models.CASCADE, related_name="deliveries", db_index=False)
    event_id = models.CharField(max_length=31, help_text="The event's id (evt_...), the payload's id")
    event_type = models.CharField(max_length=64)
    payload = models.TextField(help_text="The exact bytes signed and sent (UTF-8 JSON)")
    response_id = models.CharField(max_length=31)
    task_id = models.CharField(max_length=31)
    status = models.CharField(
        max_length=20, choices=WebhookDeliveryStatus.choices, default=WebhookDeliveryStatus.PENDING
    )
    attempts = models.IntegerField(default=0)
    next_attempt_at = models.DateTimeField()
    last_attempt_at = models.DateTimeField(null=True, blank=True)
    last_status_code = models.IntegerField(null=True, blank=True, help_text="The HTTP status of the last attempt")
    last_error = models.TextField(blank=True, default="")
    delivered_at = models.DateTimeField(null=True, blank=True)
    # The claim (compare-and-set): a deliverer owns the row while its lease runs; one that died with
    # it simply leaves it to the next claim once the lease expired (at least once).
    lease_token = models.CharField(max_length=32, blank=True, default="")
    lease_expires_at = models.DateTimeField(null=True, blank=True)
    created_at = models.DateTimeField()

    class Meta:
        db_table = "webhook_deliveries"
        verbose_name_plural = "webhook deliveries"
        constraints = [
            models.CheckConstraint(
                condition=Q(status__in=WebhookDeliveryStatus.values), name="webhook_delivery_status_valid"
            ),
            models.CheckConstraint(condition=Q(attempts__gte=0), name="webhook_delivery_attempts_non_negative"),
            # Delivered means an attempt succeeded, and says when.
            models.CheckConstraint(
                condition=~Q(status=WebhookDeliveryStatus.DELIVERED) | Q(delivered_at__isnull=False, attempts__gte=1),
                name="webhook_delivery_delivered_has_time",
            ),
        ]
        indexes = [
            # The deliverer's poll: the due pending rows, however many delivered ones are kept.
            models.Index(
                fields=["next_attempt_at"],
                condition=Q(status=WebhookDeliveryStatus.PENDING),
                name="webhook_delivery_due",
            ),
            models.Index(fields=["endpoint", "-id"], name="webhook_delivery_endpoint"),
            # Retention cleanup finds delivered and given-up rows by their last attempt.
            models.Index(fields=["last_attempt_at"], name="webhook_delivery_last_attempt"),
        ]

    def __str__(self) -> str:
        return self.id
