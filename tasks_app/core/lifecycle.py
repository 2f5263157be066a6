"""The one owner of task state: every move a task makes is a named verb here.

Each verb names its sources and target (``MOVES``, checked against chapter
7.2's table in ``tasks_app.states`` when this module loads), sets its own
columns and builds its own events (``tasks_app.core.events``). All of them run
through one private compare-and-set, :func:`_apply`:

1. ``UPDATE tasks SET status=..., last_sequence=last_sequence+n, ... WHERE
   id=... AND status IN (sources) [AND worker=holder]``;
   the row count says who won, so two writers racing (a cancel and a
   completion, a recovery and a worker) can never both win;
2. the row read back (inside the transaction the row is ours: PostgreSQL's
   row lock, SQLite's write lock), so the numbers are final;
3. if it won: the response row's new state, the events numbered
   ``last_sequence-n+1 .. last_sequence`` (contiguous from 0 per task), the
   snapshot row appended (or the rows dropped when the task finishes or
   starts over), and a wake-up published after the commit
   (``tasks_app.plumbing.notify``).

Recovery (chapter 11.3) moves a page of tasks in one transaction,
:func:`tasks_recover`: the same compare-and-set, checked for every task
under its lock, with the same events, snapshots and wake-ups.

Callers learn the outcome from ``TransitionResult.won`` (``RecoveryBatch``);
nothing outside this module writes a task's status, sequence numbers or
events (``tests/test_architecture.py`` checks).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from django.db import connection, transaction
from django.db.models import F
from django.utils import timezone

from tasks_app import faults, states
from tasks_app.core import events, output_items
from tasks_app.core.events import Event
from tasks_app.core.wire import message_item
from tasks_app.exceptions import TaskNotFound, TransitionNotAllowed
from tasks_app.ids import new_response_id, new_task_id
from tasks_app.models import Client, Response, Task, TaskEvent, TaskSnapshot, TaskType
from tasks_app.plumbing.db_locks import busy_as_unavailable, write_clock
from tasks_app.plumbing.notify import task_changed_on_commit, tasks_changed_on_commit
from tasks_app.selectors.tasks import task_outputs_items
from tasks_app.services.webhooks import TaskEnd, webhook_deliveries_enqueue
from tasks_app.states import ResponseStatus, RestartPolicy, TaskStatus

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
class Partial:
    """What a stopped attempt keeps: its output item with the text its committed deltas hold, and its usage.

    A run that may call tools passes its ``items`` (messages and calls as
    committed) instead: the open one is kept ``incomplete``.
    """

    item_id: str
    text: str
    usage: Mapping[str, Any] | None = None
    items: Sequence[output_items.OutputItem] | None = None

    def output(self) -> list[dict[str, Any]]:
        if self.items is not None:
            return output_items.stopped_output(self.items)
        return [message_item(self.item_id, self.text, "incomplete")] if self.text else []


@dataclass(frozen=True)
class _Write:
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

    @property
    def event_count(self) -> int:
        return len(self.events) + (self.opening is not None) + (self.closing is not None)


# --------------------------------------------------------------------------- #
# The compare-and-set core
# --------------------------------------------------------------------------- #


def _apply(task_id: str, write: _Write) -> TransitionResult:
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


def _apply_group(writes: Sequence[tuple[str, _Write]]) -> list[TransitionResult | None]:
    """:func:`_apply` for many tasks in one transaction, each task's compare-and-set on its own.

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
    def of(cls, write: _Write) -> _Encoded:
        # Encoded before the lock: a batch's deltas and snapshot row cost the other writers nothing
        # (bench/write_lock_hold.py).
        return cls([events.encoded(event) for event in write.events], _snapshot_encoded(write.snapshot))


