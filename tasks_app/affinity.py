"""Where a continued conversation is sent: the worker that holds its prefix cache (issue 29, point 3).

A worker's engines keep the cache of the prompts and answers they ran
(``workers/backends/onnx/prefix_cache.py``), so a response that continues
another (``previous_response_id``) starts at once on the worker that ran the
one before it, and from scratch anywhere else. Each worker node consumes a
queue of its own beside the shared one (``affinity_queue``: the shared name,
``@``, the node) and, while it is alive and has a free place, keeps its
presence in Redis (``<prefix>:affinity:<node>``, the free places, a short
TTL) fresh. A continued conversation's run message goes to the queue of the
node that ran its previous response when that presence says it has room,
and to the shared queue otherwise: a node that died, is draining or is full
gets nothing routed to it.

Nothing here decides who runs a task: the message is a hint as every run
message is, and the claim's compare-and-set in the database decides. A
routed message that waits too long (its node stopped right after the
presence was read) is sent again to the shared queue by the sweeper, whose
check of the broker reads only that queue, after its grace period; the
second message is dropped by whichever claim loses.
"""

from __future__ import annotations

import logging

import redis
from django.conf import settings

from tasks_app.notify import key, redis_client

logger = logging.getLogger(__name__)

# A presence this old is gone: a node refreshes it every PRESENCE_REFRESH_SECONDS.
PRESENCE_TTL_SECONDS = 5
PRESENCE_REFRESH_SECONDS = 1.0


def node_of(worker: str) -> str:
    """The node (Celery's hostname) of a task's ``worker`` (``<node>/<pid>``)."""
    return worker.rpartition("/")[0] or worker


def affinity_queue(node: str) -> str:
    """The queue only ``node`` consumes, beside the shared task queue."""
    return f"{settings.LMSP_TASK_QUEUE}@{node}"


def _presence(node: str) -> str:
    return key("affinity", node)


def affinity_announce(*, node: str, room: int) -> None:
    """``node`` is alive with ``room`` free places (0: alive but full, nothing is routed to it)."""
    try:
        redis_client().set(_presence(node), str(max(0, room)), ex=PRESENCE_TTL_SECONDS)
    except redis.RedisError as exc:
        # Without a presence the node's conversations go to the shared queue: slower, never lost.
        logger.debug("could not announce node %s: %s", node, exc)


def affinity_withdraw(*, node: str) -> None:
    """``node`` stops: route nothing more to it."""
    try:
        redis_client().delete(_presence(node))
    except redis.RedisError:
        pass


def affinity_queue_for(*, worker: str) -> str | None:
    """The queue of the node that ran ``worker``'s task, if that node is alive and has room; else None
    (the shared queue). Never raises: without Redis there is no routing."""
    if not worker or not settings.LMSP_AFFINITY:
        return None
    node = node_of(worker)
    try:
        room = redis_client().get(_presence(node))
    except redis.RedisError:
        return None
    try:
        return affinity_queue(node) if room is not None and int(room) > 0 else None
    except ValueError:
        return None
