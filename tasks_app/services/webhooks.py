"""Webhook endpoints (docs/webhooks.md): register, change, rotate, delete, test.

- Endpoints belong to one client; their URL passes the target rule of
  ``tasks_app.plumbing.webhook_http`` when registered and at every attempt.
- The outbox a task's end writes is ``tasks_app.core.webhook_outbox`` (inside
  the lifecycle's terminal transaction); the deliverer that sends it is
  ``tasks_app.services.webhook_delivery`` (``manage.py lmsp_webhooks``).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from datetime import datetime, timedelta

from django.conf import settings
from django.db import transaction
from django.utils import timezone

from tasks_app import events
from tasks_app.core.webhook_outbox import BATCH_EVENT_TYPES, BatchEnd, TaskEnd, webhook_event_payload
from tasks_app.exceptions import InvalidRequest, WebhookTestFailed
from tasks_app.ids import (
    new_batch_id,
    new_response_id,
    new_task_id,
    new_webhook_delivery_id,
    new_webhook_endpoint_id,
    new_webhook_event_id,
)
from tasks_app.models import Client, WebhookDelivery, WebhookEndpoint
from tasks_app.plumbing.webhook_http import (
    WebhookTargetError,
    WebhookTargetUnresolved,
    new_signing_secret,
    target_addresses,
    target_parse,
    webhook_post,
)

logger = logging.getLogger("tasks_app.webhooks")

# The webhook event types: the terminal event types of a task's log, in the same order, then a batch's ends.
EVENT_TYPES: tuple[str, ...] = (*(str(event_type) for event_type in events.TERMINAL), *BATCH_EVENT_TYPES)
# How long a rotated-out secret still signs when the rotation asked to keep it.
PREVIOUS_SECRET_SECONDS = 24 * 3600


# --------------------------------------------------------------------------- #
# Endpoints
# --------------------------------------------------------------------------- #


def _checked_url(url: str) -> str:
    """The target rule at registration; a host that does not resolve yet is checked at each attempt."""
    try:
        target_addresses(target_parse(url), allow_private=settings.LMSP_WEBHOOK_ALLOW_PRIVATE_TARGETS)
    except WebhookTargetUnresolved:
        pass
    except WebhookTargetError as error:
        message = f"not an allowed target: the URL {error}"
        raise InvalidRequest(f"url: {message}", errors=[{"field": "url", "message": message}]) from None
    return url


def _checked_event_types(event_types: Sequence[str]) -> list[str]:
    unknown = [name for name in event_types if name not in EVENT_TYPES]
    if unknown:
        message = f"{unknown[0]!r} is not a supported event type (supported: {', '.join(EVENT_TYPES)})"
        raise InvalidRequest(f"event_types: {message}", errors=[{"field": "event_types", "message": message}])
    if len(set(event_types)) != len(event_types):
        message = "must not name an event type twice"
        raise InvalidRequest(f"event_types: {message}", errors=[{"field": "event_types", "message": message}])
    return list(event_types)


def webhook_endpoint_create(*, client: Client, name: str, url: str, event_types: Sequence[str]) -> WebhookEndpoint:
    """A new endpoint with a new signing secret (the reply of this call is the only one that shows it)."""
    now = timezone.now()
    return WebhookEndpoint.objects.create(
        id=new_webhook_endpoint_id(),
        client=client,
        name=name,
        url=_checked_url(url),
        event_types=_checked_event_types(event_types),
        secret=new_signing_secret(),
        created_at=now,
        updated_at=now,
    )


def webhook_endpoint_update(
    *,
    endpoint: WebhookEndpoint,
    name: str | None = None,
    url: str | None = None,
    event_types: Sequence[str] | None = None,
) -> WebhookEndpoint:
    """Change what is given; ``updated_at`` moves only when something changed.

    Deliveries already in the outbox go to the endpoint as it is when they are sent.
    """
    changes: dict[str, object] = {}
    if name is not None and name != endpoint.name:
        changes["name"] = name
    if url is not None and url != endpoint.url:
        changes["url"] = _checked_url(url)
    if event_types is not None and list(event_types) != endpoint.event_types:
        changes["event_types"] = _checked_event_types(event_types)
    if changes:
        for column, value in changes.items():
            setattr(endpoint, column, value)
        endpoint.updated_at = timezone.now()
        endpoint.save(update_fields=[*changes, "updated_at"])
    return endpoint


def webhook_endpoint_rotate_secret(*, endpoint: WebhookEndpoint, keep_previous: bool = False) -> WebhookEndpoint:
    """A new signing secret; with ``keep_previous`` the old one also signs for 24 hours, else it stops at once."""
    now = timezone.now()
    if keep_previous:
        endpoint.previous_secret = endpoint.secret
        endpoint.previous_secret_expires_at = now + timedelta(seconds=PREVIOUS_SECRET_SECONDS)
    else:
        endpoint.previous_secret, endpoint.previous_secret_expires_at = "", None
    endpoint.secret = new_signing_secret()
    endpoint.updated_at = now
    endpoint.save(update_fields=["secret", "previous_secret", "previous_secret_expires_at", "updated_at"])
    return endpoint


def webhook_endpoint_delete(*, endpoint: WebhookEndpoint) -> None:
    """Delete the endpoint and its deliveries, pending ones included: nothing is sent to it any more."""
    with transaction.atomic():
        WebhookDelivery.objects.filter(endpoint_id=endpoint.pk).delete()
        WebhookEndpoint.objects.filter(pk=endpoint.pk).delete()


def webhook_endpoint_test(*, endpoint: WebhookEndpoint, event_type: str) -> int:
    """Send one sample event of ``event_type`` to the endpoint now, as a delivery would be sent; the HTTP status
    it answered.

    The sample names a response and a task that do not exist (fresh ids), is
    signed with the endpoint's secrets and checked against the target rule
    like a delivery, and is neither stored nor retried. An answer of any
    status is an outcome; none at all (a refused target, the network, the
    timeout) raises ``WebhookTestFailed``. It blocks for at most 3 x
    LMSP_WEBHOOK_TIMEOUT_SECONDS (the attempt's bound).
    """
    if event_type not in EVENT_TYPES:
        message = f"{event_type!r} is not a supported event type (supported: {', '.join(EVENT_TYPES)})"
        raise InvalidRequest(f"event_type: {message}", errors=[{"field": "event_type", "message": message}])
    now = timezone.now()
    sample: TaskEnd | BatchEnd = TaskEnd(
        task_id=new_task_id(), response_id=new_response_id(), client_id=endpoint.client_id, event_type=event_type
    )
    if event_type in BATCH_EVENT_TYPES:
        sample = BatchEnd(batch_id=new_batch_id(), client_id=endpoint.client_id, event_type=event_type)
    webhook_id = new_webhook_delivery_id()
    outcome = webhook_post(
        url=endpoint.url,
        webhook_id=webhook_id,
        payload=webhook_event_payload(event_id=new_webhook_event_id(), end=sample, now=now),
        secrets=signing_secrets(endpoint, now),
        timeout=settings.LMSP_WEBHOOK_TIMEOUT_SECONDS,
        allow_private=settings.LMSP_WEBHOOK_ALLOW_PRIVATE_TARGETS,
    )
    answer = f"HTTP {outcome.status_code}" if outcome.status_code is not None else outcome.error
    logger.info("webhook test %s (%s) to endpoint %s: %s", webhook_id, event_type, endpoint.pk, answer)
    if outcome.status_code is None:
        raise WebhookTestFailed(f"the test event got no answer from the endpoint's URL: {outcome.error}")
    return outcome.status_code


def signing_secrets(endpoint: WebhookEndpoint, now: datetime) -> tuple[str, ...]:
    """The secrets that sign for ``endpoint`` at ``now``: its own, and a rotated-out one still in force."""
    expires = endpoint.previous_secret_expires_at
    if endpoint.previous_secret and expires is not None and expires > now:
        return (endpoint.secret, endpoint.previous_secret)
    return (endpoint.secret,)
