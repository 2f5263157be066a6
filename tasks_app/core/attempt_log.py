"""The attempt log: each attempt's row, written by the move that ends it, in that move's transaction.

An attempt opens with a claim (or an adoption to resume): the task row's
``worker``, ``attempts``, ``attempt_started_at`` and, from its first output,
``first_token_at`` describe it while it runs, so opening one and committing
its batches write nothing here. The move that lets go of it (a terminal verb,
or one of recovery's moves: the reaper, a worker's hand-back, startup, an
operator) copies those columns into a :class:`~tasks_app.models.TaskAttempt`
with how and why it ended; a rerun then starts from empty columns.

A part of the lifecycle: only its modules write task state (``tests/test_architecture.py``).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from datetime import datetime
from typing import Any

from tasks_app import events
from tasks_app.models import Task, TaskAttempt
from tasks_app.states import AttemptEnd, TaskStatus

_END_OF_EVENT: Mapping[str, AttemptEnd] = {
    events.EventType.COMPLETED: AttemptEnd.SUCCEEDED,
    events.EventType.INCOMPLETE: AttemptEnd.INCOMPLETE,
    events.EventType.FAILED: AttemptEnd.FAILED,
    events.EventType.CANCELLED: AttemptEnd.CANCELLED,
}
_END_OF_STATUS: Mapping[str, AttemptEnd] = {
    TaskStatus.SUCCEEDED: AttemptEnd.SUCCEEDED,
    TaskStatus.FAILED: AttemptEnd.FAILED,
    TaskStatus.CANCELLED: AttemptEnd.CANCELLED,
}

# The columns of a task row that describe its open attempt (what recovery reads with the row).
ATTEMPT_FIELDS = ("attempts", "worker", "attempt_started_at", "first_token_at", "output_tokens")


def error_reason(error: Mapping[str, Any] | None) -> str:
    """A failed attempt's reason: its problem's code and detail, on one line."""
    if not error:
        return ""
    code = error.get("code") or error.get("type") or ""
    detail = error.get("detail") or error.get("title") or ""
    return f"{code}: {detail}" if code and detail else str(code or detail)


def attempt_close_on_end(task: Task, terminal_event_type: str | None) -> None:
    """The task just reached its terminal status (its row as written): close its open attempt, if any.

    A task cancelled or failed while queued has none (``attempt_started_at`` is
    empty: never claimed, or its last attempt was closed when it was requeued).
    """
    if task.attempt_started_at is None or task.attempts < 1:
        return
    end = _END_OF_EVENT.get(str(terminal_event_type)) or _END_OF_STATUS[task.status]
    reason = error_reason(task.error) if end == AttemptEnd.FAILED else ""
    ended = task.finished_at or task.updated_at
    TaskAttempt.objects.create(**_row(task.pk, _fields_of(task), end=end, reason=reason, ended_at=ended))


def attempts_close(*, rows: Iterable[tuple[str, Mapping[str, Any], AttemptEnd, str]], now: datetime) -> None:
    """Recovery let go of these tasks' attempts: ``(task id, its row as read, end, reason)`` each.

    Rows without an open attempt (queued, or left running without a worker to
    be adopted) are skipped. One INSERT for the page.
    """
    attempts = [
        TaskAttempt(**_row(task_id, row, end=end, reason=reason, ended_at=now))
        for task_id, row, end, reason in rows
        if row.get("attempt_started_at") is not None and row.get("attempts", 0) >= 1
    ]
    if attempts:
        TaskAttempt.objects.bulk_create(attempts)


def _fields_of(task: Task) -> dict[str, Any]:
    return {name: getattr(task, name) for name in ATTEMPT_FIELDS}


def _row(task_id: str, row: Mapping[str, Any], *, end: AttemptEnd, reason: str, ended_at: Any) -> dict[str, Any]:
    started = row["attempt_started_at"]
    # On PostgreSQL a stamped column is the database's clock, ``ended_at`` the process's: never before the start.
    ended = ended_at if not isinstance(ended_at, datetime) or ended_at >= started else started
    return {
        "task_id": task_id,
        "number": row["attempts"],
        "worker": row["worker"] or "",
        "started_at": started,
        "first_token_at": row["first_token_at"],
        "ended_at": ended,
        "end": end,
        "reason": reason[:2000],
        "output_tokens": row["output_tokens"] or 0,
    }
