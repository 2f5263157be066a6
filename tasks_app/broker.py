"""The one door to the broker: task names, run messages, dispatch markers, and asking workers.

Web-side services (dispatch, recovery) and the workers reach Celery and the
dispatch state in Redis only through this module, so the names of the Celery
tasks and the layout of the markers are written once.

A dispatch marker (``<prefix>:dispatched:<task id>``, with a TTL) is set after
a successful send and cleared when a worker takes the message. It lives in the
same Redis as the queue, so when Redis loses the queue (a restart without
persistence) it loses the markers too, and the sweeper sends again.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import redis
from django.conf import settings
from kombu.exceptions import KombuError

from lmsp_project.celery import app
from tasks_app.notify import key, redis_client

logger = logging.getLogger(__name__)

RUN_TASK = "lmsp.run_task"
"""Runs one task: its only argument is the task id."""
SWEEP_TASK = "lmsp.sweep_queued"
"""Re-sends waiting tasks whose message may be lost."""
REAP_TASK = "lmsp.reap_abandoned"
"""Applies the restart policy to tasks whose worker stopped reporting."""
CLEANUP_TASK = "lmsp.cleanup"
"""Deletes what retention no longer keeps."""

# What the broker's client raises when it cannot reach Redis.
UNREACHABLE = (KombuError, OSError, redis.RedisError)


def _marker(task_id: str) -> str:
    return key("dispatched", task_id)


def run_message_send(*, task_id: str) -> None:
    """Put one run message on the workers' queue; raises one of ``UNREACHABLE``."""
    app.send_task(RUN_TASK, args=[task_id], queue=settings.LMSP_TASK_QUEUE, retry=False)


def dispatch_marker_set(*, task_id: str) -> None:
    """A message for the task is on the queue (for the marker's TTL)."""
    try:
        redis_client().set(_marker(task_id), "1", ex=settings.LMSP_DISPATCH_MARKER_TTL_SECONDS)
    except redis.RedisError as exc:
        # No marker only means the sweeper sends a duplicate, which is dropped.
        logger.warning("could not mark task %s as dispatched: %s", task_id, exc)


def dispatch_markers_set(*, task_ids: Sequence[str]) -> None:
    """Messages for these tasks are on the queue: their markers in one round trip."""
    pipe = redis_client().pipeline(transaction=False)
    for task_id in task_ids:
        pipe.set(_marker(task_id), "1", ex=settings.LMSP_DISPATCH_MARKER_TTL_SECONDS)
    try:
        pipe.execute()
    except redis.RedisError as exc:
        logger.warning("could not mark %d task(s) as dispatched: %s", len(task_ids), exc)


def dispatch_marker_clear(*, task_id: str) -> None:
    """A worker took the message: from now on the task's status says what happens."""
    try:
        redis_client().delete(_marker(task_id))
    except redis.RedisError:
        pass


def dispatch_markers_present(*, task_ids: Sequence[str]) -> list[bool]:
    """Which of ``task_ids`` have a marker, in one round trip; raises ``redis.RedisError``."""
    pipe = redis_client().pipeline(transaction=False)
    for task_id in task_ids:
        pipe.exists(_marker(task_id))
    return [bool(has) for has in pipe.execute()]


@dataclass(frozen=True)
class WorkerReport:
    """What the workers consuming this installation's queue answered in time."""

    nodes: frozenset[str]
    """Nodes that consume the queue."""
    running: dict[str, list[str]]
    """Per node that answered in time, the ids of the tasks it runs."""


def workers_ask(*, timeout: float) -> WorkerReport:
    """Ask every worker on the broker what it consumes and runs; raises one of ``UNREACHABLE``."""
    queues = app.control.inspect(timeout=timeout).active_queues() or {}
    ours = settings.LMSP_TASK_QUEUE
    nodes = frozenset(node for node, consumed in queues.items() if any(q.get("name") == ours for q in consumed))
    active: dict[str, Any] = {}
    if nodes:
        active = app.control.inspect(destination=sorted(nodes), timeout=timeout, limit=len(nodes)).active() or {}
    running = {
        node: [
            str(request["args"][0]) for request in requests if request.get("name") == RUN_TASK and request.get("args")
        ]
        for node, requests in active.items()
    }
    return WorkerReport(nodes=nodes, running=running)
