"""The one owner of task state: status, sequence numbers, events, response status.

Every status change in the service goes through ``task_transition``: a
compare-and-set ``UPDATE tasks SET status=... WHERE id=... AND status IN
(sources)`` whose row count says who won, in the same transaction as the
events the move implies and the response row's new state. Two writers racing
(a cancel and a completion, a recovery and a worker) can therefore never both
win, and a task never gets two terminal events (the database refuses that
too). Callers learn the outcome from ``TransitionResult.won``.

Events are numbered here and nowhere else: ``tasks.last_sequence`` is bumped by
the number of events inside the compare-and-set, so sequence numbers stay
contiguous from 0 per task. A worker's snapshot (``snapshot=``, a mapping of
``token_ids`` generated since the last one and the small ``state``) is
appended in the same transaction as one ``TaskSnapshot`` row; a terminal
move deletes those rows. A winning commit is announced on Redis only after
it commits (``tasks_app.notify``).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from django.db import transaction
from django.db.models import F
from django.utils import timezone

from tasks_app.exceptions import TaskNotFound, TransitionNotAllowed
from tasks_app.ids import new_response_id, new_task_id
from tasks_app.models import (
    ACTIVE_TASK_STATUSES,
    TERMINAL_TASK_STATUSES,
    Client,
    Response,
    ResponseStatus,
    RestartPolicy,
    Task,
    TaskEvent,
    TaskSnapshot,
    TaskStatus,
    TaskType,
)
from tasks_app.notify import task_changed_on_commit
from tasks_app.objects import message_item, response_object
from tasks_app.selectors import task_output_text

S = TaskStatus

# Chapter 7.2, row for row. Terminal states have no moves.
TRANSITIONS: Mapping[TaskStatus, frozenset[TaskStatus]] = {
    S.QUEUED: frozenset({S.LOADING, S.CANCELLED, S.FAILED}),
    S.LOADING: frozenset({S.RUNNING, S.CANCELLING, S.FAILED}),
    S.RUNNING: frozenset({S.SUCCEEDED, S.FAILED, S.CANCELLING}),
    S.CANCELLING: frozenset({S.CANCELLED}),
    S.SUCCEEDED: frozenset(),
    S.FAILED: frozenset(),
    S.CANCELLED: frozenset(),
}
TERMINAL: frozenset[TaskStatus] = frozenset(TERMINAL_TASK_STATUSES)
ACTIVE: frozenset[TaskStatus] = frozenset(ACTIVE_TASK_STATUSES)
CANCELABLE_AT_ONCE: frozenset[TaskStatus] = frozenset({S.QUEUED})
CANCELABLE_VIA_BACKEND: frozenset[TaskStatus] = frozenset({S.LOADING, S.RUNNING})

# The response status each task status implies, where it implies one.
_RESPONSE_STATUS: Mapping[TaskStatus, ResponseStatus] = {
    S.QUEUED: ResponseStatus.QUEUED,
    S.RUNNING: ResponseStatus.IN_PROGRESS,
    S.FAILED: ResponseStatus.FAILED,
    S.CANCELLED: ResponseStatus.CANCELLED,
}
_SUCCESS_EVENTS: Mapping[str, str] = {
    ResponseStatus.COMPLETED: "response.completed",
    ResponseStatus.INCOMPLETE: "response.incomplete",
}


class _Unset:
    """The type of ``UNSET``: a keyword the caller did not pass (None is a value here)."""


UNSET = _Unset()

# Fields of the task row a caller may set alongside a move.
_TASK_FIELDS = frozenset({"worker", "heartbeat_at", "attempts", "output_tokens"})
_RESPONSE_FIELDS = frozenset({"status", "output", "usage", "incomplete_details"})


def sources_for(to: TaskStatus) -> frozenset[TaskStatus]:
    """Every status from which the table allows a move to ``to``."""
    return frozenset(src for src, targets in TRANSITIONS.items() if to in targets)


def is_allowed(source: TaskStatus, to: TaskStatus) -> bool:
    return to in TRANSITIONS[TaskStatus(source)]


@dataclass(frozen=True)
class TransitionResult:
    """What a compare-and-set did: ``won`` is False when another writer moved first."""

    won: bool
    task: Task
    events: tuple[TaskEvent, ...] = ()


def encode_event(event_type: str, sequence_number: int, fields: Mapping[str, Any]) -> str:
    """The stored (and streamed) JSON of one event: type and number first."""
    body = {"type": event_type, "sequence_number": sequence_number, **fields}
    return json.dumps(body, ensure_ascii=False, separators=(",", ":"))


def _event_rows(
    task_id: str, first: int, specs: Sequence[tuple[str, Mapping[str, Any]]], now: datetime
) -> list[TaskEvent]:
    return [
        TaskEvent(
            task_id=task_id,
            sequence_number=first + offset,
            type=event_type,
            payload=encode_event(event_type, first + offset, fields),
            created_at=now,
        )
        for offset, (event_type, fields) in enumerate(specs)
    ]


def task_insert(
    *,
    client: Client,
    request: Mapping[str, Any],
    model: str,
    on_restart: RestartPolicy = RestartPolicy.FAIL,
    metadata: Mapping[str, str] | None = None,
) -> Task:
    """Create a queued task, its response and event 0 (``response.created``).

    Runs in the caller's transaction when there is one, so that the caller can
    commit the idempotency record with it.
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
            created_at=now,
            updated_at=now,
        )
        TaskEvent.objects.bulk_create(
            _event_rows(task.id, 0, [("response.created", {"response": response_object(response)})], now)
        )
    return task


