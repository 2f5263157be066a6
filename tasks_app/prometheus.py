"""Prometheus metrics of the whole installation, gathered by the web process for ``GET /metrics``.

One scrape target serves everything (docs/metrics.md):

- from the database, one ``GROUP BY`` over the partial index ``task_active``:
  how many tasks are queued, loading, running or cancelling;
- from Redis: the finished-task counters (``HINCRBY`` by whoever wins a
  terminal move, after it commits), the Celery queues' lengths, and the
  histograms every worker node adds to its own hash (``workers.run_metrics``);
- from this process: its open event streams.

Redis and the database are read with short timeouts and any failure only
drops that part of the answer (``lmsp_redis_up`` / ``lmsp_database_up`` say
so): a scrape never hangs and never fails. Nothing here counts rows over the
whole ``tasks`` or ``task_events`` table.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field

import redis
from django.conf import settings
from django.db.models import Count, QuerySet
from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.exposition import choose_encoder
from prometheus_client.utils import floatToGoString
from redis.backoff import NoBackoff
from redis.retry import Retry

from tasks_app import states
from tasks_app.models import Task
from tasks_app.querying import status_in
from tasks_app.states import TaskStatus

logger = logging.getLogger(__name__)

# Every Redis call of metrics (the scrape's reads, the counters' and workers'
# writes) gives up after this long and is never retried: a metric lost to an
# outage is acceptable, a scrape or a generation that waits for Redis is not.
REDIS_TIMEOUT_SECONDS = 1.0
# A Redis failure is logged at most this often per process.
WARNING_INTERVAL_SECONDS = 60.0


@dataclass(frozen=True)
class HistogramSpec:
    """A histogram that workers record and the scrape exposes with a ``worker`` label."""

    name: str
    help: str
    buckets: tuple[float, ...]

    def bucket_of(self, value: float) -> float:
        """The upper bound of the bucket ``value`` falls in (``inf`` past the last)."""
        for bound in self.buckets:
            if value <= bound:
                return bound
        return math.inf


# Bounds chosen for local serving: a first token within tens of milliseconds
# (a warm small model) up to minutes (a queue, a large model loading); a few
# tokens per second (a big model on a CPU) up to thousands (a tiny one).
TIME_TO_FIRST_TOKEN = HistogramSpec(
    "lmsp_time_to_first_token_seconds",
    "From the task's acceptance (created_at) to its first generated token: queue wait, model load and prefill.",
    (0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600),
)
CLAIM_TO_FIRST_TOKEN = HistogramSpec(
    "lmsp_claim_to_first_token_seconds",
    "From a worker's claim of a task to its first generated token: model load (or cache hit) and prefill.",
    (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300),
)
TOKENS_PER_SECOND = HistogramSpec(
    "lmsp_generation_tokens_per_second",
    "Decode speed of one generation: tokens after the first divided by the time from the first to the last.",
    (1, 2.5, 5, 10, 20, 30, 50, 75, 100, 150, 200, 300, 500, 1000, 2500, 5000, 10000),
)
CANCEL_LATENCY = HistogramSpec(
    "lmsp_cancel_latency_seconds",
    "From the committed move to cancelling to the worker's committed move to cancelled.",
    (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
)
BATCH_EVENTS = HistogramSpec(
    "lmsp_event_batch_events",
    "Events written by one commit of a generation (a batch of deltas, or the final commit).",
    (1, 2, 4, 8, 12, 16, 20, 24, 32, 48, 64, 128, 256),
)
BATCH_TOKENS = HistogramSpec(
    "lmsp_event_batch_tokens",
    "Generated tokens one commit of a generation accounts for; the sum is every token committed.",
    (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 128, 256),
)
WORKER_HISTOGRAMS: tuple[HistogramSpec, ...] = (
    TIME_TO_FIRST_TOKEN,
    CLAIM_TO_FIRST_TOKEN,
    TOKENS_PER_SECOND,
    CANCEL_LATENCY,
    BATCH_EVENTS,
    BATCH_TOKENS,
)


# --------------------------------------------------------------------------- #
# Redis layout (all under LMSP_REDIS_PREFIX)
# --------------------------------------------------------------------------- #


def metrics_key(*parts: str) -> str:
    return ":".join((settings.LMSP_REDIS_PREFIX, "metrics", *parts))


def finished_key() -> str:
    """Hash: terminal status -> tasks that reached it."""
    return metrics_key("finished")


def workers_key() -> str:
    """Sorted set: worker node name -> unix time of its newest report."""
    return metrics_key("workers")


def worker_key(node: str) -> str:
    """Hash of one node's histograms: ``<name>:le:<bound>`` (not cumulative), ``<name>:sum``, ``<name>:count``."""
    return metrics_key("worker", node)