def _applied(task_id: str, write: _Write, encoded: _Encoded, now: datetime) -> TransitionResult:
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
    rows = _events_insert(task, specs, now)
    _snapshots_keep(task, write, encoded.snapshot, now)
    if task.notify_webhooks and task.status in states.TERMINAL:
        # The outbox rows commit with the task's end, or neither does (docs/webhooks.md).
        end = TaskEnd(task.id, task.response_id, task.client_id, str(specs[-1].type))
        webhook_deliveries_enqueue(ends=[end], now=now)
    return TransitionResult(won=True, task=task, events=tuple(rows))


def _compare_and_set(task_id: str, write: _Write, now: datetime) -> bool:
    columns: dict[str, Any] = {"updated_at": now, **dict.fromkeys(write.stamped, write_clock(now)), **write.task}
    if write.event_count:
        columns["last_sequence"] = F("last_sequence") + write.event_count
    if write.move.to is not None:
        columns["status"] = write.move.to
    rows = Task.objects.filter(pk=task_id, status__in=write.move.sources)
    if write.holder is not None:
        rows = rows.filter(worker=write.holder)
    return rows.update(**columns) == 1


def _response_update(task: Task, write: _Write, now: datetime) -> Response:
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


def _events_insert(task: Task, specs: Sequence[events.Encoded], now: datetime) -> list[TaskEvent]:
    """Insert the events numbered up to the task's ``last_sequence``: one multi-row INSERT per 100 events.

    Written out rather than ``bulk_create``: the ORM's per-field preparation
    of every row cost most of a batch commit's time, all of it under the
    write lock (bench/write_lock_hold.py).
    """
    first = task.last_sequence - len(specs) + 1
    rows = [
        TaskEvent(
            task_id=task.id,
            sequence_number=first + offset,
            type=spec.type,
            payload=spec.payload(first + offset),
            created_at=now,
        )
        for offset, spec in enumerate(specs)
    ]
    stamp = connection.ops.adapt_datetimefield_value(now)
    with connection.cursor() as cursor:
        for start in range(0, len(rows), _EVENTS_PER_INSERT):
            chunk = rows[start : start + _EVENTS_PER_INSERT]
            values = ", ".join(["(%s, %s, %s, %s, %s)"] * len(chunk))
            params = [v for row in chunk for v in (row.task_id, row.sequence_number, row.type, row.payload, stamp)]
            cursor.execute(f"{_EVENT_INSERT} {values}", params)
    return rows


_EVENT_INSERT = f"INSERT INTO {TaskEvent._meta.db_table} (task_id, sequence_number, type, payload, created_at) VALUES"
# Rows per statement: 5 parameters a row stays far below SQLite's oldest limit of 999.
_EVENTS_PER_INSERT = 100


def _snapshot_encoded(snapshot: Mapping[str, Any] | None) -> tuple[str, str] | None:
    """A snapshot row's two JSON columns, ``token_ids`` and ``state``, as ``TaskSnapshot`` stores them."""
    if snapshot is None:
        return None
    field = TaskSnapshot._meta.get_field("state")
    return field.get_prep_value(list(snapshot.get("token_ids", ()))), field.get_prep_value(dict(snapshot["state"]))


def _snapshots_keep(task: Task, write: _Write, snapshot: tuple[str, str] | None, now: datetime) -> None:
    if task.status in states.TERMINAL or write.drop_snapshots:
        # A finished task is never resumed; a rerun starts from nothing.
        TaskSnapshot.objects.filter(task_id=task.id).delete()
    elif snapshot is not None:
        # One INSERT per batch: ``token_ids`` are the ids generated since the
        # previous row, ``state`` the small rest (see TaskSnapshot).
        token_ids, state = snapshot
        stamp = connection.ops.adapt_datetimefield_value(now)
        with connection.cursor() as cursor:
            cursor.execute(_SNAPSHOT_INSERT, (task.id, task.last_sequence, token_ids, state, stamp))


_SNAPSHOT_INSERT = (
    f"INSERT INTO {TaskSnapshot._meta.db_table} (task_id, sequence_number, token_ids, state, created_at) "
    "VALUES (%s, %s, %s, %s, %s)"
)


