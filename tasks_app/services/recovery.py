"""Recovery of unfinished tasks: at startup (``lmsp_recover``) and after a worker died (the reaper).

Both apply chapter 11.3's table (``states.RECOVERY``) to tasks no live
worker holds, a page of tasks per transaction (``lifecycle.tasks_recover``),
each move a compare-and-set on the status, worker and heartbeat that were
read, so a worker that is alive after all (its heartbeat moved) keeps its
task. A crash in the middle leaves every task moved with its event or
untouched; running it again moves only what is left.

No round waits long on a lock a frozen writer holds: each page waits at most
``LMSP_MAINTENANCE_LOCK_TIMEOUT_SECONDS``; PostgreSQL skips the locked rows,
SQLite (one lock for all) gives up the page, and the next round (the
reaper's) or the next try (startup's) takes them.

Tasks that run again are dispatched after their page commits, for at most
``LMSP_RECOVER_DISPATCH_SECONDS`` in all; the sweeper sends the rest (a
message is only a hint; the task is already durable and queued).

Which tasks are leftovers differs:

- At startup, every unfinished task is, except those a live worker of this
  installation reports running (asked over the broker, so that running the
  command while workers live, or restarting only the web process, harms
  nothing) and those claimed after the question was asked. While live
  workers exist, queued tasks wait for them rather than being failed.
- When Celery reports that the pool process running a task died, that one
  task is recovered at once (``lost_task_recover``).
- When a worker process stops running a task it still holds (a SIGTERM
  drain that ran out of time: the threads pool loses no process, so nobody
  else would notice before the reaper), it hands the task back itself
  (``held_task_release``).
- The reaper takes only held tasks (``loading``, ``running``,
  ``cancelling``) whose heartbeat is older than
  ``LMSP_HEARTBEAT_TIMEOUT_SECONDS``: a live worker writes one at least every
  ``LMSP_HEARTBEAT_SECONDS``.

A task that would run again after it was started ``LMSP_MAX_ATTEMPTS`` times
fails instead, so a prompt that kills its worker cannot take the service down
in a loop.
"""

from __future__ import annotations

import functools
import logging
import os
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from django.conf import settings
from django.utils import timezone

from tasks_app import states
from tasks_app.core import lifecycle
from tasks_app.core.lifecycle import RecoveryMove
from tasks_app.exceptions import DatabaseBusy, ServerRestarted, TaskNotHandedBack
from tasks_app.metrics.counters import recovery_error_count
from tasks_app.models import Task
from tasks_app.plumbing import broker
from tasks_app.plumbing.db_locks import is_database_unavailable, lock_wait, stale_before
from tasks_app.plumbing.querying import status_in
from tasks_app.services.dispatch import task_dispatch
from tasks_app.states import AttemptEnd, RestartPolicy, TaskStatus

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
BUSY = "locked by another writer (next round)"
RAISED = "could not be recovered (next round)"
LABELS = (FAILED, CANCELLED, REQUEUED, RESUMED, LEFT_QUEUED, WAITING, LIVE, LOST_RACE, BUSY, RAISED)
_MOVED_LABEL = {S.FAILED: FAILED, S.CANCELLED: CANCELLED, S.QUEUED: REQUEUED, S.RUNNING: RESUMED}

# A startup page the write lock was not granted for is tried again this often (SQLite: a frozen writer).
STARTUP_PAGE_TRIES = 10
# A hand-back reads and moves its task at most this often (its own heartbeat
# may move in between), and waits for the lock this often: a stopping worker
# has its stop grace period to spend, not the whole of startup's patience.
RELEASE_TRIES = 3


@dataclass
class RecoverySummary:
    """How many tasks went where; ``task_ids`` lists them per label."""

    counts: Counter[str] = field(default_factory=Counter)
    task_ids: dict[str, list[str]] = field(default_factory=dict)
    live_workers: tuple[str, ...] = ()
    dispatched: int = 0
    """Tasks that run again and were sent to the workers; the sweeper sends the others."""
    to_dispatch: list[str] = field(default_factory=list)

    def add(self, label: str, task_id: str) -> None:
        self.counts[label] += 1
        self.task_ids.setdefault(label, []).append(task_id)

    @property
    def moved(self) -> int:
        return sum(self.counts[label] for label in (FAILED, CANCELLED, REQUEUED, RESUMED))

    def lines(self) -> list[str]:
        lines = [f"{label}: {self.counts[label]}" for label in LABELS]
        left = len(self.to_dispatch) - self.dispatched
        if left:
            lines.append(f"left for the sweeper to dispatch: {left}")
        return lines


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


