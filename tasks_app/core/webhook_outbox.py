"""The webhook outbox (docs/webhooks.md), written inside the lifecycle's terminal transaction.

``webhook_deliveries_enqueue`` runs in the transaction that ends a task: a
task's end and its deliveries commit together or not at all. The
deliverer (``tasks_app.services.webhook_delivery``) sends what this writes;
the endpoints are ``tasks_app.services.webhooks``'.

A commit that makes deliveries due publishes on ``<prefix>:webhooks`` after
it commits (``webhooks_due_on_commit``); deliverers subscribed to it claim at
once.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime

from tasks_app.ids import new_webhook_delivery_id, new_webhook_event_id
from tasks_app.models import WebhookDelivery, WebhookDeliveryStatus, WebhookEndpoint
from tasks_app.plumbing.notify import webhooks_due_on_commit

# A batch's ends (OpenAI's batch webhooks, docs/batches.md): written by the transaction that ends the batch.
BATCH_EVENT_TYPES: tuple[str, ...] = ("batch.completed", "batch.failed", "batch.cancelled", "batch.expired")


@dataclass(frozen=True)
class BatchEnd:
    """A batch whose end the caller's transaction commits: who owns it and which of its events it is."""

    batch_id: str
    client_id: int
    event_type: str


@dataclass(frozen=True)
class TaskEnd:
    """A task whose end the caller's transaction commits: who owns it and which terminal event it wrote."""

    task_id: str
    response_id: str
    client_id: int
    event_type: str


def webhook_event_payload(*, event_id: str, end: TaskEnd | BatchEnd, now: datetime) -> str:
    """The OpenAI webhook event (``client.webhooks.unwrap`` parses it), compact JSON: the bytes that are signed.

    A batch's event names the batch only, as OpenAI's ``batch.*`` events do.
    """
    data = {"id": end.batch_id} if isinstance(end, BatchEnd) else {"id": end.response_id, "task_id": end.task_id}
    body = {"id": event_id, "object": "event", "created_at": int(now.timestamp()), "type": end.event_type, "data": data}
    return json.dumps(body, ensure_ascii=False, separators=(",", ":"))


def webhook_deliveries_enqueue(*, ends: Sequence[TaskEnd | BatchEnd], now: datetime) -> int:
    """In the caller's transaction: one pending delivery per endpoint of each task's (or batch's) client
    subscribed to its event.

    One SELECT of the clients' endpoints, and one INSERT only when some
    endpoint is subscribed. The event has one id for all its endpoints;
    each delivery has its own (its ``webhook-id``).
    """
    if not ends:
        return 0
    endpoints = WebhookEndpoint.objects.filter(client_id__in={end.client_id for end in ends})
    subscribed = list(endpoints.values_list("id", "client_id", "event_types"))
    rows = []
    for end in ends:
        targets = [pk for pk, client_id, types in subscribed if client_id == end.client_id and end.event_type in types]
        if not targets:
            continue
        event_id = new_webhook_event_id()
        payload = webhook_event_payload(event_id=event_id, end=end, now=now)
        rows += [
            WebhookDelivery(
                id=new_webhook_delivery_id(),
                endpoint_id=endpoint_id,
                event_id=event_id,
                event_type=end.event_type,
                payload=payload,
                # A batch's delivery names neither (its payload names the batch).
                response_id="" if isinstance(end, BatchEnd) else end.response_id,
                task_id="" if isinstance(end, BatchEnd) else end.task_id,
                status=WebhookDeliveryStatus.PENDING,
                next_attempt_at=now,
                created_at=now,
            )
            for endpoint_id in targets
        ]
    if rows:
        WebhookDelivery.objects.bulk_create(rows)
        webhooks_due_on_commit()
    return len(rows)