# --------------------------------------------------------------------------- #
# Creation
# --------------------------------------------------------------------------- #


def task_insert(
    *,
    client: Client,
    request: Mapping[str, Any],
    generation: Mapping[str, Any],
    model: str,
    on_restart: RestartPolicy = RestartPolicy.FAIL,
    metadata: Mapping[str, str] | None = None,
    notify_webhooks: bool = False,
) -> Task:
    """Create a queued task, its response and event 0 (``response.created``).

    ``request`` is kept as the client sent it (its echo, its replay);
    ``generation`` is the generation spec translated from it, all a worker reads.

    Runs in the caller's transaction when there is one, so that the caller can
    commit the idempotency record with it. ``notify_webhooks``: the task's end
    is delivered to its client's webhook endpoints (not for a response whose
    caller waits on the connection).
    """
    now = timezone.now()
    # No savepoint: inside a caller's transaction a failure here must undo
    # the caller's writes too (the idempotency claim).
    with transaction.atomic(savepoint=False):
        response = Response.objects.create(
            id=new_response_id(),
            client=client,
            model=model,
            status=ResponseStatus.QUEUED,
            request=dict(request),
            generation=dict(generation),
            metadata=dict(metadata or {}),
            created_at=now,
            updated_at=now,
        )
        task = Task.objects.create(
            id=new_task_id(),
            client=client,
            type=TaskType.RESPONSE,
            status=S.QUEUED,
            on_restart=on_restart,
            response=response,
            last_sequence=0,
            notify_webhooks=notify_webhooks,
            created_at=now,
            updated_at=now,
        )
        _events_insert(task, [events.encoded(events.created(response))], now)
    return task


# --------------------------------------------------------------------------- #
# A worker's verbs: claim or adopt, start, progress, heartbeat, end
# --------------------------------------------------------------------------- #

# Every commit a worker makes is also its heartbeat.
_BEAT = ("heartbeat_at",)


def task_claim(*, task_id: str, worker: str) -> TransitionResult:
    """``queued -> loading`` for ``worker``: of several deliveries of one task, one wins.

    Counts the attempt, starts the output count over and marks where the
    attempt's events begin (a claim writes none): an earlier attempt's output
    item is never this one's, even while this one has opened none.
    """
    columns = {"worker": worker, "attempts": F("attempts") + 1, "output_tokens": 0, "attempt_after": F("last_sequence")}
    return _apply(task_id, _Write(MOVES["task_claim"], task=columns, stamped=_BEAT))


def task_adopt(*, task_id: str, worker: str) -> TransitionResult:
    """A worker takes over a task that recovery left ``running`` (or a cancel
    made ``cancelling``) without a worker, to resume it from its snapshot.

    A compare-and-set on an empty ``worker``: of several workers handed the
    same task, one wins. The attempt is counted like a claim's.
    """
    columns = {"worker": worker, "attempts": F("attempts") + 1}
    return _apply(task_id, _Write(MOVES["task_adopt"], task=columns, stamped=_BEAT, holder=""))


def task_start(
    *,
    task_id: str,
    worker: str,
    item_id: str | None,
    snapshot: Mapping[str, Any] | None = None,
    deltas: Sequence[str] = (),
    output_tokens: int | None = None,
) -> TransitionResult:
    """``loading -> running``: ``response.in_progress`` and the empty output item and text part.

    ``snapshot`` is the run's first snapshot row (with the prompt ids). A run
    that may call tools passes no ``item_id``: its items open as the model
    writes them (``output_items``). A run whose first tokens came before it
    started passes their ``deltas`` and ``output_tokens`` (the snapshot then
    accounts for them): one commit instead of a start and a first batch.
    """
    if item_id is None:
        if deltas:
            raise ValueError("deltas need the message item they belong to")
        written: list[Event] = []
    else:
        written = [*events.message_opened(item_id, 0), *(events.message_delta(item_id, 0, text) for text in deltas)]
    write = _Write(
        MOVES["task_start"],
        task={} if output_tokens is None else {"output_tokens": output_tokens},
        stamped=_BEAT,
        events=written,
        opening=events.in_progress,
        snapshot=snapshot,
        holder=worker,
    )
    return _apply(task_id, write)


