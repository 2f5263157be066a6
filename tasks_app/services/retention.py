"""Retention cleanup (PROFILE.md section 8, persistence 11.2).

Finished tasks, their responses, snapshots and events are kept for a
configurable time; events may go first (the task stays readable and its
events answer ``410 event_history_expired``). Expired idempotency keys and
pairing codes go too, and webhook deliveries that were delivered or given up
``LMSP_WEBHOOK_RETENTION_SECONDS`` after their last attempt (a pending one
stays, whatever its age: it is still to be sent).

Chapter 11.2 forbids deleting unfinished tasks during cleanup, so every
statement here that deletes a task or an event carries ``status IN
(terminal)`` itself: a task that is still queued, loading, running or
cancelling cannot match, whatever its timestamps say. A terminal task never
changes again, so its ``updated_at`` is the time it finished.

Work is done in bounded batches: select at most ``batch_size`` primary keys,
delete those in one short transaction, repeat until a batch comes back short.
On SQLite a transaction holds the only writer lock (IMMEDIATE mode), so one
long transaction around everything would stall every worker and request for
as long as the cleanup runs; on PostgreSQL it would hold row locks and bloat
for as long. The selects run outside the transactions, and each delete
repeats the select's conditions, so a row that changed in between is left
alone rather than deleted on stale information.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from django.conf import settings
from django.db import transaction
from django.db.models import Q, QuerySet
from django.utils import timezone

from tasks_app import states
from tasks_app.exceptions import DatabaseBusy
from tasks_app.models import (
    Conversation,
    ConversationItem,
    IdempotencyKey,
    PairingCode,
    Response,
    Task,
    TaskEvent,
    TaskSnapshot,
    WebhookDelivery,
    WebhookDeliveryStatus,
)
from tasks_app.plumbing.db_locks import busy_as_unavailable, lock_wait
from tasks_app.plumbing.querying import status_in
from tasks_app.services.files import file_bytes_remove, files_expire
from tasks_app.services.workers import worker_nodes_forget
from tasks_app.states import RESPONSE_UNFINISHED

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class CleanupSummary:
    """How many rows one cleanup run deleted, per table."""

    events: int = 0
    tasks: int = 0
    responses: int = 0
    snapshots: int = 0
    idempotency_keys: int = 0
    pairing_codes: int = 0
    webhook_deliveries: int = 0
    conversations: int = 0
    files: int = 0

    @property
    def total(self) -> int:
        return (
            self.events
            + self.tasks
            + self.responses
            + self.snapshots
            + self.idempotency_keys
            + self.pairing_codes
            + self.webhook_deliveries
            + self.conversations
            + self.files
        )

    def describe(self) -> str:
        """One readable line, always naming every category in the same order."""

        def count(n: int, singular: str, plural: str) -> str:
            return f"{n} {singular if n == 1 else plural}"

        return (
            f"deleted {count(self.events, 'event', 'events')}, "
            f"{count(self.tasks, 'task', 'tasks')} "
            f"({count(self.responses, 'response', 'responses')}, {count(self.snapshots, 'snapshot', 'snapshots')}), "
            f"{count(self.idempotency_keys, 'idempotency key', 'idempotency keys')}, "
            f"{count(self.pairing_codes, 'pairing code', 'pairing codes')}, "
            f"{count(self.webhook_deliveries, 'webhook delivery', 'webhook deliveries')}, "
            f"{count(self.conversations, 'conversation', 'conversations')}, "
            f"{count(self.files, 'file', 'files')}"
        )


def retention_cleanup(*, now: datetime | None = None, batch_size: int | None = None) -> CleanupSummary:
    """Delete what has outlived its retention; never an unfinished task or its events.

    ``now`` (aware) is the reference time, ``batch_size`` the most rows one
    transaction deletes (default ``LMSP_CLEANUP_BATCH_SIZE``). Safe to run
    concurrently with the service and with another cleanup.
    """
    now = timezone.now() if now is None else now
    if timezone.is_naive(now):
        raise ValueError("retention_cleanup needs an aware datetime for now")
    size = settings.LMSP_CLEANUP_BATCH_SIZE if batch_size is None else batch_size
    if size < 1:
        raise ValueError(f"batch_size must be at least 1, got {size}")

    event_retention = timedelta(seconds=settings.LMSP_EVENT_RETENTION_SECONDS)
    task_retention = timedelta(seconds=settings.LMSP_TASK_RETENTION_SECONDS)
    # A task about to be deleted loses its events first, in event batches,
    # even if events were configured to outlive tasks: the task delete then
    # cascades to no (or hardly any) event rows instead of thousands at once.
    events_cutoff = now - min(event_retention, task_retention)
    tasks_cutoff = now - task_retention

    events = tasks = responses = snapshots = cascaded_events = idempotency_keys = pairing_codes = deliveries = 0
    conversations = files = 0
    deliveries_cutoff = now - timedelta(seconds=settings.LMSP_WEBHOOK_RETENTION_SECONDS)
    ended_deliveries = [WebhookDeliveryStatus.DELIVERED, WebhookDeliveryStatus.FAILED]
    # A writer frozen inside its transaction (SQLite: the write lock) is not waited on for long: what
    # is left is deleted next round.
    try:
        with lock_wait(settings.LMSP_MAINTENANCE_LOCK_TIMEOUT_SECONDS), busy_as_unavailable():
            events = _delete_events(cutoff=events_cutoff, size=size)
            tasks, responses, snapshots, cascaded_events = _delete_tasks(cutoff=tasks_cutoff, size=size)
            idempotency_keys = _delete_in_batches(
                select=lambda: IdempotencyKey.objects.filter(expires_at__lte=now),
                delete=lambda pks: IdempotencyKey.objects.filter(pk__in=pks, expires_at__lte=now).delete()[0],
                size=size,
            )
            # Used codes too: once expired, a code can never be redeemed, and the
            # client it created keeps its own row.
            pairing_codes = _delete_in_batches(
                select=lambda: PairingCode.objects.filter(expires_at__lte=now),
                delete=lambda pks: PairingCode.objects.filter(pk__in=pks, expires_at__lte=now).delete()[0],
                size=size,
            )
            ended = Q(status__in=ended_deliveries, last_attempt_at__lt=deliveries_cutoff)
            deliveries = _delete_in_batches(
                select=lambda: WebhookDelivery.objects.filter(ended),
                delete=lambda pks: WebhookDelivery.objects.filter(ended, pk__in=pks).delete()[0],
                size=size,
            )
            conversations = _delete_idle_conversations(now=now, size=size)
            while expired := files_expire(now=now, size=size):
                file_bytes_remove(expired)
                files += len(expired)
            # A handful of rows, one per node: the admin's workers page forgets a node gone this long.
            worker_nodes_forget(before=now - timedelta(seconds=settings.LMSP_WORKER_NODE_RETENTION_SECONDS))
    except DatabaseBusy:
        logger.warning("retention cleanup: the database is locked by another writer; the rest waits for next round")
    summary = CleanupSummary(
        events=events + cascaded_events,
        tasks=tasks,
        responses=responses,
        snapshots=snapshots,
        idempotency_keys=idempotency_keys,
        pairing_codes=pairing_codes,
        webhook_deliveries=deliveries,
        conversations=conversations,
        files=files,
    )
    if summary.total:
        logger.info("retention cleanup: %s", summary.describe())
    return summary


def _delete_idle_conversations(*, now: datetime, size: int) -> int:
    """Conversations unchanged for ``LMSP_CONVERSATION_RETENTION_SECONDS`` (0: kept until deleted, as OpenAI keeps
    them), with their items; never one a response is still running on."""
    if settings.LMSP_CONVERSATION_RETENTION_SECONDS <= 0:
        return 0
    cutoff = now - timedelta(seconds=settings.LMSP_CONVERSATION_RETENTION_SECONDS)
    running = Response.objects.filter(status__in=RESPONSE_UNFINISHED).exclude(conversation_id="")
    idle = Q(updated_at__lt=cutoff) & ~Q(pk__in=running.values("conversation_id"))

    def delete(pks: list[Any]) -> int:
        with transaction.atomic():
            gone = list(Conversation.objects.filter(idle, pk__in=pks).values_list("pk", flat=True))
            ConversationItem.objects.filter(conversation_id__in=gone).delete()
            return Conversation.objects.filter(pk__in=gone).delete()[0]

    return _delete_in_batches(select=lambda: Conversation.objects.filter(idle), delete=delete, size=size)


def _delete_in_batches(*, select: Callable[[], QuerySet[Any]], delete: Callable[[list[Any]], int], size: int) -> int:
    """Select up to ``size`` pks, delete them in their own transaction, until a batch is short.

    Each select starts after the last pk of the previous batch (keyset), so a
    run reads past the rows it keeps (events of tasks not yet expired, say)
    once, not again for every batch.
    """
    deleted = 0
    after: Any = None
    while True:
        query = select() if after is None else select().filter(pk__gt=after)
        pks = list(query.order_by("pk").values_list("pk", flat=True)[:size])
        if not pks:
            return deleted
        with transaction.atomic():
            removed = delete(pks)
        deleted += removed
        after = pks[-1]
        # A short batch means nothing is left; a batch that removed nothing
        # means another cleanup took these rows, and looping on them again
        # could go on forever.
        if len(pks) < size or removed == 0:
            return deleted


def _delete_events(*, cutoff: datetime, size: int) -> int:
    """Events of terminal tasks that finished before ``cutoff``.

    Driven by the tasks (the ``task_finished`` index), a chunk of ``size`` at
    a time, and within a chunk by the events' own ``(task, sequence_number)``
    index, ``size`` events per transaction. Selecting expired events straight
    from the events table made PostgreSQL scan and sort the whole table for
    every batch.
    """
    finished = Task.objects.filter(status_in(states.TERMINAL), updated_at__lt=cutoff)
    deleted = 0
    after: tuple[datetime, str] | None = None
    while True:
        chunk = finished
        if after is not None:
            # The range bound on its own lets the index seek past the chunks
            # already done; with only the OR every chunk re-read them all.
            chunk = chunk.filter(updated_at__gte=after[0]).filter(
                Q(updated_at__gt=after[0]) | Q(updated_at=after[0], pk__gt=after[1])
            )
        rows = list(chunk.order_by("updated_at", "pk").values_list("updated_at", "pk")[:size])
        if not rows:
            return deleted
        after = rows[-1]
        task_ids = [pk for _, pk in rows]
        # Repeats the task conditions: a row that changed since it was read is left alone.
        expired = TaskEvent.objects.filter(
            task_id__in=task_ids, task__status__in=states.TERMINAL, task__updated_at__lt=cutoff
        )
        while True:
            pks = list(expired.order_by("task_id", "sequence_number").values_list("pk", flat=True)[:size])
            if not pks:
                break
            with transaction.atomic():
                removed = expired.filter(pk__in=pks).delete()[0]
            deleted += removed
            if len(pks) < size or removed == 0:
                break
        if len(rows) < size:
            return deleted


def _delete_tasks(*, cutoff: datetime, size: int) -> tuple[int, int, int, int]:
    """Terminal tasks that finished before ``cutoff``, with snapshots, events and responses.

    Returns (tasks, responses, snapshots, events) deleted.
    """
    tasks = responses = snapshots = events = 0
    while True:
        rows = list(
            Task.objects.filter(status_in(states.TERMINAL), updated_at__lt=cutoff)
            .order_by("updated_at", "pk")
            .values_list("pk", "response_id")[:size]
        )
        if not rows:
            break
        task_ids = [task_id for task_id, _ in rows]
        response_ids = [response_id for _, response_id in rows]
        with transaction.atomic():
            # Cascades to the task's events and snapshot and sets idempotency
            # keys' task to NULL; the status filter is part of the collector's
            # own select, so only terminal tasks are collected.
            _, by_model = Task.objects.filter(
                pk__in=task_ids, status__in=states.TERMINAL, updated_at__lt=cutoff
            ).delete()
            removed = by_model.get(Task._meta.label, 0)
            # Task.response is PROTECT, so responses go after their tasks; only
            # those no task refers to any more, i.e. whose terminal task was
            # deleted just now (or earlier by another cleanup).
            responses += Response.objects.filter(pk__in=response_ids, task__isnull=True).delete()[0]
        tasks += removed
        snapshots += by_model.get(TaskSnapshot._meta.label, 0)
        events += by_model.get(TaskEvent._meta.label, 0)
        if len(rows) < size or removed == 0:
            break
    return tasks, responses, snapshots, events
