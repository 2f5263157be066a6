"""Recovery of unfinished tasks: at startup (``lmsp_recover``) and after a worker died (the reaper).

Both apply chapter 11.3's table (``states.RECOVERY``) to tasks no live
worker holds, one task per transaction, each move a compare-and-set on the
status, worker and heartbeat that were read, so a worker that is alive after
all (its heartbeat moved) keeps its task.

Which tasks are leftovers differs:

- At startup, every unfinished task is, except those a live worker of this
  installation reports running (asked over the broker, so that running the
  command while workers live, or restarting only the web process, harms
  nothing) and those claimed after the question was asked. While live
  workers exist, queued tasks wait for them rather than being failed.
- When Celery reports that the pool process running a task died, that one
  task is recovered at once (``lost_task_recover``).
- The reaper takes only held tasks (``loading``, ``running``,
  ``cancelling``) whose heartbeat is older than
  ``LMSP_HEARTBEAT_TIMEOUT_SECONDS``: a live worker writes one at least every
  ``LMSP_HEARTBEAT_SECONDS``.

A task that would run again after it was started ``LMSP_MAX_ATTEMPTS`` times
fails instead, so a prompt that kills its worker cannot take the service down
in a loop.
"""

from __future__ import annotations

import logging
import os
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from django.conf import settings
from django.db import transaction
from django.utils import timezone

from tasks_app import broker, lifecycle, states
from tasks_app.exceptions import ServerRestarted
from tasks_app.models import Task
from tasks_app.querying import status_in
from tasks_app.services.dispatch import task_dispatch_on_commit
from tasks_app.states import RestartPolicy, TaskStatus

logger = logging.getLogger(__name__)

S = TaskStatus
_FIELDS = ("id", "status", "on_restart", "worker", "heartbeat_at", "attempts")

# Summary labels, in the order the command prints them.
FAILED = "failed"
CANCELLED = "cancelled"
REQUEUED = "queued"
RESUMED = "running (to resume)"
LEFT_QUEUED = "left queued"
WAITING = "left waiting to resume"
LIVE = "held by a live worker"
LOST_RACE = "moved on meanwhile"
LABELS = (FAILED, CANCELLED, REQUEUED, RESUMED, LEFT_QUEUED, WAITING, LIVE, LOST_RACE)


@dataclass
class RecoverySummary:
    """How many tasks went where; ``task_ids`` lists them per label."""

    counts: Counter[str] = field(default_factory=Counter)
    task_ids: dict[str, list[str]] = field(default_factory=dict)
    live_workers: tuple[str, ...] = ()

    def add(self, label: str, task_id: str) -> None:
        self.counts[label] += 1
        self.task_ids.setdefault(label, []).append(task_id)

    @property
    def moved(self) -> int:
        return sum(self.counts[label] for label in (FAILED, CANCELLED, REQUEUED, RESUMED))

    def lines(self) -> list[str]:
        return [f"{label}: {self.counts[label]}" for label in LABELS]


@dataclass(frozen=True)
class LiveWorkers:
    """What the live workers of this installation said when asked: their
    names and the ids of the tasks they are running."""

    nodes: frozenset[str]
    task_ids: frozenset[str]
    asked_at: datetime
    silent: frozenset[str] = frozenset()
    """Nodes that consume the queue but did not say in time what they run."""

    def may_hold(self, worker: str) -> bool:
        """True when ``worker`` (``node/pid``) belongs to a live node that did not answer in full."""
        return worker.partition("/")[0] in self.silent


def live_workers_inspect(*, timeout: float | None = None) -> LiveWorkers:
    """Ask every worker on the broker which queues it consumes and what it runs.

    Only workers of this installation's queue count. A broker that cannot be
    reached means no worker can take work either; that is logged and
    answered with no live workers.
    """
    wait = settings.LMSP_RECOVER_INSPECT_SECONDS if timeout is None else timeout
    asked_at = timezone.now()
    try:
        report = broker.workers_ask(timeout=wait)
    except broker.UNREACHABLE as exc:
        logger.warning("could not ask the workers what they run (%s); assuming none is alive", exc)
        return LiveWorkers(frozenset(), frozenset(), asked_at)
    task_ids = frozenset(task_id for running in report.running.values() for task_id in running)
    # A node too slow to list its tasks may still be running one of ours.
    return LiveWorkers(report.nodes, task_ids, asked_at, silent=report.nodes - frozenset(report.running))


def _rows(statuses: tuple[str, ...], batch_size: int, **filters: Any) -> Iterator[dict[str, Any]]:
    """Unfinished tasks in id order, read in chunks (keyset pagination on the partial index)."""
    after = ""
    while True:
        chunk = list(
            Task.objects.filter(status_in(statuses), id__gt=after, **filters)
            .order_by("id")
            .values(*_FIELDS)[:batch_size]
        )
        yield from chunk
        if len(chunk) < batch_size:
            return
        after = chunk[-1]["id"]