def task_progress(
    *,
    task_id: str,
    worker: str,
    item_id: str,
    deltas: Sequence[str],
    output_tokens: int,
    snapshot: Mapping[str, Any] | None = None,
    item_events: Sequence[Event] | None = None,
) -> TransitionResult:
    """A batch of text deltas while ``running``, with the snapshot row that accounts for them.

    Loses (``won`` False) once a cancel or another writer moved the task:
    that is how a worker learns of a cancel whose notification it missed.
    A run that may call tools passes ``item_events`` (``output_items``:
    items opened, text and argument deltas, items closed) instead of ``deltas``.
    """
    batch = ProgressBatch(task_id, worker, item_id, deltas, output_tokens, snapshot, item_events)
    return _apply(task_id, _progress_write(batch))


@dataclass(frozen=True)
class ProgressBatch:
    """One task's share of :func:`tasks_progress`: what :func:`task_progress` takes."""

    task_id: str
    worker: str
    item_id: str
    deltas: Sequence[str]
    output_tokens: int
    snapshot: Mapping[str, Any] | None = None
    item_events: Sequence[Event] | None = None


def tasks_progress(*, batches: Sequence[ProgressBatch]) -> list[TransitionResult | None]:
    """:func:`task_progress` for many running tasks in one transaction (a worker's run loop).

    Each task's compare-and-set is checked on its own: one that lost (a
    cancel, another writer) writes nothing and gets ``won`` False, the
    others commit. A task that does not exist gets None. Results come in the
    order of ``batches``; a task appears at most once.
    """
    if len({batch.task_id for batch in batches}) != len(batches):
        raise ValueError("a task appears twice in one group of progress batches")
    return _apply_group([(batch.task_id, _progress_write(batch)) for batch in batches])


def _progress_write(batch: ProgressBatch) -> _Write:
    written = (
        list(batch.item_events)
        if batch.item_events is not None
        else [events.message_delta(batch.item_id, 0, text) for text in batch.deltas]
    )
    return _Write(
        MOVES["task_progress"],
        task={"output_tokens": batch.output_tokens},
        stamped=_BEAT,
        events=written,
        snapshot=batch.snapshot,
        holder=batch.worker,
    )


def task_heartbeat(*, task_id: str, worker: str) -> TransitionResult:
    """``worker`` still holds the task (while loading, or in a long prefill without batches)."""
    return _apply(task_id, _Write(MOVES["task_heartbeat"], stamped=_BEAT, holder=worker))


def task_succeed(
    *,
    task_id: str,
    worker: str,
    item_id: str,
    text: str,
    usage: Mapping[str, Any] | None,
    output_tokens: int,
    deltas: Sequence[str] = (),
    incomplete: bool = False,
    items: output_items.OutputItems | None = None,
    item_events: Sequence[Event] = (),
) -> TransitionResult:
    """``running -> succeeded``: the last deltas, the three ``*.done`` events and the terminal one.

    ``text`` is the whole output (the committed deltas and ``deltas``);
    ``incomplete`` means the run stopped at ``max_output_tokens``. A run that
    may call tools passes its ``items`` (all closed) and the ``item_events``
    not yet committed instead of ``text`` and ``deltas``.
    """
    status = ResponseStatus.INCOMPLETE if incomplete else ResponseStatus.COMPLETED
    item_status = "incomplete" if incomplete else "completed"
    if items is None:
        output = [message_item(item_id, text, item_status)]
        written = [
            *(events.message_delta(item_id, 0, delta) for delta in deltas),
            *events.message_closed(item_id, 0, text, item_status),
        ]
    else:
        output, written = items.output(), list(item_events)
    response = {
        "status": status,
        "output": output,
        "usage": dict(usage) if usage is not None else None,
        "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
    }
    write = _Write(
        MOVES["task_succeed"],
        task={"output_tokens": output_tokens},
        stamped=_BEAT,
        response=response,
        events=written,
        closing=events.finished,
        holder=worker,
    )
    return _apply(task_id, write)


