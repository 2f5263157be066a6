"""Recovery's moves (chapter 11.3): the only moves outside chapter 7.2's table, a page of tasks at a time.

:func:`tasks_recover` moves a page of tasks in one transaction: the same
compare-and-set as the verbs' (``tasks_app.core.transitions``), checked for
every task under its lock, with the same events, snapshots, webhook outbox
rows and wake-ups. ``tasks_app.core.lifecycle`` re-exports it with the verbs.

A part of the lifecycle: only its modules write task state (``tests/test_architecture.py``).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from django.db import connection, transaction
from django.db.models import F
from django.utils import timezone

from tasks_app import faults, states
from tasks_app.core import event_payloads, output_items
from tasks_app.core.attempt_log import ATTEMPT_FIELDS, attempts_close
from tasks_app.core.log_rows import event_row
from tasks_app.core.output_items import task_outputs_items
from tasks_app.core.task_ends import TaskEnded, task_ends_settle
from tasks_app.core.webhook_outbox import TaskEnd, webhook_deliveries_enqueue
from tasks_app.exceptions import TransitionNotAllowed
from tasks_app.models import Response, Task, TaskEvent, TaskSnapshot
from tasks_app.plumbing.db_locks import busy_as_unavailable
from tasks_app.plumbing.notify import tasks_changed_on_commit
from tasks_app.states import AttemptEnd, ResponseStatus, TaskStatus

S = TaskStatus


@dataclass(frozen=True)
class RecoveryMove:
    """One task for :func:`tasks_recover`: the state its caller saw, and where chapter 11.3 sends it."""

    task_id: str
    found: TaskStatus
    to: TaskStatus
    worker: str
    heartbeat_at: datetime | None
    error: Mapping[str, Any] | None = None
    # How the attempt it lets go of ended, and why (the task's attempt log).
    end: AttemptEnd = AttemptEnd.RECOVERED
    reason: str = ""

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
    "heartbeat_at",
    "last_sequence",
    "response_id",
    "client_id",
    "notify_webhooks",
    *ATTEMPT_FIELDS,
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
# A move that lets go of the attempt empties its columns (its row in the attempt log keeps them).
_RECOVERY_TASK_COLUMNS: Mapping[TaskStatus, Mapping[str, Any]] = {
    S.FAILED: {},
    S.CANCELLED: {},
    S.QUEUED: {
        "worker": "",
        "heartbeat_at": None,
        "output_tokens": 0,
        "attempt_started_at": None,
        "first_token_at": None,
    },
    S.RUNNING: {"worker": "", "heartbeat_at": None, "attempt_started_at": None, "first_token_at": None},
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
        # A terminal event, or a rerun's ``response.queued``.
        grows = to in states.TERMINAL or to == S.QUEUED
        if to != found:
            columns["status"] = to
        if to in states.TERMINAL:
            columns["finished_at"] = now
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
    rerun = [move for move in moves if move.to == S.QUEUED]
    attempts_close(rows=[(m.task_id, rows[m.task_id], m.end, m.reason) for m in moves if m.found != S.QUEUED], now=now)
    if rerun:
        _recovery_requeue(rerun, rows, now)
    if ending:
        _recovery_end(ending, rows, now)
    forget = [move.task_id for move in moves if move.to != S.RUNNING]
    if forget:
        # A finished task is never resumed; a rerun starts from nothing.
        TaskSnapshot.objects.filter(task_id__in=forget).delete()


def _recovery_requeue(moves: Sequence[RecoveryMove], rows: Mapping[str, Mapping[str, Any]], now: datetime) -> None:
    """The responses start over, and each log says so: ``response.queued``, with the emptied response.

    A client following the stream learns there that the text it has is
    dropped: the rerun's events rebuild the output from its first item
    (docs/admin.md, "Requeues").
    """
    response_ids = [rows[move.task_id]["response_id"] for move in moves]
    Response.objects.filter(pk__in=response_ids).update(
        status=ResponseStatus.QUEUED, output=[], usage=None, updated_at=now
    )
    responses = Response.objects.in_bulk(response_ids)
    TaskEvent.objects.bulk_create(
        event_row(
            move.task_id,
            rows[move.task_id]["last_sequence"] + 1,
            event_payloads.requeued(responses[rows[move.task_id]["response_id"]]),
            now,
        )
        for move in moves
    )


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
    finals = [(move, event_payloads.finished(response)) for move, response in zip(moves, ended, strict=True)]
    TaskEvent.objects.bulk_create(
        event_row(move.task_id, rows[move.task_id]["last_sequence"] + 1, event, now) for move, event in finals
    )
    # The page's outbox rows, in the same transaction: one query for all its clients' endpoints.
    notified = [
        TaskEnd(move.task_id, row["response_id"], row["client_id"], str(event.type))
        for move, event in finals
        if (row := rows[move.task_id])["notify_webhooks"]
    ]
    webhook_deliveries_enqueue(ends=notified, now=now)
    task_ends_settle(
        ends=[
            TaskEnded(move.task_id, response, rows[move.task_id]["worker"])
            for move, response in zip(moves, ended, strict=True)
        ],
        now=now,
    )
