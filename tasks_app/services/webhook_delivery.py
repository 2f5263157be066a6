"""The webhook deliverer (docs/webhooks.md): claim, deliver, record; ``manage.py lmsp_webhooks`` runs it.

- ``webhook_deliveries_run`` claims due deliveries (written by
  ``tasks_app.core.webhook_outbox``) with a compare-and-set lease, sends them
  from a few threads (no database transaction is ever open across a
  request), and records each outcome fenced on its lease: delivered, retried
  after an exponential backoff with jitter, or given up once
  LMSP_WEBHOOK_MAX_AGE_SECONDS passed. A deliverer that dies leaves its
  claims to the next one once their lease expires: at least once, the
  receiver dedupes by ``webhook-id``.
- A commit that makes deliveries due publishes on ``<prefix>:webhooks``
  after it commits; deliverers subscribed to it claim at once. The message
  carries nothing: a lost one (Redis down) costs at most one poll
  (LMSP_WEBHOOK_POLL_SECONDS), never a delivery.
"""

from __future__ import annotations

import logging
import queue
import random
import secrets
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any, TypeVar

from django.conf import settings
from django.db import DatabaseError, close_old_connections
from django.db.models import Q
from django.utils import timezone

from tasks_app.models import WebhookDelivery, WebhookDeliveryStatus
from tasks_app.plumbing.channel_wakeups import ChannelWakeups
from tasks_app.plumbing.database_outages import database_unavailable_noted, one_line
from tasks_app.plumbing.notify import webhooks_channel, webhooks_due_on_commit
from tasks_app.plumbing.webhook_http import AttemptOutcome, webhook_post
from tasks_app.selectors.webhooks import webhook_deliveries_pending
from tasks_app.services.webhooks import signing_secrets

logger = logging.getLogger("tasks_app.webhooks")

D = WebhookDeliveryStatus
T = TypeVar("T")
# Each wait is shortened by up to this share at random, so that retries of many deliveries spread out.
BACKOFF_JITTER = 0.25


# --------------------------------------------------------------------------- #
# Claiming and recording (short statements; never open across an attempt)
# --------------------------------------------------------------------------- #


@dataclass(frozen=True)
class ClaimedDelivery:
    """A delivery this deliverer leased, with what its attempt needs (read when it was claimed)."""

    id: str
    url: str
    payload: str
    event_type: str
    secrets: tuple[str, ...]
    attempts: int
    created_at: datetime
    lease_token: str


def _lease_free(now: datetime) -> Q:
    return Q(lease_expires_at__isnull=True) | Q(lease_expires_at__lt=now)


def webhook_deliveries_claim(*, limit: int) -> list[ClaimedDelivery]:
    """Lease up to ``limit`` due pending deliveries to this caller: a compare-and-set, safe across hosts.

    The ids are read (through the partial index ``webhook_delivery_due``),
    then one UPDATE leases those that are still pending and unleased (or
    whose lease expired) under a token of this claim: a row another deliverer
    leased in between no longer matches, so no two send it at the same time.
    """
    now = timezone.now()
    due = webhook_deliveries_pending().filter(_lease_free(now), next_attempt_at__lte=now)
    ids = list(due.order_by("next_attempt_at").values_list("id", flat=True)[:limit])
    if not ids:
        return []
    token = secrets.token_hex(16)
    lease_until = now + timedelta(seconds=settings.LMSP_WEBHOOK_LEASE_SECONDS)
    WebhookDelivery.objects.filter(_lease_free(now), pk__in=ids, status=D.PENDING).update(
        lease_token=token, lease_expires_at=lease_until
    )
    leased = WebhookDelivery.objects.filter(pk__in=ids, lease_token=token).select_related("endpoint")
    return [
        ClaimedDelivery(
            id=row.id,
            url=row.endpoint.url,
            payload=row.payload,
            event_type=row.event_type,
            secrets=signing_secrets(row.endpoint, now),
            attempts=row.attempts,
            created_at=row.created_at,
            lease_token=token,
        )
        for row in leased.order_by("next_attempt_at")
    ]


