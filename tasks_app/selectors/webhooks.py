"""Reads of webhook endpoints and deliveries (docs/webhooks.md).

Endpoints are strictly per client, ``admin`` scope included: an endpoint
holds its signing secret, so no client sees or changes another's; another
client's id is ``404 webhook_endpoint_not_found``, never 403.
"""

from __future__ import annotations

from django.db.models import F, QuerySet
from django.db.models.expressions import RawSQL
from django.db.models.lookups import Exact

from tasks_app.exceptions import WebhookEndpointNotFound
from tasks_app.models import Client, WebhookDelivery, WebhookDeliveryStatus, WebhookEndpoint
from tasks_app.selectors.tasks import Page


def webhook_endpoint_get_own(*, client: Client, endpoint_id: str) -> WebhookEndpoint:
    endpoint = WebhookEndpoint.objects.filter(pk=endpoint_id, client=client).first()
    if endpoint is None:
        raise WebhookEndpointNotFound(f"No webhook endpoint with id {endpoint_id!r}")
    return endpoint


def webhook_endpoint_list_own(*, client: Client, after: str | None, limit: int) -> Page:
    """Newest first (ids are ULIDs); ``after`` is the last id of the previous page."""
    rows = WebhookEndpoint.objects.filter(client=client)
    if after:
        rows = rows.filter(id__lt=after)
    found = list(rows.order_by("-id")[: limit + 1])
    return Page(items=found[:limit], has_more=len(found) > limit)


def webhook_deliveries_pending() -> QuerySet[WebhookDelivery]:
    """Pending deliveries, filtered so that the poll reads the partial index ``webhook_delivery_due``.

    ``status = 'pending'`` with the value written out: SQLite reads through a
    partial index only when the query spells out the index's own condition,
    and a bound parameter hides the value from it (``tasks_app.plumbing.querying``
    explains); the poll would otherwise scan every delivery kept.
    """
    # A constant of the enum, never a caller's string.
    pending = RawSQL(f"'{WebhookDeliveryStatus.PENDING.value}'", ())
    return WebhookDelivery.objects.filter(Exact(F("status"), pending))
