"""Getting task ids to workers: dispatch after commit, and the sweeper.

The broker is a hint, the database decides: a message carries only a task id,
and a worker runs it only if its compare-and-set ``queued -> loading`` wins.
So sending a message twice is harmless, and losing one is repaired by the
sweeper, which re-sends every waiting task that has no dispatch marker, or a
marker but no message on the broker (``tasks_app.plumbing.broker`` has the markers
and the messages).
"""

from __future__ import annotations

import logging
import time
from datetime import datetime, timedelta
from functools import partial

import redis
from django.conf import settings
from django.db import transaction
from django.db.models import Q
from django.utils import timezone

from tasks_app import states
from tasks_app.models import Task
from tasks_app.plumbing import broker, dispatch_sender
from tasks_app.plumbing.affinity import affinity_route
from tasks_app.plumbing.querying import status_in
from tasks_app.states import TaskStatus

logger = logging.getLogger(__name__)

# Checked per sweep, at most; the rest waits for the next sweep.
SWEEP_BATCH = 500


def task_dispatch(*, task_id: str, prefer_worker: str = "", conversation: str = "") -> bool:
    """Send one task id to the workers' queue; False (logged) when the broker is unreachable.

    ``prefer_worker``: the worker (``<node>/<pid>``) whose node should run it if it is alive and has room
    (it ran the response this one continues), else the node that last ran its ``conversation``
    (``tasks_app.plumbing.affinity``).
    The marker is set before the send: a worker may take the message at once
    and clear it, and a marker set after that would vouch for a message that
    is gone (the sweeper verifies markers against the broker too).
    """
    broker.dispatch_marker_set(task_id=task_id)
    try:
        broker.run_message_send(task_id=task_id, queue=affinity_route(worker=prefer_worker, conversation=conversation))
    except broker.UNREACHABLE as exc:
        broker.dispatch_marker_clear(task_id=task_id)
        logger.warning("could not dispatch task %s (the sweeper will retry): %s", task_id, exc)
        return False
    return True


def task_dispatch_on_commit(*, task_id: str, prefer_worker: str = "", conversation: str = "") -> None:
    """Dispatch once the current transaction commits: a worker must find the row.

    In a web process the send is handed to its background sender
    (``tasks_app.plumbing.dispatch_sender``), so the ``202`` never waits for Redis;
    elsewhere it is made inline. ``prefer_worker`` and ``conversation`` as for :func:`task_dispatch`.
    """
    transaction.on_commit(
        partial(_dispatch_committed, task_id=task_id, prefer_worker=prefer_worker, conversation=conversation)
    )


def _dispatch_committed(*, task_id: str, prefer_worker: str, conversation: str) -> None:
    route = {"prefer_worker": prefer_worker, "conversation": conversation}
    if not dispatch_sender.dispatch_sender_submit(task_id=task_id, **route):
        task_dispatch(task_id=task_id, **route)


def queued_tasks_sweep(*, grace_seconds: int | None = None, budget_seconds: float | None = None) -> list[str]:
    """Re-dispatch waiting tasks older than the grace period that no message vouches for.

    Waiting means queued, or left by recovery without a worker to be resumed
    (``running``/``cancelling`` with an empty ``worker``). Returns the ids
    sent. The grace period keeps the sweeper from racing the dispatch that
    follows a task's creation or recovery. Pages of ``SWEEP_BATCH`` are
    swept, oldest first, until the budget is spent, so a backlog (a large
    recovery) drains over a few rounds without holding up the other jobs.
    """
    grace = settings.LMSP_SWEEP_GRACE_SECONDS if grace_seconds is None else grace_seconds
    budget = settings.LMSP_SWEEP_BUDGET_SECONDS if budget_seconds is None else budget_seconds
    deadline = time.monotonic() + budget
    cutoff = timezone.now() - timedelta(seconds=grace)
    sent: list[str] = []
    after = ""
    while True:
        candidates = _sweep_candidates(cutoff, after)
        if not candidates:
            break
        page_sent = _sweep_page(candidates, deadline)
        if page_sent is None:
            break
        sent += page_sent
        if len(candidates) < SWEEP_BATCH or time.monotonic() >= deadline:
            break
        after = candidates[-1]
    if sent:
        logger.info("sweeper re-dispatched %d waiting task(s): %s", len(sent), ", ".join(sent[:10]))
    return sent


def _sweep_candidates(cutoff: datetime, after: str) -> list[str]:
    # The statuses stand on their own (not only inside the OR) so that SQLite
    # reads them through the partial index of unfinished tasks.
    waiting = status_in([TaskStatus.QUEUED, *states.ORPHANABLE])
    unheld = Q(status=TaskStatus.QUEUED) | Q(worker="")
    return list(
        Task.objects.filter(waiting, unheld, updated_at__lte=cutoff, id__gt=after)
        .order_by("id")
        .values_list("id", flat=True)[:SWEEP_BATCH]
    )


def _sweep_page(candidates: list[str], deadline: float) -> list[str] | None:
    """Send those with no message until the deadline; None when Redis cannot be reached.

    A marker only says that a message was sent: those of the page are checked
    against the broker (one read), and a marked task whose message is in
    neither the queue nor a worker's hands is sent again.
    """
    try:
        marked = broker.dispatch_markers_present(task_ids=candidates)
    except redis.RedisError as exc:
        logger.warning("sweeper cannot reach Redis: %s", exc)
        return None
    gone = _markers_without_message([task_id for task_id, has in zip(candidates, marked, strict=True) if has])
    sent = []
    for task_id, has in zip(candidates, marked, strict=True):
        if has and task_id not in gone:
            continue
        if time.monotonic() >= deadline or not task_dispatch(task_id=task_id):
            break
        sent.append(task_id)
    return sent


def _markers_without_message(marked: list[str]) -> set[str]:
    if not marked:
        return set()
    found = broker.run_messages_find()
    if found is None or not found.complete:
        # No broker to read, or a queue longer than one read: the markers are trusted (their TTL bounds them).
        return set()
    gone = {task_id for task_id in marked if task_id not in found.task_ids}
    if gone:
        logger.warning(
            "sweeper: %d task(s) marked as dispatched have no message on the broker (lost); sending again: %s",
            len(gone),
            ", ".join(sorted(gone)[:10]),
        )
    return gone