def webhook_backoff_seconds(*, attempts: int, rng: Callable[[], float] = random.random) -> float:
    """The wait after the ``attempts``-th failed attempt: BASE x 2^(attempts-1), capped at MAX, less jitter.

    With the defaults 5 s, 10 s, 20 s, ... up to 1 h, each shortened by up
    to a quarter; below the cap each wait is longer than the one before (the
    doubling outgrows the jitter).
    """
    exponent = min(max(attempts - 1, 0), 40)
    full = min(settings.LMSP_WEBHOOK_BACKOFF_MAX_SECONDS, settings.LMSP_WEBHOOK_BACKOFF_BASE_SECONDS * 2**exponent)
    return full * (1 - BACKOFF_JITTER * rng())


def webhook_delivery_record(*, claimed: ClaimedDelivery, outcome: AttemptOutcome) -> WebhookDeliveryStatus | None:
    """Record one attempt, fenced on the claim's lease; None when the lease was lost meanwhile.

    2xx: delivered. Otherwise retried after the backoff, unless that would be
    past LMSP_WEBHOOK_MAX_AGE_SECONDS since the event: then given up (failed).
    """
    now = timezone.now()
    attempts = claimed.attempts + 1
    columns: dict[str, object] = {
        "attempts": attempts,
        "last_attempt_at": now - timedelta(milliseconds=outcome.elapsed_ms),
        "last_status_code": outcome.status_code,
        "last_error": outcome.error,
        "lease_token": "",
        "lease_expires_at": None,
    }
    wait = 0.0
    if outcome.delivered:
        columns |= {"status": D.DELIVERED, "delivered_at": now}
    else:
        wait = webhook_backoff_seconds(attempts=attempts)
        next_at = now + timedelta(seconds=wait)
        deadline = claimed.created_at + timedelta(seconds=settings.LMSP_WEBHOOK_MAX_AGE_SECONDS)
        columns |= {"status": D.FAILED} if next_at > deadline else {"next_attempt_at": next_at}
    status = columns.get("status", D.PENDING)
    written = WebhookDelivery.objects.filter(pk=claimed.id, lease_token=claimed.lease_token).update(**columns)
    _log_attempt(claimed, outcome, attempts, status if written else None, wait)
    return status if written else None


def _log_attempt(
    claimed: ClaimedDelivery,
    outcome: AttemptOutcome,
    attempts: int,
    status: WebhookDeliveryStatus | None,
    wait: float,
) -> None:
    head = f"webhook {claimed.id} ({claimed.event_type}) attempt {attempts} to {claimed.url}"
    answer = f"HTTP {outcome.status_code}" if outcome.status_code is not None else "no answer"
    if status is None:
        logger.warning(
            "%s: %s after %d ms; its lease was lost meanwhile, not recorded", head, answer, outcome.elapsed_ms
        )
    elif status == D.DELIVERED:
        logger.info("%s: delivered (%s) in %d ms", head, answer, outcome.elapsed_ms)
    elif status == D.FAILED:
        logger.warning("%s: failed (%s), given up: %s", head, outcome.error or answer, "past the maximum age")
    else:
        logger.info("%s: failed (%s); next attempt in %.1f s", head, outcome.error or answer, wait)


def webhook_deliveries_retry_now(*, delivery_ids: Iterable[str]) -> int:
    """Due at once (the admin's "retry now"): pending ones, and given-up ones, which become pending again.

    A given-up delivery gets one more attempt: past its maximum age, a
    failure gives it up again.
    """
    rows = WebhookDelivery.objects.filter(pk__in=list(delivery_ids), status__in=[D.PENDING, D.FAILED])
    updated = rows.update(status=D.PENDING, next_attempt_at=timezone.now())
    if updated:
        webhooks_due_on_commit()
    return updated


# --------------------------------------------------------------------------- #
# The deliverer
# --------------------------------------------------------------------------- #


@dataclass
class DeliveryCounts:
    """What a deliverer's run did, by outcome of each attempt recorded."""

    delivered: int = 0
    retrying: int = 0
    failed: int = 0
    lost: int = 0
    by_id: dict[str, WebhookDeliveryStatus | None] = field(default_factory=dict)

    def add(self, delivery_id: str, status: WebhookDeliveryStatus | None) -> None:
        self.by_id[delivery_id] = status
        if status is None:
            self.lost += 1
        elif status == D.DELIVERED:
            self.delivered += 1
        elif status == D.FAILED:
            self.failed += 1
        else:
            self.retrying += 1


