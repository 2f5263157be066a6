"""What one ``GET /metrics`` reads: the metrics of the whole installation, gathered by the web process.

One scrape target serves everything (docs/metrics.md):

- from the database, one ``GROUP BY`` over the partial index ``task_active``:
  how many tasks are queued, loading, running or cancelling;
- from Redis: the finished-task counters (``HINCRBY`` by whoever wins a
  terminal move, after it commits), the Celery queues' lengths, the
  histograms every worker node adds to its own hash, and the gauges of every
  worker process's batch engines (``workers.run_metrics``);
- from this process: its open event streams.

Redis and the database are read with short timeouts and any failure only
drops that part of the answer (``lmsp_redis_up`` / ``lmsp_database_up`` say
so): a scrape never hangs and never fails. Nothing here counts rows over the
whole ``tasks`` or ``task_events`` table. ``tasks_app.metrics.exposition``
turns what was read into the answer.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field

import redis
from django.conf import settings
from django.db.models import Count, QuerySet

from tasks_app import states
from tasks_app.metrics.store import (
    GAUGE_TTL_SECONDS,
    RateLimitedWarning,
    database_unavailable_key,
    finished_key,
    metrics_redis,
    process_key,
    processes_key,
    recovery_errors_key,
    worker_key,
    workers_key,
)
from tasks_app.models import Task
from tasks_app.plumbing.querying import status_in


def active_tasks_grouped() -> QuerySet:
    """``(status, count)`` rows of the unfinished tasks: one ``GROUP BY`` over the partial index ``task_active``.

    Filtered with :func:`tasks_app.plumbing.querying.status_in`: with a plain
    ``status__in`` SQLite scans an index over every task instead (21-30 ms at
    200,000 tasks against 0.03-0.2 ms; bench/partial_indexes.py).
    """
    in_active = status_in(states.ACTIVE)
    return Task.objects.filter(in_active).values("status").annotate(n=Count("id")).order_by().values_list("status", "n")


def tasks_active_count() -> dict[str, int]:
    """Tasks per unfinished status, each status present (0 when none); one query that reads only unfinished tasks."""
    counts = dict.fromkeys(map(str, states.in_declaration_order(states.ACTIVE)), 0)
    counts.update({status: n for status, n in active_tasks_grouped()})
    return counts


@dataclass
class RedisReadout:
    """What Redis held at the scrape; ``up`` False means none of it could be read."""

    up: bool
    finished: dict[str, int] = field(default_factory=dict)
    recovery_errors: dict[str, int] = field(default_factory=dict)
    # "<process>|<reason>" -> outages; "<process>|seconds" -> their summed length
    database_unavailable: dict[str, float] = field(default_factory=dict)
    queues: dict[str, int] | None = None
    workers: dict[str, dict[str, float]] = field(default_factory=dict)
    # worker process (<node>/<pid>) -> its gauges' fields
    processes: dict[str, dict[str, float]] = field(default_factory=dict)


_read_warning = RateLimitedWarning()


def _decoded(raw: Mapping[bytes, bytes]) -> dict[str, float]:
    return {key.decode(): float(value) for key, value in raw.items()}


def metrics_redis_read() -> RedisReadout:
    """Counters, queue lengths, worker histograms and engine gauges in two round trips; never raises."""
    client = metrics_redis()
    queues = (settings.LMSP_TASK_QUEUE, settings.LMSP_MAINTENANCE_QUEUE)
    # The Celery queues live on the broker, normally the same Redis.
    same_broker = settings.CELERY_BROKER_URL == settings.REDIS_URL
    now = time.time()
    try:
        pipe = client.pipeline(transaction=False)
        pipe.hgetall(finished_key())
        pipe.hgetall(recovery_errors_key())
        pipe.hgetall(database_unavailable_key())
        pipe.zrangebyscore(workers_key(), now - settings.LMSP_METRICS_WORKER_TTL_SECONDS, "+inf")
        pipe.zrangebyscore(processes_key(), now - GAUGE_TTL_SECONDS, "+inf")
        if same_broker:
            for queue in queues:
                pipe.llen(queue)
        finished, recovery_errors, outages, nodes, processes, *lengths = pipe.execute()
        node_names = [node.decode() for node in nodes]
        process_names = [process.decode() for process in processes]
        pipe = client.pipeline(transaction=False)
        for node in node_names:
            pipe.hgetall(worker_key(node))
        for process in process_names:
            pipe.hgetall(process_key(process))
        hashes = pipe.execute() if node_names or process_names else []
        node_hashes, process_hashes = hashes[: len(node_names)], hashes[len(node_names) :]
        readout = RedisReadout(
            up=True,
            finished={key.decode(): int(value) for key, value in finished.items()},
            recovery_errors={key.decode(): int(value) for key, value in recovery_errors.items()},
            database_unavailable=_decoded(outages),
            workers={node: _decoded(raw) for node, raw in zip(node_names, node_hashes, strict=True) if raw},
            processes={name: _decoded(raw) for name, raw in zip(process_names, process_hashes, strict=True) if raw},
        )
    except (redis.RedisError, OSError, ValueError) as exc:
        # ValueError: a value that is not a number (someone wrote to our keys).
        _read_warning("metrics: Redis unreadable (%s); the scrape omits counters, queues and workers", exc)
        return RedisReadout(up=False)
    if same_broker:
        readout.queues = dict(zip(queues, map(int, lengths), strict=True))
    else:
        readout.queues = _broker_queue_lengths(queues)
    return readout


def _broker_queue_lengths(queues: tuple[str, ...]) -> dict[str, int] | None:
    """Queue lengths on a broker other than ``REDIS_URL``, if it is a Redis; None if unknown."""
    url = settings.CELERY_BROKER_URL
    if not url.startswith(("redis://", "rediss://", "unix://")):
        return None
    try:
        pipe = metrics_redis(url).pipeline(transaction=False)
        for queue in queues:
            pipe.llen(queue)
        return dict(zip(queues, map(int, pipe.execute()), strict=True))
    except (redis.RedisError, OSError) as exc:
        _read_warning("metrics: the broker is unreachable (%s); the scrape omits queue lengths", exc)
        return None


@dataclass
class Scrape:
    """Everything one ``GET /metrics`` reports."""

    active: dict[str, int] | None
    redis: RedisReadout
    open_streams: int