def _pages(statuses: tuple[str, ...], batch_size: int, **filters: Any) -> Iterator[list[dict[str, Any]]]:
    """Unfinished tasks in id order, a page at a time (keyset pagination on the partial index)."""
    after = ""
    while True:
        page = list(
            Task.objects.filter(status_in(statuses), id__gt=after, **filters)
            .order_by("id")
            .values(*_FIELDS)[:batch_size]
        )
        if page:
            yield page
        if len(page) < batch_size:
            return
        after = page[-1]["id"]


@functools.lru_cache(maxsize=256)
def _problem(found: str, reason: str, *, attempts_left: bool, max_attempts: int) -> dict[str, Any]:
    if not attempts_left:
        detail = (
            f"The task was {found} when {reason}, and it has been started "
            f"{max_attempts} times already; it is not run again"
        )
    else:
        detail = f"The task was {found} when {reason}"
    return ServerRestarted(detail).to_problem()


# How an attempt that each kind of recovery lets go of ended (its row in the attempt log).
_ATTEMPT_END: dict[str, AttemptEnd] = {
    "startup": AttemptEnd.RECOVERED,
    "pool_process_lost": AttemptEnd.WORKER_DIED,
    "hand_back": AttemptEnd.HANDED_BACK,
    "reaper": AttemptEnd.REAPED,
    "operator": AttemptEnd.OPERATOR,
}


def _plan(row: dict[str, Any], *, reason: str, source: str = "startup") -> RecoveryMove | None:
    """The table's move for one task (None: already waiting to be adopted, only send it again)."""
    found = TaskStatus(row["status"])
    target = states.recovery_target(found, RestartPolicy(row["on_restart"]))
    runs_again = target in states.RUNS_AGAIN and found != S.QUEUED
    attempts_left = row["attempts"] < settings.LMSP_MAX_ATTEMPTS
    if runs_again and not attempts_left:
        target = S.FAILED
    if found == S.RUNNING and target == S.RUNNING and row["worker"] == "":
        return None
    # The same few problems for a whole run (cached): only the found status and the reason vary.
    error = None
    if target == S.FAILED:
        error = _problem(str(found), reason, attempts_left=attempts_left, max_attempts=settings.LMSP_MAX_ATTEMPTS)
    end = _ATTEMPT_END[source]
    return RecoveryMove(row["id"], found, target, row["worker"], row["heartbeat_at"], error, end, reason)


def _recover_page(
    rows: list[dict[str, Any]],
    *,
    reason: Callable[[dict[str, Any]], str],
    summary: RecoverySummary,
    source: str,
    tries: int = 1,
) -> bool:
    """Move one page in one transaction; False when its lock was not granted (the round stops there).

    A page whose transaction raises (anything but a lock wait or a database
    that cannot be reached, which stop the round) is moved again one task per
    transaction, so that one task whose recovery raises is logged, counted and
    left for the next round while every other task of the page still moves.
    """
    moves = []
    for row in rows:
        move = _plan(row, reason=reason(row), source=source)
        if move is None:
            summary.add(WAITING, row["id"])
            summary.to_dispatch.append(row["id"])
        elif move.found == S.QUEUED and move.to == S.QUEUED:
            # Nothing to write: it waits as it did, and is only sent again.
            summary.add(LEFT_QUEUED, row["id"])
            summary.to_dispatch.append(row["id"])
        else:
            moves.append(move)
    for attempt in range(tries):
        try:
            batch = _recover_moves(moves)
            break
        except DatabaseBusy:
            logger.warning("recovery: the database is locked by another writer (try %d of %d)", attempt + 1, tries)
        except Exception as exc:
            if is_database_unavailable(exc):
                raise
            logger.warning("recovery: a page of %d tasks raised (%s); moving them one at a time", len(moves), exc)
            moves, batch = _recover_one_by_one(moves, summary=summary, source=source)
            break
    else:
        for move in moves:
            summary.add(BUSY, move.task_id)
        return False
    _summarize(moves, batch, summary, reason)
    return True


def _recover_moves(moves: list[RecoveryMove]) -> lifecycle.RecoveryBatch:
    with lock_wait(settings.LMSP_MAINTENANCE_LOCK_TIMEOUT_SECONDS):
        return lifecycle.tasks_recover(moves=moves)


def _recover_one_by_one(
    moves: list[RecoveryMove], *, summary: RecoverySummary, source: str
) -> tuple[list[RecoveryMove], lifecycle.RecoveryBatch]:
    """Each move in its own transaction: the moves that did not raise, and what became of them."""
    done: list[RecoveryMove] = []
    won: list[str] = []
    lost: list[str] = []
    busy: list[str] = []
    for move in moves:
        try:
            batch = _recover_moves([move])
        except DatabaseBusy:
            busy.append(move.task_id)
            done.append(move)
            continue
        except Exception as exc:
            if is_database_unavailable(exc):
                raise
            # Its id, its history and the error, for whoever reads the log; the task stays as it was.
            logger.error(
                "recovery of task %s (%s -> %s) raised %s: %s; it stays %s for the next round",
                move.task_id,
                move.found,
                move.to,
                type(exc).__name__,
                exc,
                move.found,
                exc_info=exc,
            )
            summary.add(RAISED, move.task_id)
            recovery_error_count(source=source)
            continue
        done.append(move)
        won += batch.won
        lost += batch.lost
        busy += batch.busy
    return done, lifecycle.RecoveryBatch(won=tuple(won), lost=tuple(lost), busy=tuple(busy))


