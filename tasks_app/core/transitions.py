"""The compare-and-set core of the lifecycle: the moves of chapter 7.2 and the one way they are written.

Every verb of ``tasks_app.core.lifecycle`` is a :class:`Write` (its move, its
columns, its events) that :func:`write_apply` (or :func:`writes_apply`, for a
worker's group of batches) runs:

1. ``UPDATE tasks SET status=..., last_sequence=last_sequence+n, ... WHERE
   id=... AND status IN (sources) [AND worker=holder]``;
   the row count says who won, so two writers racing (a cancel and a
   completion, a recovery and a worker) can never both win;
2. the row read back (inside the transaction the row is ours: PostgreSQL's
   row lock, SQLite's write lock), so the numbers are final;
3. if it won: the response row's new state, the events numbered
   ``last_sequence-n+1 .. last_sequence`` (contiguous from 0 per task), the
   snapshot row appended (or the rows dropped when the task finishes or
   starts over), the webhook outbox rows of a task's end, and a wake-up
   published after the commit (``tasks_app.plumbing.notify``).

A part of the lifecycle: only its modules write task state (``tests/test_architecture.py``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from django.db import transaction
from django.db.models import F
from django.db.models.functions import Coalesce
from django.utils import timezone

from tasks_app import events, faults, states
from tasks_app.core.attempt_log import attempt_close_on_end
from tasks_app.core.log_rows import events_insert, snapshot_encoded, snapshots_keep
from tasks_app.core.task_ends import TaskEnded, task_ends_settle
from tasks_app.core.webhook_outbox import TaskEnd, webhook_deliveries_enqueue
from tasks_app.events import Event
from tasks_app.exceptions import TaskNotFound, TransitionNotAllowed
from tasks_app.models import Response, Task, TaskEvent
from tasks_app.plumbing.db_locks import busy_as_unavailable, write_clock
from tasks_app.plumbing.notify import task_changed_on_commit, tasks_changed_on_commit
from tasks_app.states import TaskStatus

S = TaskStatus


@dataclass(frozen=True)
class TransitionResult:
    """What a compare-and-set did: ``won`` is False when another writer moved first."""

    won: bool
    task: Task
    events: tuple[TaskEvent, ...] = ()


@dataclass(frozen=True)
class Move:
    """A verb's move: from one of ``sources`` to ``to`` (None: the status stays)."""

    sources: frozenset[TaskStatus]
    to: TaskStatus | None = None

    def narrowed(self, sources: Iterable[TaskStatus] | None) -> Move:
        """The same move from fewer sources (a caller that knows the status it saw)."""
        if sources is None:
            return self
        chosen = frozenset(TaskStatus(s) for s in sources)
        refused = chosen - self.sources
        if refused or not chosen:
            raise TransitionNotAllowed(f"no move to {self.to or 'the same status'} from {sorted(refused) or 'nowhere'}")
        return Move(chosen, self.to)


# The verbs of chapter 7.2 (recovery's moves, chapter 11.3, are tasks_recover's).
MOVES: Mapping[str, Move] = {
    "task_claim": Move(frozenset({S.QUEUED}), S.LOADING),
    "task_adopt": Move(states.ORPHANABLE),
    "task_start": Move(frozenset({S.LOADING}), S.RUNNING),
    "task_progress": Move(frozenset({S.RUNNING})),
    "task_heartbeat": Move(states.HELD),
    "task_succeed": Move(frozenset({S.RUNNING}), S.SUCCEEDED),
    "task_fail": Move(states.sources_for(S.FAILED), S.FAILED),
    "task_cancel_queued": Move(states.CANCELABLE_AT_ONCE, S.CANCELLED),
    "task_request_cancel": Move(states.CANCELABLE_VIA_BACKEND, S.CANCELLING),
    "task_finish_cancel": Move(frozenset({S.CANCELLING}), S.CANCELLED),
}


def _check_moves(moves: Mapping[str, Move]) -> None:
    # At import: a verb that chapter 7.2 does not allow is a programming error, found at once.
    for name, move in moves.items():
        allowed = states.ACTIVE if move.to is None else states.sources_for(move.to)
        if not move.sources or not move.sources <= allowed:
            raise TransitionNotAllowed(f"{name}: chapter 7.2 has no move {sorted(move.sources)} -> {move.to}")


_check_moves(MOVES)
# For the fault points of tests (tasks_app.faults): the verb a move belongs to.
_VERB_OF: Mapping[Move, str] = {move: name for name, move in MOVES.items()}


@dataclass(frozen=True)
class Write:
    """What one verb writes when its compare-and-set wins."""

    move: Move
    task: Mapping[str, Any] = field(default_factory=dict)
    # Task columns that take the commit's own time (one clock reading with ``updated_at``).
    stamped: tuple[str, ...] = ()
    # None: the response row is neither read nor written (unless an event shows it).
    response: Mapping[str, Any] | None = None
    events: Sequence[Event] = ()
    # The event that shows the response after the move: first (a run opens) or last (the log closes).
    opening: Callable[[Response], Event] | None = None
    closing: Callable[[Response], Event] | None = None
    snapshot: Mapping[str, Any] | None = None
    drop_snapshots: bool = False
    # Fencing: a worker that lost its task (and may still be generating) can no longer write to it.
    holder: str | None = None
    # The write carries output: the attempt's first such write stamps ``first_token_at``.
    output: bool = False

    @property
    def event_count(self) -> int:
        return len(self.events) + (self.opening is not None) + (self.closing is not None)