def task_fail(
    *,
    task_id: str,
    error: Mapping[str, Any] | None,
    worker: str | None = None,
    sources: Iterable[TaskStatus] | None = None,
    partial: Partial | None = None,
) -> TransitionResult:
    """``queued|loading|running -> failed`` with ``error`` (a problem object) on task and response.

    A worker passes its name (fencing), the statuses it may fail the task
    from, and what the attempt showed (``partial``), which the response keeps.
    """
    if not error:
        raise TransitionNotAllowed("a move to failed needs an error")
    response: dict[str, Any] = {"error": dict(error)}
    if partial is not None:
        response |= {"output": partial.output(), "usage": partial.usage}
    write = _Write(
        MOVES["task_fail"].narrowed(sources),
        task={"error": dict(error)},
        response=response,
        closing=events.finished,
        holder=worker,
    )
    return _apply(task_id, write)


def task_finish_cancel(*, task_id: str, worker: str, partial: Partial | None = None) -> TransitionResult:
    """``cancelling -> cancelled`` by the worker that stopped generating; the response keeps ``partial``."""
    response = {} if partial is None else {"output": partial.output(), "usage": partial.usage}
    write = _Write(MOVES["task_finish_cancel"], response=response, closing=events.finished, holder=worker)
    return _apply(task_id, write)


# --------------------------------------------------------------------------- #
# Cancel (chapter 7.3): the service picks the verb by the status it read
# --------------------------------------------------------------------------- #


def task_cancel_queued(*, task_id: str) -> TransitionResult:
    """``queued -> cancelled`` at once: nothing runs yet."""
    return _apply(task_id, _Write(MOVES["task_cancel_queued"], closing=events.finished))


def task_request_cancel(*, task_id: str, sources: Iterable[TaskStatus] | None = None) -> TransitionResult:
    """``loading|running -> cancelling``; the worker stops and finishes the move.

    Stamps ``cancel_requested_at``, from which the worker measures its cancel latency.
    """
    write = _Write(MOVES["task_request_cancel"].narrowed(sources), stamped=("cancel_requested_at",))
    return _apply(task_id, write)


# --------------------------------------------------------------------------- #
# Recovery (chapter 11.3): the only moves outside chapter 7.2's table
# --------------------------------------------------------------------------- #


@dataclass(frozen=True)
class RecoveryMove:
    """One task for :func:`tasks_recover`: the state its caller saw, and where chapter 11.3 sends it."""

    task_id: str
    found: TaskStatus
    to: TaskStatus
    worker: str
    heartbeat_at: datetime | None
    error: Mapping[str, Any] | None = None

    def check(self) -> None:
        if not states.recovery_allows(self.found, self.to):
            raise TransitionNotAllowed(f"recovery does not move a task from {self.found} to {self.to}")
        if self.to == S.FAILED and not self.error:
            raise TransitionNotAllowed("a move to failed needs an error")


@dataclass(frozen=True)
class RecoveryBatch:
    """What :func:`tasks_recover` did with each task it was given."""

    won: tuple[str, ...] = ()
    """Moved (or, queued and left queued, still queued)."""
    lost: tuple[str, ...] = ()
    """Moved on meanwhile, or its worker wrote a heartbeat since it was read: untouched."""
    busy: tuple[str, ...] = ()
    """Locked by a writer (PostgreSQL: skipped, not waited on): untouched, for the next round."""