def _summarize(
    moves: list[RecoveryMove],
    batch: lifecycle.RecoveryBatch,
    summary: RecoverySummary,
    reason: Callable[[dict[str, Any]], str],
) -> None:
    won, busy = set(batch.won), set(batch.busy)
    for move in moves:
        if move.task_id in busy:
            summary.add(BUSY, move.task_id)
            continue
        if move.task_id not in won:
            summary.add(LOST_RACE, move.task_id)
            continue
        left_queued = move.found == S.QUEUED and move.to == S.QUEUED
        summary.add(LEFT_QUEUED if left_queued else _MOVED_LABEL[move.to], move.task_id)
        if move.to in states.RUNS_AGAIN:
            summary.to_dispatch.append(move.task_id)
        if not left_queued:
            logger.debug("recovered task %s: %s -> %s", move.task_id, move.found, move.to)


def _dispatch(summary: RecoverySummary, *, budget_seconds: float) -> None:
    """Send the tasks that run again, oldest first, until the budget is spent."""
    deadline = time.monotonic() + budget_seconds
    for task_id in summary.to_dispatch:
        if time.monotonic() >= deadline or not task_dispatch(task_id=task_id):
            break
        summary.dispatched += 1


def _held_by_live(row: dict[str, Any], live: LiveWorkers) -> bool:
    if row["status"] == S.QUEUED:
        # Waiting in a live queue is not being left over.
        return bool(live.nodes)
    return (
        row["id"] in live.task_ids
        or live.may_hold(row["worker"])
        # Claimed after we asked.
        or (row["heartbeat_at"] is not None and row["heartbeat_at"] >= live.asked_at)
        # Waiting to be adopted by the live workers: the sweeper re-sends it.
        or (bool(live.nodes) and row["worker"] == "" and row["status"] == S.RUNNING)
    )


def leftover_tasks_recover(*, live: LiveWorkers, batch_size: int = 500) -> RecoverySummary:
    """Startup recovery: apply chapter 11.3 to every unfinished task no live worker holds."""
    summary = RecoverySummary(live_workers=tuple(sorted(live.nodes)))
    for page in _pages(states.in_declaration_order(states.ACTIVE), batch_size):
        leftover = []
        for row in page:
            if _held_by_live(row, live):
                summary.add(LEFT_QUEUED if row["status"] == S.QUEUED else LIVE, row["id"])
            else:
                leftover.append(row)
        if not _recover_page(
            leftover,
            reason=lambda row: "the service restarted",
            summary=summary,
            source="startup",
            tries=STARTUP_PAGE_TRIES,
        ):
            break
    _dispatch(summary, budget_seconds=settings.LMSP_RECOVER_DISPATCH_SECONDS)
    _log(summary, "startup recovery")
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
    died = f"its worker process {row['worker']} died"
    _recover_page([row], reason=lambda row: died, summary=summary, source="pool_process_lost")
    _dispatch(summary, budget_seconds=settings.LMSP_RECOVER_DISPATCH_SECONDS)
    _log(summary, f"recovery (its worker process {row['worker']} died)")
    return summary


def held_task_release(*, task_id: str, worker: str, reason: str) -> RecoverySummary:
    """Worker process ``worker`` (``<node>/<pid>``) stops running ``task_id`` unfinished: apply the table now.

    The moves are those of every recovery (``resume``: running without a
    worker, ``retry``: queued, ``fail``: failed with ``server_restarted``;
    attempts counted the same way), and only while the task still names
    exactly ``worker``: a task another worker took over, or one that ended,
    is left alone. ``reason`` completes "The task was running when …" in a
    failed task's error.
    """
    summary = RecoverySummary()
    for _ in range(RELEASE_TRIES):
        row = Task.objects.filter(pk=task_id, status__in=states.HELD, worker=worker).values(*_FIELDS).first()
        if row is None:
            break
        summary = RecoverySummary()
        granted = _recover_page(
            [row], reason=lambda row: reason, summary=summary, source="hand_back", tries=RELEASE_TRIES
        )
        # A lost race may be the caller's own heartbeat, written between the
        # read and the move: read again; a task someone else took is not read.
        if not granted or not summary.counts[LOST_RACE]:
            break
    _dispatch(summary, budget_seconds=settings.LMSP_RECOVER_DISPATCH_SECONDS)
    _log(summary, f"hand-back ({reason})")
    return summary