def _status_event(to: TaskStatus | None, response: Response) -> tuple[str, dict[str, Any]] | None:
    if to == S.RUNNING:
        return "response.in_progress", {"response": response_object(response)}
    if to == S.SUCCEEDED:
        return _SUCCESS_EVENTS[response.status], {"response": response_object(response)}
    if to == S.FAILED:
        return "response.failed", {"response": response_object(response)}
    if to == S.CANCELLED:
        return "response.cancelled", {"response": response_object(response)}
    return None


def _commit(
    *,
    task_id: str,
    sources: frozenset[TaskStatus],
    to: TaskStatus | None,
    events: Sequence[tuple[str, Mapping[str, Any]]],
    response_changes: Mapping[str, Any] | None,
    task_changes: Mapping[str, Any] | None,
    error: Mapping[str, Any] | None,
    snapshot: Mapping[str, Any] | None = None,
    holder: str | None = None,
    heartbeat_seen: datetime | _Unset | None = UNSET,
    drop_snapshot: bool = False,
) -> TransitionResult:
    unknown = set(task_changes or {}) - _TASK_FIELDS
    if unknown:
        raise TransitionNotAllowed(f"the lifecycle does not set task fields {sorted(unknown)}")
    unknown = set(response_changes or {}) - _RESPONSE_FIELDS
    if unknown:
        raise TransitionNotAllowed(f"the lifecycle does not set response fields {sorted(unknown)}")
    if (response_changes or {}).get("status") is not None and to != S.SUCCEEDED:
        raise TransitionNotAllowed("only a move to succeeded chooses the response status")
    if to == S.FAILED and not error:
        raise TransitionNotAllowed("a move to failed needs an error")

    has_status_event = to in (S.RUNNING, S.SUCCEEDED, S.FAILED, S.CANCELLED)
    count = len(events) + (1 if has_status_event else 0)
    now = timezone.now()
    with transaction.atomic(savepoint=False):
        changes: dict[str, Any] = {"updated_at": now, **(task_changes or {})}
        if count:
            changes["last_sequence"] = F("last_sequence") + count
        if to is not None:
            changes["status"] = to
        if to == S.CANCELLING:
            # The worker measures its cancel latency from here (metrics, admin).
            changes["cancel_requested_at"] = now
        if error is not None:
            changes["error"] = dict(error)
        claimed = Task.objects.filter(pk=task_id, status__in=sources)
        if holder is not None:
            # Fencing: a worker that lost its task to recovery or the reaper
            # (and may still be generating) can no longer write to it.
            claimed = claimed.filter(worker=holder)
        if not isinstance(heartbeat_seen, _Unset):
            # The reaper moves a task only if no heartbeat arrived since it looked.
            claimed = (
                claimed.filter(heartbeat_at=heartbeat_seen)
                if heartbeat_seen
                else claimed.filter(heartbeat_at__isnull=True)
            )
        won = claimed.update(**changes)
        # Read after the write: inside this transaction the row is ours
        # (PostgreSQL row lock, SQLite write lock), so the numbers are final.
        try:
            task = Task.objects.get(pk=task_id)
        except Task.DoesNotExist:
            raise TaskNotFound(f"task {task_id} does not exist") from None
        if not won:
            return TransitionResult(won=False, task=task)

        response_update: dict[str, Any] = dict(response_changes or {})
        if to in _RESPONSE_STATUS:
            response_update["status"] = _RESPONSE_STATUS[to]
        elif to == S.SUCCEEDED:
            response_update.setdefault("status", ResponseStatus.COMPLETED)
            if response_update["status"] not in _SUCCESS_EVENTS:
                raise TransitionNotAllowed("a succeeded task's response is completed or incomplete")
        if error is not None:
            response_update["error"] = dict(error)
        status_event = None
        if response_update or has_status_event:
            # Only moves that change or show the response read it: a batch of
            # deltas need not load the prompt and output it does not touch.
            response = Response.objects.get(pk=task.response_id)
            if response_update:
                response_update["updated_at"] = now
                Response.objects.filter(pk=response.pk).update(**response_update)
                for field, value in response_update.items():
                    setattr(response, field, value)
            task.response = response
            if has_status_event:
                status_event = _status_event(to, response)

        specs = list(events)
        if status_event is not None:
            # in_progress opens a run, before the caller's opening events;
            # a terminal event closes the log, after everything else.
            specs = [status_event, *specs] if to == S.RUNNING else [*specs, status_event]
        rows = _event_rows(task.id, task.last_sequence - count + 1, specs, now)
        if rows:
            TaskEvent.objects.bulk_create(rows)
        if to in TERMINAL or drop_snapshot:
            # A finished task is never resumed; a rerun starts from nothing.
            TaskSnapshot.objects.filter(task_id=task.id).delete()
        elif snapshot is not None:
            _store_snapshot(task, snapshot, now)
        task_changed_on_commit(task.id, task.status, task.last_sequence)
    return TransitionResult(won=True, task=task, events=tuple(rows))