def tasks_recover(*, moves: Sequence[RecoveryMove]) -> RecoveryBatch:
    """Apply recovery moves to tasks that no live worker holds, all in one transaction.

    Each move is a compare-and-set on the status, worker and heartbeat its
    caller saw: under the write lock (SQLite) or the rows' locks (PostgreSQL,
    ``FOR UPDATE SKIP LOCKED``, so a row a frozen writer holds is skipped,
    not waited on) each task is checked, and only those that still match
    move. ``failed`` writes ``response.failed``, ``cancelled`` writes
    ``response.cancelled``; both keep in the response the text the event log
    already showed. Back to ``queued`` writes no event (the rerun's
    ``response.in_progress`` opens the new attempt) and forgets the snapshot;
    staying ``running`` only lets go of the worker, so another can adopt the
    task and resume it. A crash before the commit leaves every task as it
    was; after it, each moved with its event. The caller dispatches the
    tasks that run again.
    """
    for move in moves:
        move.check()
    if not moves:
        return RecoveryBatch()
    with busy_as_unavailable(), transaction.atomic(savepoint=False):
        now = timezone.now()
        rows = _recovery_rows_lock([move.task_id for move in moves])
        won, lost, busy = _recovery_sort(moves, rows)
        writing = [move for move in won if not (move.found == S.QUEUED and move.to == S.QUEUED)]
        changes = _recovery_tasks_update(writing, rows, now)
        _recovery_finish(writing, rows, now)
        if faults.ARMED:
            faults.freeze_point("tasks_recover")
        tasks_changed_on_commit(changes)
    return RecoveryBatch(
        won=tuple(m.task_id for m in won), lost=tuple(m.task_id for m in lost), busy=tuple(m.task_id for m in busy)
    )


_RECOVERY_FIELDS = (
    "id",
    "status",
    "worker",
    "heartbeat_at",
    "last_sequence",
    "response_id",
    "client_id",
    "notify_webhooks",
)


def _recovery_rows_lock(task_ids: list[str]) -> dict[str, dict[str, Any]]:
    rows = Task.objects.filter(pk__in=task_ids)
    if connection.vendor != "sqlite":
        # SQLite's write lock, taken at BEGIN, already covers every row.
        rows = rows.select_for_update(skip_locked=True)
    return {row[0]: dict(zip(_RECOVERY_FIELDS, row, strict=True)) for row in rows.values_list(*_RECOVERY_FIELDS)}


def _recovery_sort(
    moves: Sequence[RecoveryMove], rows: Mapping[str, Mapping[str, Any]]
) -> tuple[list[RecoveryMove], list[RecoveryMove], list[RecoveryMove]]:
    won: list[RecoveryMove] = []
    lost: list[RecoveryMove] = []
    busy: list[RecoveryMove] = []
    for move in moves:
        row = rows.get(move.task_id)
        if row is None:
            # PostgreSQL skipped it because a writer holds it (or it is gone; the next round tells).
            (busy if connection.vendor != "sqlite" else lost).append(move)
        elif (row["status"], row["worker"], row["heartbeat_at"]) == (move.found, move.worker, move.heartbeat_at):
            won.append(move)
        else:
            lost.append(move)
    return won, lost, busy


# What each target writes on the task row; ``error`` is added per task for ``failed``.
_RECOVERY_TASK_COLUMNS: Mapping[TaskStatus, Mapping[str, Any]] = {
    S.FAILED: {},
    S.CANCELLED: {},
    S.QUEUED: {"worker": "", "heartbeat_at": None, "output_tokens": 0},
    S.RUNNING: {"worker": "", "heartbeat_at": None},
}