def write_apply(task_id: str, write: Write) -> TransitionResult:
    """One verb's compare-and-set and, if it won, its writes, in a transaction of its own; the wake-up after it."""
    encoded = _Encoded.of(write)
    # A lock wait that runs out (a frozen writer holds it) is DatabaseBusy: nothing was written.
    with busy_as_unavailable(), transaction.atomic(savepoint=False):
        # Read once the lock is ours (SQLite's BEGIN IMMEDIATE waited for it
        # above), so a commit that waited long still stamps a fresh heartbeat.
        now = timezone.now()
        result = _applied(task_id, write, encoded, now)
        if result.won:
            task_changed_on_commit(result.task.id, result.task.status, result.task.last_sequence)
    return result


def writes_apply(writes: Sequence[tuple[str, Write]]) -> list[TransitionResult | None]:
    """:func:`write_apply` for many tasks in one transaction, each task's compare-and-set on its own.

    A task that lost its compare-and-set writes nothing and the others go on;
    one that does not exist gets None. The rows are written in id order, so
    two groups (or a group and recovery's page) never wait on each other in
    a circle; one wake-up message after the commit carries every change.
    """
    encoded = [_Encoded.of(write) for _, write in writes]
    order = sorted(range(len(writes)), key=lambda index: writes[index][0])
    results: list[TransitionResult | None] = [None] * len(writes)
    with busy_as_unavailable(), transaction.atomic(savepoint=False):
        now = timezone.now()
        for index in order:
            task_id, write = writes[index]
            try:
                results[index] = _applied(task_id, write, encoded[index], now)
            except TaskNotFound:
                continue  # its compare-and-set matched no row: nothing was written for it
        tasks_changed_on_commit(
            [(r.task.id, r.task.status, r.task.last_sequence) for r in results if r is not None and r.won]
        )
    return results


@dataclass(frozen=True)
class _Encoded:
    """A write's events and snapshot row as the database stores them, made before the lock is taken."""

    events: list[events.Encoded]
    snapshot: tuple[str, str] | None

    @classmethod
    def of(cls, write: Write) -> _Encoded:
        # Encoded before the lock: a batch's deltas and snapshot row cost the other writers nothing
        # (bench/write_lock_hold.py).
        return cls([events.encoded(event) for event in write.events], snapshot_encoded(write.snapshot))


def _applied(task_id: str, write: Write, encoded: _Encoded, now: datetime) -> TransitionResult:
    """One task's compare-and-set and, if it won, its writes, inside the caller's transaction."""
    won = _compare_and_set(task_id, write, now)
    if faults.ARMED and won:
        faults.freeze_point(_VERB_OF.get(write.move, ""))
    try:
        task = Task.objects.get(pk=task_id)
    except Task.DoesNotExist:
        raise TaskNotFound(f"task {task_id} does not exist") from None
    if not won:
        return TransitionResult(won=False, task=task)
    specs = list(encoded.events)
    if write.response is not None or write.opening or write.closing:
        # Only moves that change or show the response read it: a batch of
        # deltas need not load the prompt and output it does not touch.
        task.response = response = _response_update(task, write, now)
        if write.opening:
            specs.insert(0, events.encoded(write.opening(response)))
        if write.closing:
            specs.append(events.encoded(write.closing(response)))
    rows = events_insert(task, specs, now)
    snapshots_keep(task, encoded.snapshot, now, drop=write.drop_snapshots)
    if task.status in states.TERMINAL:
        attempt_close_on_end(task, specs[-1].type if specs else None)
        # Every terminal verb closes the log with an event that shows the response, so it was read above.
        task_ends_settle(ends=[TaskEnded(task.id, task.response, task.worker)], now=now)
    if task.notify_webhooks and task.status in states.TERMINAL:
        # The outbox rows commit with the task's end, or neither does (docs/webhooks.md).
        end = TaskEnd(task.id, task.response_id, task.client_id, str(specs[-1].type))
        webhook_deliveries_enqueue(ends=[end], now=now)
    return TransitionResult(won=True, task=task, events=tuple(rows))


def _compare_and_set(task_id: str, write: Write, now: datetime) -> bool:
    clock = write_clock(now)
    columns: dict[str, Any] = {"updated_at": now, **dict.fromkeys(write.stamped, clock), **write.task}
    if write.output:
        # In the same UPDATE: the attempt's first token costs no query of its own.
        columns["first_token_at"] = Coalesce(F("first_token_at"), clock)
    if write.move.to in states.TERMINAL:
        columns["finished_at"] = clock
    if write.event_count:
        columns["last_sequence"] = F("last_sequence") + write.event_count
    if write.move.to is not None:
        columns["status"] = write.move.to
    rows = Task.objects.filter(pk=task_id, status__in=write.move.sources)
    if write.holder is not None:
        rows = rows.filter(worker=write.holder)
    return rows.update(**columns) == 1


def _response_update(task: Task, write: Write, now: datetime) -> Response:
    columns = dict(write.response or {})
    if write.move.to in states.RESPONSE_STATUS:
        columns["status"] = states.RESPONSE_STATUS[write.move.to]
    response = Response.objects.get(pk=task.response_id)
    if columns:
        columns["updated_at"] = now
        Response.objects.filter(pk=response.pk).update(**columns)
        for name, value in columns.items():
            setattr(response, name, value)
    return response