def _store_snapshot(task: Task, data: Mapping[str, Any], now: datetime) -> None:
    # One INSERT per batch: ``token_ids`` are the ids generated since the
    # previous row, ``state`` the small rest (see TaskSnapshot).
    TaskSnapshot.objects.create(
        task_id=task.id,
        sequence_number=task.last_sequence,
        token_ids=list(data.get("token_ids", ())),
        state=dict(data["state"]),
        created_at=now,
    )


def task_transition(
    *,
    task_id: str,
    to: TaskStatus,
    sources: Iterable[TaskStatus] | None = None,
    events: Sequence[tuple[str, Mapping[str, Any]]] = (),
    response_changes: Mapping[str, Any] | None = None,
    task_changes: Mapping[str, Any] | None = None,
    error: Mapping[str, Any] | None = None,
    snapshot: Mapping[str, Any] | None = None,
    holder: str | None = None,
) -> TransitionResult:
    """Move a task to ``to`` if it is still in one of ``sources``.

    ``sources`` defaults to every status the table allows a move from; each
    given source must be allowed, or ``TransitionNotAllowed`` is raised (a
    programming error, not a lost race). ``events`` are ``(type, fields)``
    pairs written with the move; the event the target status implies
    (``response.in_progress`` first, or the terminal event last) is added here.
    ``holder`` (a worker's name) also requires the task's ``worker`` to be it.
    """
    to = TaskStatus(to)
    allowed = sources_for(to)
    chosen = allowed if sources is None else frozenset(TaskStatus(s) for s in sources)
    refused = chosen - allowed
    if refused or not chosen:
        raise TransitionNotAllowed(f"no move to {to} from {sorted(refused) or 'nowhere'}")
    return _commit(
        task_id=task_id,
        sources=chosen,
        to=to,
        events=events,
        response_changes=response_changes,
        task_changes=task_changes,
        error=error,
        snapshot=snapshot,
        holder=holder,
    )


def task_append_events(
    *,
    task_id: str,
    expected: Iterable[TaskStatus] = (S.RUNNING,),
    events: Sequence[tuple[str, Mapping[str, Any]]] = (),
    response_changes: Mapping[str, Any] | None = None,
    task_changes: Mapping[str, Any] | None = None,
    snapshot: Mapping[str, Any] | None = None,
    holder: str | None = None,
) -> TransitionResult:
    """Append events (and progress) without a status change.

    Only while the task is in ``expected`` (a non-terminal status): a worker
    whose task was cancelled learns it here from ``won=False``.
    """
    expected_set = frozenset(TaskStatus(s) for s in expected)
    if not expected_set or expected_set & TERMINAL:
        raise TransitionNotAllowed("events are appended only to unfinished tasks")
    return _commit(
        task_id=task_id,
        sources=expected_set,
        to=None,
        events=events,
        response_changes=response_changes,
        task_changes=task_changes,
        error=None,
        snapshot=snapshot,
        holder=holder,
    )


def task_adopt(*, task_id: str, worker: str) -> TransitionResult:
    """A worker takes over a task that recovery left ``running`` (or a cancel
    made ``cancelling``) without a worker, to resume it from its snapshot.

    A compare-and-set on an empty ``worker``: of several workers handed the
    same task, one wins. The attempt is counted like a claim's.
    """
    return _commit(
        task_id=task_id,
        sources=ORPHANABLE,
        to=None,
        events=(),
        response_changes=None,
        task_changes={"worker": worker, "heartbeat_at": timezone.now(), "attempts": F("attempts") + 1},
        error=None,
        holder="",
    )


