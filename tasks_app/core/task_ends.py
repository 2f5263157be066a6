"""What a task's end settles beyond its own rows, in the transaction that ends it.

Both ways a task ends call :func:`task_ends_settle`: a terminal verb
(``transitions``) and recovery's page of failed tasks (``recovery_moves``).
So whatever a finished response adds elsewhere (a conversation's items, a
batch line's result) commits with its terminal event, or not at all.

A part of the lifecycle: only its modules write task state (``tests/test_architecture.py``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime

from tasks_app.core.batch_log import batch_lines_settle
from tasks_app.core.conversation_log import conversation_items_settle
from tasks_app.models import Response


@dataclass(frozen=True)
class TaskEnded:
    """A task whose end the caller's transaction writes: its response as it ends, and the worker that ran it."""

    task_id: str
    response: Response
    worker: str


def task_ends_settle(*, ends: Sequence[TaskEnded], now: datetime) -> None:
    """Settle what the ended tasks' responses add elsewhere, inside the caller's transaction."""
    in_conversations = [end for end in ends if end.response.conversation_id]
    if in_conversations:
        conversation_items_settle(ends=[(end.response, end.worker) for end in in_conversations], now=now)
    in_batches = [(end.task_id, end.response) for end in ends if end.response.batch_id]
    if in_batches:
        batch_lines_settle(ends=in_batches, now=now)
