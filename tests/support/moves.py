"""Driving a task through the lifecycle's verbs by the status it should reach.

Tests that need a task in some status call the verb a worker, a cancel or
the API would call for that move (``move``), as one worker (``WORKER``) does.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from tasks_app.core import lifecycle
from tasks_app.core.lifecycle import TransitionResult
from tasks_app.exceptions import ServerRestarted, TransitionNotAllowed
from tasks_app.models import Task
from tasks_app.states import TaskStatus

S = TaskStatus
WORKER = "test@host/1"
ITEM_ID = "msg_test"
FAILURE = ServerRestarted("test failure").to_problem()

# The verb that makes each move, by target (cancelled has two: see _cancel).
VERB_FOR: dict[TaskStatus, str] = {
    S.LOADING: "task_claim",
    S.RUNNING: "task_start",
    S.CANCELLING: "task_request_cancel",
    S.SUCCEEDED: "task_succeed",
    S.FAILED: "task_fail",
}


def _cancel_verb(task_id: str, sources: Iterable[TaskStatus] | None) -> str:
    # The worker finishes a cancel it was asked for; a queued task is cancelled at once.
    if sources is None:
        found = {Task.objects.values_list("status", flat=True).get(pk=task_id)}
    else:
        found = set(sources)
    return "task_finish_cancel" if found == {S.CANCELLING} else "task_cancel_queued"


def move(
    task_id: str, to: TaskStatus, *, sources: Iterable[TaskStatus] | None = None, **kwargs: Any
) -> TransitionResult:
    """Make the move to ``to`` with the verb for it; ``sources`` narrows the verb's sources.

    A move the table does not have raises ``TransitionNotAllowed`` before
    anything is written, as the verb itself would.
    """
    to = TaskStatus(to)
    name = _cancel_verb(task_id, sources) if to == S.CANCELLED else VERB_FOR.get(to)
    if name is None:
        raise TransitionNotAllowed(f"no verb moves a task to {to}")
    lifecycle.MOVES[name].narrowed(sources)
    worker = kwargs.pop("worker", WORKER)
    if name == "task_claim":
        return lifecycle.task_claim(task_id=task_id, worker=worker)
    if name == "task_start":
        return lifecycle.task_start(task_id=task_id, worker=worker, item_id=kwargs.pop("item_id", ITEM_ID), **kwargs)
    if name == "task_request_cancel":
        return lifecycle.task_request_cancel(task_id=task_id, sources=sources)
    if name == "task_succeed":
        text = kwargs.pop("text", "")
        defaults = {"item_id": ITEM_ID, "text": text, "usage": None, "output_tokens": 0}
        return lifecycle.task_succeed(task_id=task_id, worker=worker, **(defaults | kwargs))
    if name == "task_fail":
        return lifecycle.task_fail(task_id=task_id, error=kwargs.pop("error", FAILURE), sources=sources, **kwargs)
    if name == "task_finish_cancel":
        return lifecycle.task_finish_cancel(task_id=task_id, worker=worker, **kwargs)
    return lifecycle.task_cancel_queued(task_id=task_id)


def progress(task_id: str, deltas: Iterable[str], **kwargs: Any) -> TransitionResult:
    """One batch of deltas from ``WORKER`` (output tokens counted one per delta unless given)."""
    deltas = list(deltas)
    kwargs.setdefault("output_tokens", len(deltas))
    kwargs.setdefault("item_id", ITEM_ID)
    kwargs.setdefault("worker", WORKER)
    return lifecycle.task_progress(task_id=task_id, deltas=deltas, **kwargs)
