"""Wake-ups over Redis pub/sub, sent only after the transaction they describe commits.

The database is the only source of truth; a message here says "task X changed,
look again" and nothing more. Losing one (Redis down, a subscriber not yet
listening) costs latency, never data: every reader also checks the database.
So a failed publish is logged and swallowed, and never fails a request.
"""

from __future__ import annotations

import json
import logging
from collections import Counter
from collections.abc import Sequence
from functools import partial
from typing import Any

import redis
from django.conf import settings
from django.db import transaction

from tasks_app import states
from tasks_app.metrics.counters import task_finished_count

logger = logging.getLogger(__name__)

_clients: dict[str, redis.Redis] = {}


def redis_client() -> redis.Redis:
    """One client (and connection pool) per Redis URL per process.

    redis-py notices a fork and opens new connections in the child, so a
    client made before Celery forks its pool is safe to use after.
    """
    url = settings.REDIS_URL
    client = _clients.get(url)
    if client is None:
        client = redis.Redis.from_url(url, socket_connect_timeout=1, socket_timeout=2, health_check_interval=30)
        _clients[url] = client
    return client


def key(*parts: str) -> str:
    """A Redis key or channel name under this installation's prefix."""
    return ":".join((settings.LMSP_REDIS_PREFIX, *parts))


def tasks_channel() -> str:
    return key("tasks")


def webhooks_channel() -> str:
    return key("webhooks")


def batches_channel() -> str:
    return key("batches")


def publish(channel: str, message: dict[str, Any]) -> bool:
    try:
        redis_client().publish(channel, json.dumps(message, separators=(",", ":")))
    except redis.RedisError as exc:
        logger.warning("could not publish to %s: %s", channel, exc)
        return False
    return True


def task_changed_on_commit(task_id: str, status: str, last_sequence: int) -> None:
    """After the current transaction commits, tell subscribers that a task moved or grew."""
    message = {"task_id": task_id, "status": status, "last_sequence": last_sequence}
    transaction.on_commit(partial(publish, tasks_channel(), message))
    if status in states.TERMINAL:
        # Only the one winning terminal move gets here (a worker, a cancel,
        # recovery or the reaper), so each task is counted once.
        transaction.on_commit(partial(task_finished_count, status=status))


def webhooks_due_on_commit() -> None:
    """After the current transaction commits, wake the webhook deliverers: some delivery is due now."""
    transaction.on_commit(partial(publish, webhooks_channel(), {"due": True}))


def batch_lines_ended_on_commit() -> None:
    """After the current transaction commits, wake the batch keepers: a line ended, its row in the engine is free."""
    transaction.on_commit(partial(publish, batches_channel(), {"ended": True}))


def tasks_changed_on_commit(changes: Sequence[tuple[str, str, int]]) -> None:
    """:func:`task_changed_on_commit` for many ``(task id, status, last_sequence)``, in one message."""
    if not changes:
        return
    message = {"changes": [list(change) for change in changes]}
    transaction.on_commit(partial(publish, tasks_channel(), message))
    finished = Counter(status for _, status, _ in changes if status in states.TERMINAL)
    for status, count in finished.items():
        transaction.on_commit(partial(task_finished_count, status=status, count=count))