def bucket_field(spec: HistogramSpec, bound: float) -> str:
    return f"{spec.name}:le:{floatToGoString(bound)}"


_clients: dict[str, redis.Redis] = {}
_clients_lock = threading.Lock()


def metrics_redis(url: str | None = None) -> redis.Redis:
    """A client for metrics only: short timeouts and no retries (unlike the wake-ups' client)."""
    url = url or settings.REDIS_URL
    with _clients_lock:
        client = _clients.get(url)
        if client is None:
            client = redis.Redis.from_url(
                url,
                socket_connect_timeout=REDIS_TIMEOUT_SECONDS,
                socket_timeout=REDIS_TIMEOUT_SECONDS,
                retry=Retry(NoBackoff(), 0),
            )
            _clients[url] = client
    return client


class RateLimitedWarning:
    """Logs a recurring failure once per interval, with how often it happened meanwhile."""

    def __init__(self, log: logging.Logger | None = None, interval: float = WARNING_INTERVAL_SECONDS) -> None:
        self.log = log or logger
        self.interval = interval
        self._last = -math.inf
        self._suppressed = 0
        self._lock = threading.Lock()

    def __call__(self, message: str, *args: object) -> None:
        now = time.monotonic()
        with self._lock:
            if now - self._last < self.interval:
                self._suppressed += 1
                return
            suppressed, self._suppressed, self._last = self._suppressed, 0, now
        if suppressed:
            message += f" ({suppressed} more since the last warning)"
        self.log.warning(message, *args)


_finished_warning = RateLimitedWarning()


def task_finished_count(*, status: str, count: int = 1) -> None:
    """Add ``count`` to the finished-task counter of ``status``; called after the terminal moves commit.

    A failure is logged (rate-limited) and dropped: the counter then misses
    that task, which Prometheus reads as a slightly lower rate, never as an error.
    """
    try:
        pipe = metrics_redis().pipeline(transaction=False)
        pipe.hincrby(finished_key(), status, count)
        # Nothing of an installation lingers once it is gone (a test run, a renamed prefix).
        pipe.expire(finished_key(), settings.LMSP_METRICS_WORKER_TTL_SECONDS)
        pipe.execute()
    except (redis.RedisError, OSError) as exc:
        _finished_warning("could not count a finished task in Redis: %s", exc)


# --------------------------------------------------------------------------- #
# What a scrape reads
# --------------------------------------------------------------------------- #