def _process_alive(pid: str) -> bool:
    try:
        os.kill(int(pid), 0)
    except (ValueError, ProcessLookupError):
        return False
    except PermissionError:
        return True
    return True


def abandoned_tasks_reap(*, timeout_seconds: int | None = None, batch_size: int = 500) -> RecoverySummary:
    """The reaper: apply chapter 11.3 to held tasks whose worker stopped writing heartbeats.

    Staleness is judged on the clock the heartbeats are written with (the
    database's, on PostgreSQL), so a worker on another host, or one whose
    commit waited long for the lock, is not taken for dead.
    """
    timeout = settings.LMSP_HEARTBEAT_TIMEOUT_SECONDS if timeout_seconds is None else timeout_seconds
    summary = RecoverySummary()
    held = states.in_declaration_order(states.HELD)
    # Orphans (no worker) have no heartbeat, so the filter leaves them to the sweeper.
    for page in _pages(held, batch_size, heartbeat_at__lt=stale_before(timeout)):
        granted = _recover_page(
            page, reason=lambda row: f"its worker {row['worker']} stopped reporting", summary=summary, source="reaper"
        )
        if not granted:
            break
    _dispatch(summary, budget_seconds=settings.LMSP_RECOVER_DISPATCH_SECONDS)
    _log(summary, "reaper")
    return summary


def _log(summary: RecoverySummary, what: str) -> None:
    # Quiet when nothing happened: the reaper runs every few seconds.
    if not (summary.moved or summary.counts[BUSY] or summary.counts[RAISED]):
        return
    trouble = summary.counts[BUSY] or summary.counts[RAISED]
    level = logging.WARNING if what == "reaper" or trouble else logging.INFO
    moved = [task_id for label in (FAILED, CANCELLED, REQUEUED, RESUMED) for task_id in summary.task_ids.get(label, ())]
    counts = ", ".join(line for line in summary.lines() if not line.endswith(": 0"))
    more = f" and {len(moved) - 10} more" if len(moved) > 10 else ""
    logger.log(level, "%s: %s (%s%s)", what, counts, ", ".join(moved[:10]), more)


def stuck_task_hand_back(*, task_id: str, operator: str) -> RecoverySummary:
    """An operator hands back now a held task whose worker is silent, instead of waiting for the reaper.

    Refused (``TaskNotHandedBack``, saying why) unless the task is held and its
    heartbeat is older than ``LMSP_HEARTBEAT_SILENT_SECONDS``, and its worker's
    node, asked over the broker, does not say it runs the task (a frozen or
    dead node says nothing). The move is the reaper's: chapter 11.3's cell by
    the task's policy, a compare-and-set on the status, worker and heartbeat
    read here, so a worker that wakes up and writes a heartbeat in between
    keeps its task.
    """
    row = Task.objects.filter(pk=task_id).values(*_FIELDS).first()
    if row is None:
        raise TaskNotHandedBack(f"task {task_id} does not exist")
    worker = row["worker"]
    if row["status"] not in states.HELD or not worker:
        raise TaskNotHandedBack(
            f"task {task_id} is {row['status']} and no worker holds it: there is nothing to hand back"
        )
    silent_after = settings.LMSP_HEARTBEAT_SILENT_SECONDS
    if not Task.objects.filter(pk=task_id, heartbeat_at__lt=stale_before(silent_after)).exists():
        raise TaskNotHandedBack(
            f"its worker {worker} wrote a heartbeat less than {silent_after} s ago: it is alive, and keeps the task"
        )
    live = live_workers_inspect()
    if task_id in live.task_ids or live.may_hold(worker):
        raise TaskNotHandedBack(f"its worker's node {worker.rpartition('/')[0]} answers that it still runs the task")
    reason = f"an operator ({operator}) handed it back, its worker {worker} silent for over {silent_after} s"
    summary = RecoverySummary()
    granted = _recover_page([row], reason=lambda row: reason, summary=summary, source="operator")
    if not granted or summary.counts[BUSY]:
        raise TaskNotHandedBack(
            "its row is locked by another writer (on SQLite the whole database is: a worker frozen inside its "
            "commit holds the lock until it thaws or dies); try again in a moment"
        )
    if not summary.moved:
        raise TaskNotHandedBack(f"task {task_id} moved on meanwhile (its worker wrote a heartbeat, or it ended)")
    _dispatch(summary, budget_seconds=settings.LMSP_RECOVER_DISPATCH_SECONDS)
    _log(summary, f"hand-back by {operator}")
    return summary