def _attempt(claimed: ClaimedDelivery) -> AttemptOutcome:
    return webhook_post(
        url=claimed.url,
        webhook_id=claimed.id,
        payload=claimed.payload,
        secrets=claimed.secrets,
        timeout=settings.LMSP_WEBHOOK_TIMEOUT_SECONDS,
        allow_private=settings.LMSP_WEBHOOK_ALLOW_PRIVATE_TARGETS,
    )


class _Senders:
    """A few daemon threads that make the attempts: HTTP only, no database.

    Daemon threads, so a stopping deliverer abandons attempts still under way
    instead of waiting for them; their leases expire and the next claim sends
    them again (at least once).
    """

    def __init__(self, size: int) -> None:
        self._todo: queue.Queue[ClaimedDelivery | None] = queue.Queue()
        # An attempt that ended, or None: a poke (deliveries are due), which ends the wait with nothing.
        self._done: queue.Queue[tuple[ClaimedDelivery, AttemptOutcome] | None] = queue.Queue()
        self._threads = [threading.Thread(target=self._work, daemon=True, name=f"webhook-{n}") for n in range(size)]
        for thread in self._threads:
            thread.start()

    def _work(self) -> None:
        while (claimed := self._todo.get()) is not None:
            self._done.put((claimed, _attempt(claimed)))

    def submit(self, claimed: ClaimedDelivery) -> None:
        self._todo.put(claimed)

    def poke(self) -> None:
        """End the current wait of :meth:`finished`: deliveries became due."""
        self._done.put(None)

    def finished(self, *, timeout: float, stop: threading.Event) -> list[tuple[ClaimedDelivery, AttemptOutcome]]:
        """The attempts that ended, waiting up to ``timeout`` for the first or a poke (in short slices, to see
        ``stop``)."""
        deadline = timezone.now() + timedelta(seconds=timeout)
        while True:
            try:
                got = [self._done.get(timeout=min(0.05, max(timeout, 0.0)))]
                break
            except queue.Empty:
                if stop.is_set() or timezone.now() >= deadline:
                    return []
        while True:
            try:
                got.append(self._done.get_nowait())
            except queue.Empty:
                return [item for item in got if item is not None]

    def close(self) -> None:
        for _ in self._threads:
            self._todo.put(None)


def _database_step(what: str, step: Callable[..., T], **arguments: Any) -> T | None:
    """One short database step of the loop; a database that is away or busy costs a round, not the process."""
    try:
        return step(**arguments)
    except DatabaseError as error:
        # An outage is logged once by database_outages; anything else, each time.
        if database_unavailable_noted(error) is None:
            logger.warning("webhooks: could not %s (%s); trying again next round", what, one_line(error))
        close_old_connections()
        return None


def webhook_deliveries_run(*, stop: threading.Event | None = None, once: bool = False) -> DeliveryCounts:
    """The deliverer: claim what is due, send it from LMSP_WEBHOOK_CONCURRENCY threads, record each outcome.

    It claims only as many as it has free threads, so a slow receiver holds
    up only its own attempt; when nothing is due it waits for a wake-up
    (``ChannelWakeups``) or LMSP_WEBHOOK_POLL_SECONDS, whichever comes first.
    ``once``: one round (claim what is due now,
    send it, record it) and return. ``stop`` (SIGTERM, SIGINT) ends the loop
    within a poll slice; attempts still under way are abandoned to their
    leases.
    """
    stop = stop or threading.Event()
    size = settings.LMSP_WEBHOOK_CONCURRENCY
    senders = _Senders(size)
    if not once:
        ChannelWakeups(
            channel=webhooks_channel(),
            poke=senders.poke,
            stop=stop,
            name="webhook-wakeups",
            what="webhooks",
            poll_seconds=settings.LMSP_WEBHOOK_POLL_SECONDS,
        )
    in_flight: set[str] = set()
    counts = DeliveryCounts()
    claiming = True
    try:
        while not stop.is_set():
            if claiming and len(in_flight) < size:
                claimed = _database_step("claim", webhook_deliveries_claim, limit=size - len(in_flight))
                for delivery in claimed or []:
                    in_flight.add(delivery.id)
                    senders.submit(delivery)
                claiming = not once
            if once and not in_flight:
                break
            for delivery, outcome in senders.finished(timeout=settings.LMSP_WEBHOOK_POLL_SECONDS, stop=stop):
                in_flight.discard(delivery.id)
                recorded = _database_step("record", webhook_delivery_record, claimed=delivery, outcome=outcome)
                counts.add(delivery.id, recorded)
    finally:
        senders.close()
    return counts