def active_tasks_grouped() -> QuerySet:
    """``(status, count)`` rows of the unfinished tasks: one ``GROUP BY`` over the partial index ``task_active``.

    Filtered with :func:`tasks_app.querying.status_in`: with a plain
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
    queues: dict[str, int] | None = None
    workers: dict[str, dict[str, float]] = field(default_factory=dict)


_read_warning = RateLimitedWarning()


def _decoded(raw: Mapping[bytes, bytes]) -> dict[str, float]:
    return {key.decode(): float(value) for key, value in raw.items()}


def metrics_redis_read() -> RedisReadout:
    """Counters, queue lengths and worker histograms in two round trips; never raises."""
    client = metrics_redis()
    queues = (settings.LMSP_TASK_QUEUE, settings.LMSP_MAINTENANCE_QUEUE)
    # The Celery queues live on the broker, normally the same Redis.
    same_broker = settings.CELERY_BROKER_URL == settings.REDIS_URL
    oldest = time.time() - settings.LMSP_METRICS_WORKER_TTL_SECONDS
    try:
        pipe = client.pipeline(transaction=False)
        pipe.hgetall(finished_key())
        pipe.zrangebyscore(workers_key(), oldest, "+inf")
        if same_broker:
            for queue in queues:
                pipe.llen(queue)
        finished, nodes, *lengths = pipe.execute()
        names = [node.decode() for node in nodes]
        pipe = client.pipeline(transaction=False)
        for node in names:
            pipe.hgetall(worker_key(node))
        hashes = pipe.execute() if names else []
        readout = RedisReadout(
            up=True,
            finished={key.decode(): int(value) for key, value in finished.items()},
            workers={node: _decoded(raw) for node, raw in zip(names, hashes, strict=True) if raw},
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


# --------------------------------------------------------------------------- #
# Exposition
# --------------------------------------------------------------------------- #


def _worker_histogram(spec: HistogramSpec, workers: Mapping[str, Mapping[str, float]]) -> HistogramMetricFamily:
    family = HistogramMetricFamily(spec.name, spec.help, labels=["worker"])
    prefix = f"{spec.name}:le:"
    for node, fields in sorted(workers.items()):
        count = fields.get(f"{spec.name}:count")
        if count is None:
            continue
        per_bound = dict.fromkeys(spec.buckets, 0.0)
        for name, value in fields.items():
            if name.startswith(prefix):
                # A bound recorded by another version still adds up; +Inf is the count.
                bound = float(name[len(prefix) :])
                per_bound[bound] = per_bound.get(bound, 0.0) + value
        buckets, running = [], 0.0
        for bound in sorted(b for b in per_bound if b != math.inf):
            running += per_bound[bound]
            buckets.append((floatToGoString(bound), running))
        buckets.append(("+Inf", count))
        family.add_metric([node], buckets, fields.get(f"{spec.name}:sum", 0.0))
    return family


class ScrapeCollector:
    """Turns one :class:`Scrape` into metric families (a collector for a registry of our own)."""

    def __init__(self, scrape: Scrape) -> None:
        self.scrape = scrape

    def collect(self) -> Iterator[Metric]:
        scrape, readout = self.scrape, self.scrape.redis
        yield GaugeMetricFamily(
            "lmsp_database_up",
            "1 if this scrape could count the active tasks in the database.",
            int(scrape.active is not None),
        )
        yield GaugeMetricFamily("lmsp_redis_up", "1 if this scrape could read Redis (REDIS_URL).", int(readout.up))
        if scrape.active is not None:
            active = GaugeMetricFamily(
                "lmsp_tasks_active", "Unfinished tasks by status (exact, from the database).", labels=["status"]
            )
            for status, count in scrape.active.items():
                active.add_metric([status], count)
            yield active
            yield GaugeMetricFamily(
                "lmsp_queue_depth",
                "Tasks accepted and waiting for a worker (status queued, from the database).",
                scrape.active[TaskStatus.QUEUED],
            )
        if readout.up:
            finished = CounterMetricFamily(
                "lmsp_tasks_finished",
                "Tasks that reached a terminal status, counted after the committed move (in Redis).",
                labels=["status"],
            )
            for status in map(str, states.in_declaration_order(states.TERMINAL)):
                finished.add_metric([status], readout.finished.get(status, 0))
            yield finished
        if readout.queues is not None:
            queues = GaugeMetricFamily(
                "lmsp_broker_queue_messages",
                "Celery messages waiting in a broker queue (task queue and maintenance queue).",
                labels=["queue"],
            )
            for name, length in readout.queues.items():
                queues.add_metric([name], length)
            yield queues
        yield GaugeMetricFamily(
            "lmsp_open_streams", "Event streams (SSE) open on this web process.", scrape.open_streams
        )
        if readout.up:
            for spec in WORKER_HISTOGRAMS:
                yield _worker_histogram(spec, readout.workers)


def metrics_exposition(scrape: Scrape, *, accept: str) -> tuple[bytes, str]:
    """The body and content type for ``accept`` (Prometheus text, or OpenMetrics when asked for).

    A registry of our own per scrape: nothing registered globally (by a
    library, or twice by a reload) ends up in the answer.
    """
    registry = CollectorRegistry(auto_describe=False)
    registry.register(ScrapeCollector(scrape))
    encoder, content_type = choose_encoder(accept)
    return encoder(registry), content_type
