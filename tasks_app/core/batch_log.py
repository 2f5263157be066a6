"""A batch's lines as they start and end (docs/batches.md): the one writer of a line's state and its batch's counts.

``batch_lines_settle`` runs in the transaction that ends a line's task
(``core/task_ends``): the line is marked ended with its outcome and its
batch's ``completed`` or ``failed`` grows by one, or neither happens. The
lines that end without a task (refused when the batch was created, never sent
before a cancel or the window's end) end through ``batch_lines_end``, in the
caller's transaction. Each move is a compare-and-set on the line's state, so
a line is counted once however often its end is reported. The result goes
into the output or error file later, outside any transaction
(``services/batch_output``).

A part of the lifecycle: only its modules write task state (``tests/test_architecture.py``).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

from django.db import transaction
from django.db.models import F

from tasks_app.models import (
    Batch,
    BatchLine,
    BatchLineOutcome,
    BatchLineState,
    BatchStatus,
    Response,
)
from tasks_app.plumbing.notify import batch_lines_ended_on_commit
from tasks_app.states import ResponseStatus

O = BatchLineOutcome  # noqa: E741
_SUCCEEDED = {ResponseStatus.COMPLETED, ResponseStatus.INCOMPLETE}


def _counted(batch_id: str, outcomes: Counter[str], tokens: Counter[str] | None = None) -> None:
    completed = outcomes[O.COMPLETED]
    failed = sum(outcomes.values()) - completed
    if completed or failed:
        grown = {column: F(column) + count for column, count in (tokens or {}).items() if count}
        Batch.objects.filter(pk=batch_id).update(
            completed=F("completed") + completed, failed=F("failed") + failed, **grown
        )


def _tokens(usage: Mapping[str, Any] | None) -> Counter[str]:
    """A line's usage as the batch's token columns (a task that ended before its prompt was counted: none)."""
    if not usage:
        return Counter()
    details = usage.get("input_tokens_details") or {}
    return Counter(
        input_tokens=int(usage.get("input_tokens") or 0),
        cached_tokens=int(details.get("cached_tokens") or 0),
        output_tokens=int(usage.get("output_tokens") or 0),
    )


def batch_lines_end(
    *, batch_id: str, line_ids: Sequence[int], outcome: BatchLineOutcome, error: Mapping[str, Any] | None = None
) -> int:
    """End lines of ``batch_id`` that have no running task (pending ones, or sent ones whose task is gone),
    in the caller's transaction; returns how many it ended (those already ended are left as they are)."""
    with transaction.atomic(savepoint=False):
        ended = BatchLine.objects.filter(
            batch_id=batch_id, pk__in=list(line_ids), state__in=[BatchLineState.PENDING, BatchLineState.SENT]
        ).update(state=BatchLineState.ENDED, outcome=outcome, error=dict(error) if error is not None else None)
        _counted(batch_id, Counter({str(outcome): ended}))
    return ended


def batch_lines_settle(*, ends: Sequence[tuple[str, Response]], now: datetime) -> None:
    """In the transaction that ends these tasks (batch lines all): their lines end, their batches count them.

    A task cancelled while its batch runs out its window (``finalizing``) is an
    expired line; cancelled otherwise.
    """
    by_task = {task_id: response for task_id, response in ends}
    lines = list(
        BatchLine.objects.filter(task_id__in=list(by_task), state=BatchLineState.SENT).values_list(
            "pk", "batch_id", "task_id"
        )
    )
    if not lines:
        return
    statuses = dict(Batch.objects.filter(pk__in={batch for _, batch, _ in lines}).values_list("pk", "status"))
    counts: dict[str, Counter[str]] = {}
    tokens: dict[str, Counter[str]] = {}
    for pk, batch_id, task_id in lines:
        outcome = _outcome(by_task[task_id].status, statuses.get(batch_id))
        if BatchLine.objects.filter(pk=pk, state=BatchLineState.SENT).update(
            state=BatchLineState.ENDED, outcome=outcome
        ):
            counts.setdefault(batch_id, Counter())[outcome] += 1
            tokens.setdefault(batch_id, Counter()).update(_tokens(by_task[task_id].usage))
    for batch_id, outcomes in counts.items():
        _counted(batch_id, outcomes, tokens.get(batch_id))
    if counts:
        # The keeper sends the next lines and writes these results now, not at its next poll.
        batch_lines_ended_on_commit()


def _outcome(response_status: str, batch_status: str | None) -> BatchLineOutcome:
    if response_status in _SUCCEEDED:
        return O.COMPLETED
    if response_status == ResponseStatus.CANCELLED:
        return O.EXPIRED if batch_status == BatchStatus.FINALIZING else O.CANCELLED
    return O.FAILED


def batch_line_sent(*, line_id: int, task_id: str) -> bool:
    """In the caller's transaction, which inserted the line's task (``Response.batch_id`` naming the batch, so
    that its end finds its way here): the line is sent. False when it was not pending any more (another
    keeper sent it): the caller rolls its task back."""
    return bool(
        BatchLine.objects.filter(pk=line_id, state=BatchLineState.PENDING).update(
            state=BatchLineState.SENT, task_id=task_id
        )
    )