def _recovery_tasks_update(
    moves: Sequence[RecoveryMove], rows: Mapping[str, Mapping[str, Any]], now: datetime
) -> list[tuple[str, str, int]]:
    """One UPDATE per group of tasks that get the same columns (by id: their rows are ours now)."""
    groups: dict[tuple[Any, ...], list[RecoveryMove]] = {}
    for move in moves:
        error_key = json.dumps(move.error, sort_keys=True) if move.error else ""
        groups.setdefault((move.found, move.to, error_key), []).append(move)
    changes = []
    for (found, to, _), group in groups.items():
        columns: dict[str, Any] = {"updated_at": now, **_RECOVERY_TASK_COLUMNS[to]}
        grows = to in states.TERMINAL
        if to != found:
            columns["status"] = to
        if grows:
            columns["last_sequence"] = F("last_sequence") + 1
        if group[0].error:
            columns["error"] = dict(group[0].error)
        ids = [move.task_id for move in group]
        if Task.objects.filter(pk__in=ids, status=found).update(**columns) != len(ids):
            # The rows were checked under their lock a moment ago; a mismatch undoes the whole page.
            raise TransitionNotAllowed(f"recovery lost rows it held while moving {found} -> {to}")
        changes += [(task_id, str(to), rows[task_id]["last_sequence"] + grows) for task_id in ids]
    return changes


def _recovery_finish(moves: Sequence[RecoveryMove], rows: Mapping[str, Mapping[str, Any]], now: datetime) -> None:
    """The responses' new state, the terminal events, and the snapshots the moved tasks no longer need."""
    ending = [move for move in moves if move.to in states.TERMINAL]
    rerun = [rows[move.task_id]["response_id"] for move in moves if move.to == S.QUEUED]
    if rerun:
        Response.objects.filter(pk__in=rerun).update(
            status=ResponseStatus.QUEUED, output=[], usage=None, updated_at=now
        )
    if ending:
        _recovery_end(ending, rows, now)
    forget = [move.task_id for move in moves if move.to != S.RUNNING]
    if forget:
        # A finished task is never resumed; a rerun starts from nothing.
        TaskSnapshot.objects.filter(task_id__in=forget).delete()


def _recovery_end(moves: Sequence[RecoveryMove], rows: Mapping[str, Mapping[str, Any]], now: datetime) -> None:
    responses = Response.objects.in_bulk([rows[move.task_id]["response_id"] for move in moves])
    outputs = task_outputs_items(task_ids=[move.task_id for move in moves if move.found in states.MAY_HAVE_OUTPUT])
    # Responses that get the same columns share one UPDATE (most have no output; a CASE per row costs more).
    groups: dict[str, tuple[dict[str, Any], list[str]]] = {}
    ended = []
    for move in moves:
        response = responses[rows[move.task_id]["response_id"]]
        columns: dict[str, Any] = {"status": states.RESPONSE_STATUS[move.to], "updated_at": now}
        if move.error:
            columns["error"] = dict(move.error)
        if move.found in states.MAY_HAVE_OUTPUT:
            columns["output"] = output_items.stopped_output(outputs.get(move.task_id, []))
        for name, value in columns.items():
            setattr(response, name, value)
        group_key = json.dumps(columns, sort_keys=True, default=str)
        groups.setdefault(group_key, (columns, []))[1].append(response.pk)
        ended.append(response)
    for columns, ids in groups.values():
        Response.objects.filter(pk__in=ids).update(**columns)
    finals = [(move, events.finished(response)) for move, response in zip(moves, ended, strict=True)]
    TaskEvent.objects.bulk_create(
        _event_row(move.task_id, rows[move.task_id]["last_sequence"] + 1, event, now) for move, event in finals
    )
    # The page's outbox rows, in the same transaction: one query for all its clients' endpoints.
    notified = [
        TaskEnd(move.task_id, row["response_id"], row["client_id"], str(event.type))
        for move, event in finals
        if (row := rows[move.task_id])["notify_webhooks"]
    ]
    webhook_deliveries_enqueue(ends=notified, now=now)


def _event_row(task_id: str, sequence: int, event: Event, now: datetime) -> TaskEvent:
    return TaskEvent(
        task_id=task_id,
        sequence_number=sequence,
        type=event.type,
        payload=events.encode(event.type, sequence, event.fields),
        created_at=now,
    )