# --------------------------------------------------------------------------- #
# Recovery (chapter 11.3): the only moves outside the table above
# --------------------------------------------------------------------------- #

R = RestartPolicy
# Statuses a worker holds a task in (it has a ``worker`` and a heartbeat).
HELD: frozenset[TaskStatus] = frozenset({S.LOADING, S.RUNNING, S.CANCELLING})
# A task in one of these with an empty ``worker`` waits for a worker to adopt it.
ORPHANABLE: frozenset[TaskStatus] = frozenset({S.RUNNING, S.CANCELLING})

# Chapter 11.3, cell for cell: where a leftover task goes, by status found and policy.
RECOVERY: Mapping[TaskStatus, Mapping[RestartPolicy, TaskStatus]] = {
    S.QUEUED: {R.FAIL: S.FAILED, R.RETRY: S.QUEUED, R.RESUME: S.QUEUED},
    S.LOADING: {R.FAIL: S.FAILED, R.RETRY: S.QUEUED, R.RESUME: S.QUEUED},
    S.RUNNING: {R.FAIL: S.FAILED, R.RETRY: S.QUEUED, R.RESUME: S.RUNNING},
    S.CANCELLING: {R.FAIL: S.CANCELLED, R.RETRY: S.CANCELLED, R.RESUME: S.CANCELLED},
}
# Besides its cell, recovery may fail a task it would otherwise run again
# (its attempts are used up), except a cancelling one, whose cancel wins.
_RECOVERY_ESCAPE: Mapping[TaskStatus, frozenset[TaskStatus]] = {
    S.QUEUED: frozenset({S.FAILED}),
    S.LOADING: frozenset({S.FAILED}),
    S.RUNNING: frozenset({S.FAILED}),
    S.CANCELLING: frozenset(),
}


def recovery_target(status: TaskStatus, policy: RestartPolicy) -> TaskStatus:
    """The cell of chapter 11.3 for a task found in ``status`` with ``policy``."""
    return RECOVERY[TaskStatus(status)][RestartPolicy(policy)]


def task_recover(
    *,
    task_id: str,
    found: TaskStatus,
    to: TaskStatus,
    worker: str,
    heartbeat_at: datetime | None,
    error: Mapping[str, Any] | None = None,
) -> TransitionResult:
    """Apply one recovery move to a task that no live worker holds.

    A compare-and-set on the status, worker and heartbeat the caller saw: if
    the task moved on, or its worker wrote a heartbeat since (it is alive),
    nothing is written and ``won`` is False. One transaction holds the new
    state and its event: ``response.failed`` for ``failed``,
    ``response.cancelled`` for ``cancelled``; a move back to ``queued`` writes
    no event (the rerun's ``response.in_progress`` opens the new attempt) and
    forgets the snapshot; staying ``running`` only lets go of the worker, so
    another can adopt the task and resume it. The caller dispatches the task
    again where it is to run again.
    """
    found, to = TaskStatus(found), TaskStatus(to)
    if found not in RECOVERY or (to not in RECOVERY[found].values() and to not in _RECOVERY_ESCAPE[found]):
        raise TransitionNotAllowed(f"recovery does not move a task from {found} to {to}")
    if found == S.QUEUED and to == S.QUEUED:
        # Nothing to write: the task waits as it did; the caller re-sends it.
        task = Task.objects.get(pk=task_id)
        return TransitionResult(won=task.status == S.QUEUED, task=task)
    task_changes: dict[str, Any] = {}
    response_changes: dict[str, Any] | None = None
    if to in (S.QUEUED, S.RUNNING):
        task_changes = {"worker": "", "heartbeat_at": None}
    if to in (S.FAILED, S.CANCELLED) and found in (S.RUNNING, S.CANCELLING):
        # The response keeps what the event log already showed of the text.
        response_changes = {"output": _committed_output(task_id)}
    if to == S.QUEUED:
        response_changes = {"output": [], "usage": None}
        task_changes["output_tokens"] = 0
    return _commit(
        task_id=task_id,
        sources=frozenset({found}),
        to=None if to == found else to,
        events=(),
        response_changes=response_changes,
        task_changes=task_changes,
        error=error,
        holder=worker,
        heartbeat_seen=heartbeat_at,
        drop_snapshot=to == S.QUEUED,
    )


def _committed_output(task_id: str) -> list[dict[str, Any]]:
    """The output item of the current attempt as far as its deltas were committed."""
    item_id, text = task_output_text(task_id=task_id)
    return [message_item(item_id, text, "incomplete")] if item_id and text else []