def _problem(found: str, reason: str, *, attempts_left: bool) -> dict[str, Any]:
    if not attempts_left:
        detail = (
            f"The task was {found} when {reason}, and it has been started "
            f"{settings.LMSP_MAX_ATTEMPTS} times already; it is not run again"
        )
    else:
        detail = f"The task was {found} when {reason}"
    return ServerRestarted(detail).to_problem()


def _move(row: dict[str, Any], *, reason: str, summary: RecoverySummary) -> None:
    """Apply the table to one task, in its own transaction."""
    found = TaskStatus(row["status"])
    target = states.recovery_target(found, RestartPolicy(row["on_restart"]))
    runs_again = target in states.RUNS_AGAIN and found != S.QUEUED
    attempts_left = row["attempts"] < settings.LMSP_MAX_ATTEMPTS
    if runs_again and not attempts_left:
        target = S.FAILED
    if found == S.RUNNING and target == S.RUNNING and row["worker"] == "":
        # Already waiting for a worker to adopt it: only send it again.
        task_dispatch_on_commit(task_id=row["id"])
        summary.add(WAITING, row["id"])
        return
    with transaction.atomic():
        result = lifecycle.task_recover(
            task_id=row["id"],
            found=found,
            to=target,
            worker=row["worker"],
            heartbeat_at=row["heartbeat_at"],
            error=_problem(found, reason, attempts_left=attempts_left) if target == S.FAILED else None,
        )
        if not result.won:
            summary.add(LOST_RACE, row["id"])
            return
        if target in states.RUNS_AGAIN:
            task_dispatch_on_commit(task_id=row["id"])
    label = {S.FAILED: FAILED, S.CANCELLED: CANCELLED, S.QUEUED: REQUEUED, S.RUNNING: RESUMED}[target]
    if found == S.QUEUED and target == S.QUEUED:
        label = LEFT_QUEUED
    summary.add(label, row["id"])
    logger.info("recovered task %s: %s -> %s (%s, %s)", row["id"], found, target, row["on_restart"], reason)


def leftover_tasks_recover(*, live: LiveWorkers, batch_size: int = 500) -> RecoverySummary:
    """Startup recovery: apply chapter 11.3 to every unfinished task no live worker holds."""
    summary = RecoverySummary(live_workers=tuple(sorted(live.nodes)))
    for row in _rows(states.in_declaration_order(states.ACTIVE), batch_size):
        found = row["status"]
        if found == S.QUEUED:
            if live.nodes:
                # Waiting in a live queue is not being left over.
                summary.add(LEFT_QUEUED, row["id"])
                continue
        elif (
            row["id"] in live.task_ids
            or live.may_hold(row["worker"])
            or (row["heartbeat_at"] is not None and row["heartbeat_at"] >= live.asked_at)
        ):
            # Running on a live worker (or perhaps, on one that did not answer
            # in time: the reaper decides later), or claimed after we asked.
            summary.add(LIVE, row["id"])
            continue
        elif live.nodes and row["worker"] == "" and found == S.RUNNING:
            # Waiting to be adopted by the live workers: the sweeper re-sends it.
            summary.add(LIVE, row["id"])
            continue
        _move(row, reason="the service restarted", summary=summary)
    return summary


def lost_task_recover(*, task_id: str, node: str) -> RecoverySummary:
    """A pool process of worker ``node`` died while running ``task_id``: apply the table now.

    Celery's parent process learns of the death at once (WorkerLostError);
    without this the task would wait for the reaper's heartbeat timeout. Only
    a task still held by a process of ``node`` that no longer exists is moved,
    with the same compare-and-set as every recovery.
    """
    summary = RecoverySummary()
    row = (
        Task.objects.filter(pk=task_id, status__in=states.HELD, worker__startswith=f"{node}/").values(*_FIELDS).first()
    )
    if row is None or _process_alive(row["worker"].rpartition("/")[2]):
        return summary
    _move(row, reason=f"its worker process {row['worker']} died", summary=summary)
    return summary


def _process_alive(pid: str) -> bool:
    try:
        os.kill(int(pid), 0)
    except (ValueError, ProcessLookupError):
        return False
    except PermissionError:
        return True
    return True


def abandoned_tasks_reap(
    *, timeout_seconds: int | None = None, now: datetime | None = None, batch_size: int = 500
) -> RecoverySummary:
    """The reaper: apply chapter 11.3 to held tasks whose worker stopped writing heartbeats."""
    timeout = settings.LMSP_HEARTBEAT_TIMEOUT_SECONDS if timeout_seconds is None else timeout_seconds
    cutoff = (now or timezone.now()) - timedelta(seconds=timeout)
    summary = RecoverySummary()
    held = states.in_declaration_order(states.HELD)
    # Orphans (no worker) have no heartbeat, so the filter leaves them to the sweeper.
    for row in _rows(held, batch_size, heartbeat_at__lt=cutoff):
        _move(row, reason=f"its worker {row['worker']} stopped reporting", summary=summary)
    if summary.moved:
        logger.warning("reaper: %s", ", ".join(summary.lines()))
    return summary
