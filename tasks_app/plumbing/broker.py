"""The one door to the broker: task names, run messages, dispatch markers, and asking workers.

Web-side services (dispatch, recovery) and the workers reach Celery and the
dispatch state in Redis only through this module, so the names of the Celery
tasks and the layout of the markers are written once.

A dispatch marker (``<prefix>:dispatched:<task id>``, with a TTL) is set just
before a send (and removed again if the send fails) and cleared when a worker
takes the message. It lives in the same Redis as the queue, so when Redis
loses the queue (a restart without persistence) it loses the markers too, and
the sweeper sends again. A marker can still outlive its message (a process
killed between the marker and the send, or while it held the message before
clearing it), so the sweeper checks the markers of tasks that have waited
against the queue itself (:func:`run_messages_find`).
"""

from __future__ import annotations

import base64
import functools
import json
import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import redis
from django.conf import settings
from kombu.exceptions import KombuError

# The task names are set with the app (its beat schedule names them); callers take them from here.
from lmsp_project.celery import CLEANUP_TASK, REAP_TASK, RUN_TASK, SWEEP_TASK, app  # noqa: F401  (re-exported)
from tasks_app.plumbing.notify import key, redis_client

logger = logging.getLogger(__name__)

# What the broker's client raises when it cannot reach Redis.
UNREACHABLE = (KombuError, OSError, redis.RedisError)


def _marker(task_id: str) -> str:
    return key("dispatched", task_id)


def run_message_send(*, task_id: str, queue: str | None = None) -> None:
    """Put one run message on the workers' queue (or ``queue``: one node's, ``tasks_app.plumbing.affinity``);
    raises one of ``UNREACHABLE``."""
    app.send_task(RUN_TASK, args=[task_id], queue=queue or settings.LMSP_TASK_QUEUE, retry=False)


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


def dispatch_markers_clear(*, task_ids: Sequence[str]) -> None:
    """The messages for these tasks were never sent: their markers go, in one round trip."""
    try:
        redis_client().delete(*(_marker(task_id) for task_id in task_ids))
    except redis.RedisError as exc:
        # A marker left behind is caught by the sweeper's check against the broker.
        logger.warning("could not clear %d dispatch marker(s): %s", len(task_ids), exc)


def dispatch_markers_present(*, task_ids: Sequence[str]) -> list[bool]:
    """Which of ``task_ids`` have a marker, in one round trip; raises ``redis.RedisError``."""
    pipe = redis_client().pipeline(transaction=False)
    for task_id in task_ids:
        pipe.exists(_marker(task_id))
    return [bool(has) for has in pipe.execute()]


# The broker's layout (kombu's Redis transport): a queue is a list (LPUSH in, BRPOP out, so the
# oldest message is at its right end). A message a worker took is no longer in it: from then on the
# worker answers for the task (it cleared the marker, and claims the task or sends it again).
# Messages of the queue read per check, from the oldest; a longer queue is checked only in part.
RUN_MESSAGES_SCAN_LIMIT = 2000


@dataclass(frozen=True)
class RunMessages:
    """Task ids that have a run message waiting in the task queue."""

    task_ids: frozenset[str]
    complete: bool
    """True when the whole queue was read: an id not in ``task_ids`` has no message waiting."""


@functools.lru_cache(maxsize=1)
def _broker_redis(url: str) -> redis.Redis:
    return redis.Redis.from_url(url, socket_timeout=2, socket_connect_timeout=2)


def run_messages_find() -> RunMessages | None:
    """Which tasks have a run message waiting in the queue now, in one round trip; None when it cannot tell.

    None: the broker is not a Redis (the markers are then trusted alone), or
    it cannot be reached. Reads the oldest ``RUN_MESSAGES_SCAN_LIMIT``
    messages of the task queue.
    """
    url = settings.CELERY_BROKER_URL
    if not url.startswith(("redis://", "rediss://", "unix://")):
        return None
    queue = f"{settings.CELERY_BROKER_TRANSPORT_OPTIONS.get('global_keyprefix', '')}{settings.LMSP_TASK_QUEUE}"
    try:
        pipe = _broker_redis(url).pipeline(transaction=True)
        pipe.llen(queue)
        pipe.lrange(queue, -RUN_MESSAGES_SCAN_LIMIT, -1)
        length, waiting = pipe.execute()
    except redis.RedisError as exc:
        logger.warning("could not read the broker's queue to check dispatch markers: %s", exc)
        return None
    return RunMessages(frozenset(_run_task_ids(waiting)), complete=length <= len(waiting))


def _run_task_ids(messages: Iterable[bytes]) -> Iterable[str]:
    """The task id of every run message among ``messages`` (Celery's message protocol 2, JSON)."""
    for raw in messages:
        try:
            message = json.loads(raw)
            if message.get("headers", {}).get("task") != RUN_TASK:
                continue
            body = message["body"]
            if message.get("properties", {}).get("body_encoding") == "base64":
                body = base64.b64decode(body)
            args = json.loads(body)[0]
        except (ValueError, TypeError, KeyError, IndexError, AttributeError):
            continue  # not a message of ours
        if args and isinstance(args[0], str):
            yield args[0]


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
