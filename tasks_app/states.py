"""The vocabulary of task state, once: statuses, their named groups, and the two tables.

In the manner of Celery's ``states.py``: every other module imports a status,
a group or a table from here, and none spells out a set of statuses itself.
``tasks_app.core.lifecycle`` applies the tables; this module only states them.

Groups are frozensets, for membership tests. Where SQL needs a group written
out in a fixed order (the partial indexes' predicates, which SQLite compares
term by term, see ``querying``), :func:`in_declaration_order` gives it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from django.db import models


class TaskStatus(models.TextChoices):
    QUEUED = "queued", "queued"
    """Accepted and persisted; waits for a worker."""
    LOADING = "loading", "loading"
    """A worker claimed the task and is loading its model."""
    RUNNING = "running", "running"
    """The model generates."""
    CANCELLING = "cancelling", "cancelling"
    """Cancel was requested; the backend has not stopped yet."""
    SUCCEEDED = "succeeded", "succeeded"
    """Terminal: the response is complete (or incomplete at a token limit)."""
    FAILED = "failed", "failed"
    """Terminal: the task failed; ``error`` holds the problem object."""
    CANCELLED = "cancelled", "cancelled"
    """Terminal: the task was cancelled."""


class RestartPolicy(models.TextChoices):
    FAIL = "fail", "fail"
    """An unfinished task found at startup fails with ``server_restarted``."""
    RETRY = "retry", "retry"
    """An unfinished task found at startup runs again from the start."""
    RESUME = "resume", "resume"
    """An unfinished task found at startup continues from its snapshot."""


class Protocol(models.TextChoices):
    """The protocol a response's request came in: the shape of ``Response.request``.

    ``lmsp``: LMSP's own response request (``POST /responses``, a task's
    ``input``, and a Chat Completions request translated into it); the
    response object echoes it. Any other: the request as that protocol's
    client sent it; the response object echoes its generation spec.
    """

    LMSP = "lmsp", "LMSP / OpenAI"
    ANTHROPIC = "anthropic", "Anthropic Messages"
    OLLAMA = "ollama", "Ollama"


class ResponseStatus(models.TextChoices):
    QUEUED = "queued", "queued"
    """The response waits for its task to start."""
    IN_PROGRESS = "in_progress", "in_progress"
    """The model is producing output."""
    COMPLETED = "completed", "completed"
    """Finished normally."""
    INCOMPLETE = "incomplete", "incomplete"
    """Stopped at a limit (``incomplete_details`` says which)."""
    FAILED = "failed", "failed"
    """Stopped by an error (``error`` holds the problem object)."""
    CANCELLED = "cancelled", "cancelled"
    """Stopped by a cancel."""


class AttemptEnd(models.TextChoices):
    """How an attempt (a worker's claim or adoption of a task, to its release) ended."""

    SUCCEEDED = "succeeded", "succeeded"
    """The task succeeded (its response completed)."""
    INCOMPLETE = "incomplete", "succeeded, incomplete"
    """The task succeeded at a limit (its response is incomplete)."""
    FAILED = "failed", "failed"
    """The task failed (the attempt's reason is its error)."""
    CANCELLED = "cancelled", "cancelled"
    """A cancel stopped it."""
    REAPED = "reaped", "reaped"
    """Its worker stopped writing heartbeats, and the reaper applied the task's policy."""
    HANDED_BACK = "handed_back", "handed back by its worker"
    """Its worker let go of it unfinished (a shutdown's drain ran out, its engine process was lost)."""
    WORKER_DIED = "worker_died", "its worker process died"
    """Celery reported the pool process running it dead."""
    RECOVERED = "recovered", "recovered at startup"
    """Startup recovery found it held by no live worker."""
    OPERATOR = "operator", "handed back by an operator"
    """An operator handed it back from the admin, its worker gone."""


S = TaskStatus
R = RestartPolicy

# --------------------------------------------------------------------------- #
# Named groups
# --------------------------------------------------------------------------- #

TERMINAL: frozenset[TaskStatus] = frozenset({S.SUCCEEDED, S.FAILED, S.CANCELLED})
"""Finished: no move leaves these, and each has exactly one terminal event."""
ACTIVE: frozenset[TaskStatus] = frozenset({S.QUEUED, S.LOADING, S.RUNNING, S.CANCELLING})
"""Unfinished: what recovery, the sweeper and the queue count look at."""
HELD: frozenset[TaskStatus] = frozenset({S.LOADING, S.RUNNING, S.CANCELLING})
"""A worker holds the task: it has a ``worker`` and writes heartbeats."""
ORPHANABLE: frozenset[TaskStatus] = frozenset({S.RUNNING, S.CANCELLING})
"""With an empty ``worker``, the task waits for a worker to adopt and resume it."""
CANCELABLE_AT_ONCE: frozenset[TaskStatus] = frozenset({S.QUEUED})
"""A cancel ends these itself: nothing runs yet."""
CANCELABLE_VIA_BACKEND: frozenset[TaskStatus] = frozenset({S.LOADING, S.RUNNING})
"""A cancel only asks (``cancelling``); the worker stops the backend and ends the task."""
CANCEL_UNDER_WAY: frozenset[TaskStatus] = frozenset({S.CANCELLING, S.CANCELLED})
"""A cancel has already won: a second one changes nothing."""
RERUNNABLE: frozenset[TaskStatus] = frozenset({S.FAILED, S.CANCELLED})
"""An operator may run these again (a new task from the same request): they gave their client no answer."""
MAY_HAVE_OUTPUT: frozenset[TaskStatus] = frozenset({S.RUNNING, S.CANCELLING})
"""An attempt found here may have shown text: a task that ends from here keeps what its deltas hold."""

RESPONSE_UNFINISHED: frozenset[ResponseStatus] = frozenset({ResponseStatus.QUEUED, ResponseStatus.IN_PROGRESS})
"""A response whose task has not ended (what makes its conversation busy)."""

# The response status each task status implies, where it implies one
# (``succeeded`` implies one of SUCCESS_RESPONSE; ``loading`` and
# ``cancelling`` leave the response as it was).
RESPONSE_STATUS: Mapping[TaskStatus, ResponseStatus] = {
    S.QUEUED: ResponseStatus.QUEUED,
    S.RUNNING: ResponseStatus.IN_PROGRESS,
    S.FAILED: ResponseStatus.FAILED,
    S.CANCELLED: ResponseStatus.CANCELLED,
}


def in_declaration_order(statuses: Iterable[str]) -> tuple[TaskStatus, ...]:
    """``statuses`` as a tuple in ``TaskStatus`` order: one set always gives the same SQL."""
    wanted = {TaskStatus(status) for status in statuses}
    return tuple(status for status in TaskStatus if status in wanted)


# --------------------------------------------------------------------------- #
# Chapter 7.2: the moves of a task's life
# --------------------------------------------------------------------------- #

TRANSITIONS: Mapping[TaskStatus, frozenset[TaskStatus]] = {
    S.QUEUED: frozenset({S.LOADING, S.CANCELLED, S.FAILED}),
    S.LOADING: frozenset({S.RUNNING, S.CANCELLING, S.FAILED}),
    S.RUNNING: frozenset({S.SUCCEEDED, S.FAILED, S.CANCELLING}),
    S.CANCELLING: frozenset({S.CANCELLED}),
    S.SUCCEEDED: frozenset(),
    S.FAILED: frozenset(),
    S.CANCELLED: frozenset(),
}


def sources_for(to: TaskStatus) -> frozenset[TaskStatus]:
    """Every status from which chapter 7.2 allows a move to ``to``."""
    return frozenset(src for src, targets in TRANSITIONS.items() if to in targets)


# --------------------------------------------------------------------------- #
# Chapter 11.3: where a leftover task goes, by status found and policy
# --------------------------------------------------------------------------- #

RECOVERY: Mapping[TaskStatus, Mapping[RestartPolicy, TaskStatus]] = {
    S.QUEUED: {R.FAIL: S.FAILED, R.RETRY: S.QUEUED, R.RESUME: S.QUEUED},
    S.LOADING: {R.FAIL: S.FAILED, R.RETRY: S.QUEUED, R.RESUME: S.QUEUED},
    S.RUNNING: {R.FAIL: S.FAILED, R.RETRY: S.QUEUED, R.RESUME: S.RUNNING},
    S.CANCELLING: {R.FAIL: S.CANCELLED, R.RETRY: S.CANCELLED, R.RESUME: S.CANCELLED},
}
# Besides its cell, recovery may fail a task it would otherwise run again
# (its attempts are used up), except a cancelling one, whose cancel wins.
RECOVERY_ESCAPE: Mapping[TaskStatus, frozenset[TaskStatus]] = {
    S.QUEUED: frozenset({S.FAILED}),
    S.LOADING: frozenset({S.FAILED}),
    S.RUNNING: frozenset({S.FAILED}),
    S.CANCELLING: frozenset(),
}


RUNS_AGAIN: frozenset[TaskStatus] = frozenset({S.QUEUED, S.RUNNING})
"""Recovery targets after which the task runs again: it is dispatched to the workers."""


def recovery_target(status: TaskStatus, policy: RestartPolicy) -> TaskStatus:
    """The cell of chapter 11.3 for a task found in ``status`` with ``policy``."""
    return RECOVERY[TaskStatus(status)][RestartPolicy(policy)]


def recovery_allows(found: TaskStatus, to: TaskStatus) -> bool:
    """Whether recovery may move a task found in ``found`` to ``to`` (its cells, or the escape)."""
    found, to = TaskStatus(found), TaskStatus(to)
    return found in RECOVERY and (to in RECOVERY[found].values() or to in RECOVERY_ESCAPE[found])
