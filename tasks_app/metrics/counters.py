"""The installation's counters in Redis, added to by whoever saw the event, after it committed.

Finished tasks (by terminal status), recovery errors (by where recovery ran)
and database outages (by process and reason, and their length). Each add is
one pipeline that never raises: a failure is logged (rate-limited) and the
count dropped.
"""

from __future__ import annotations

import redis
from django.conf import settings

from tasks_app.metrics.store import (
    RateLimitedWarning,
    database_unavailable_key,
    finished_key,
    metrics_redis,
    recovery_errors_key,
)

_finished_warning = RateLimitedWarning()


def task_finished_count(*, status: str, count: int = 1) -> None:
    """Add ``count`` to the finished-task counter of ``status``; called after the terminal moves commit.

    A failure is logged (rate-limited) and dropped: the counter then misses
    that task, which Prometheus reads as a slightly lower rate, never as an error.
    """
    _counter_add(finished_key(), status, count, what="a finished task")


def _counter_add(key: str, name: str, count: float, *, what: str) -> None:
    try:
        pipe = metrics_redis().pipeline(transaction=False)
        if isinstance(count, int):
            pipe.hincrby(key, name, count)
        else:
            pipe.hincrbyfloat(key, name, count)
        # Nothing of an installation lingers once it is gone (a test run, a renamed prefix).
        pipe.expire(key, settings.LMSP_METRICS_WORKER_TTL_SECONDS)
        pipe.execute()
    except (redis.RedisError, OSError) as exc:
        _finished_warning(f"could not count {what} in Redis: %s", exc)


def recovery_error_count(*, source: str, count: int = 1) -> None:
    """Add ``count`` tasks whose recovery raised at ``source``; never raises (as :func:`task_finished_count`)."""
    _counter_add(recovery_errors_key(), source, count, what="a recovery error")


def database_unavailable_count(*, process: str, reason: str) -> None:
    """One more outage seen by a ``process``, as it started (``reason``); never raises."""
    _counter_add(database_unavailable_key(), f"{process}|{reason}", 1, what="a database outage")


def database_unavailable_seconds_add(*, process: str, seconds: float) -> None:
    """Add an ended outage's length, as ``process`` saw it; never raises."""
    _counter_add(database_unavailable_key(), f"{process}|seconds", float(seconds), what="a database outage's length")
