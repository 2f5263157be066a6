"""Prometheus metrics of the whole installation, gathered by the web process for ``GET /metrics``.

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
from tasks_app.plumbing.querying import status_in
from tasks_app.states import TaskStatus

logger = logging.getLogger(__name__)

# Every Redis call of metrics (the scrape's reads, the counters' and workers'
# writes) gives up after this long and is never retried: a metric lost to an
# outage is acceptable, a scrape or a generation that waits for Redis is not.
REDIS_TIMEOUT_SECONDS = 1.0
# A Redis failure is logged at most this often per process.
WARNING_INTERVAL_SECONDS = 60.0
# A worker process's gauges count for this long after its latest report: a
# process that died (SIGKILL, out of memory) stops reporting, and its rows
# must not look busy for a day, the lifetime of a node's histograms. A live
# process reports at least every quarter of this.
GAUGE_TTL_SECONDS = 30


@dataclass(frozen=True)
class HistogramSpec:
    """A histogram that workers record and the scrape exposes with a ``worker`` label (and ``model``, an engine's)."""

    name: str
    help: str
    # Upper bounds, ascending (a recorder bisects them); +Inf is implied.
    buckets: tuple[float, ...]


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
COMMIT_GROUP_TASKS = HistogramSpec(
    "lmsp_commit_group_tasks",
    "Running tasks whose batches one transaction of a worker's run loop wrote; the count is the commits.",
    (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128, 256),
)
CONSTRAINT_FAILURES = HistogramSpec(
    "lmsp_constraint_failure_output_tokens",
    "Output tokens of a constrained generation when its constraint failed and failed the task (the grammar "
    "erred or allowed no token, or a tool call broke): the count is the failures.",
    (1, 4, 16, 64, 256, 1024, 4096, 16384),
)
WORKER_HISTOGRAMS: tuple[HistogramSpec, ...] = (
    TIME_TO_FIRST_TOKEN,
    CLAIM_TO_FIRST_TOKEN,
    TOKENS_PER_SECOND,
    CANCEL_LATENCY,
    BATCH_EVENTS,
    BATCH_TOKENS,
    COMMIT_GROUP_TASKS,
    CONSTRAINT_FAILURES,
)

# The batch engine's histograms, labelled by node and model. Step times from
# a tiny model on a CPU (0.5 ms) to a large one (seconds); batches up to
# LMSP_MAX_BATCH, which is at most a few hundred.
ENGINE_BATCH_ROWS = HistogramSpec(
    "lmsp_engine_batch_rows",
    "Rows (generations) in one batched decode step: batch occupancy; the sum is every token the steps generated.",
    (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 256),
)
ENGINE_STEP_SECONDS = HistogramSpec(
    "lmsp_engine_step_seconds",
    "Wall time of one batched decode step: the model run and the sampling of every row.",
    (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5),
)
ENGINE_PREFILL_SECONDS = HistogramSpec(
    "lmsp_engine_prefill_seconds",
    "Wall time of one prefill call of a joining row (a whole prompt or one chunk of it).",
    (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
)
ENGINE_PREFILL_TOKENS = HistogramSpec(
    "lmsp_engine_prefill_tokens",
    "Prompt tokens one prefill call processed; the sum is every prompt token prefilled.",
    (1, 4, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768),
)
ENGINE_QUEUE_WAIT = HistogramSpec(
    "lmsp_engine_queue_wait_seconds",
    "From a row's submission to the engine to its first model call: a full batch or the KV cache budget.",
    (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300),
)
ENGINE_CONSTRAINED_ROWS = HistogramSpec(
    "lmsp_engine_constrained_rows",
    "Rows of one decode step whose output follows a grammar (structured output); the sum is their tokens.",
    (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 256),
)
ENGINE_MASK_SECONDS = HistogramSpec(
    "lmsp_engine_mask_seconds",
    "Wall time of one decode step's grammar masks (all its constrained rows), computed beside the model run.",
    (0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25),
)
# The prefix cache: a lookup per joining row (count: lookups; the 0 bucket: misses; sum: tokens whose model
# calls were skipped), and an observation per evicted entry (count: evictions; sum: bytes freed).
ENGINE_PREFIX_HIT_TOKENS = HistogramSpec(
    "lmsp_engine_prefix_hit_tokens",
    "Prompt tokens a joining row found in the prefix cache (0: a miss); the sum is every token it saved a call.",
    (0, 16, 64, 256, 1024, 2048, 4096, 8192, 16384, 32768),
)
ENGINE_PREFIX_EVICTED_BYTES = HistogramSpec(
    "lmsp_engine_prefix_evicted_bytes",
    "Bytes of one prefix cache entry evicted for a row's room; the count is the evictions.",
    (2**16, 2**20, 2**22, 2**24, 2**26, 2**28, 2**30, 2**32),
)
ENGINE_HISTOGRAMS: tuple[HistogramSpec, ...] = (
    ENGINE_BATCH_ROWS,
    ENGINE_STEP_SECONDS,
    ENGINE_PREFILL_SECONDS,
    ENGINE_PREFILL_TOKENS,
    ENGINE_QUEUE_WAIT,
    ENGINE_CONSTRAINED_ROWS,
    ENGINE_MASK_SECONDS,
    ENGINE_PREFIX_HIT_TOKENS,
    ENGINE_PREFIX_EVICTED_BYTES,
)


@dataclass(frozen=True)
class GaugeSpec:
    """A gauge of one engine: each process sets its own, the scrape sums a node's processes."""

    name: str
    help: str


ENGINE_MAX_BATCH = GaugeSpec(
    "lmsp_engine_max_batch", "Rows the engines can step together (LMSP_MAX_BATCH; automatic: 256, as KV allows)."
)
ENGINE_ROWS_RUNNING = GaugeSpec("lmsp_engine_rows_running", "Rows in the engines' batches now.")
ENGINE_ROWS_WAITING = GaugeSpec(
    "lmsp_engine_rows_waiting", "Rows submitted and waiting to join a batch (batch full or KV cache budget)."
)
ENGINE_KV_BYTES = GaugeSpec("lmsp_engine_kv_cache_bytes", "KV cache bytes reserved by the rows now.")
ENGINE_KV_BUDGET = GaugeSpec("lmsp_engine_kv_cache_budget_bytes", "KV cache bytes the engines may reserve.")
ENGINE_TOKENS_RATE = GaugeSpec(
    "lmsp_engine_tokens_per_second",
    "Tokens the decode steps generated per second over the latest report interval (at least a second).",
)
ENGINE_PREFIX_BYTES = GaugeSpec(
    "lmsp_engine_prefix_cache_bytes", "KV cache bytes the prefix cache holds now (within the KV budget)."
)
ENGINE_GAUGES: tuple[GaugeSpec, ...] = (
    ENGINE_MAX_BATCH,
    ENGINE_ROWS_RUNNING,
    ENGINE_ROWS_WAITING,
    ENGINE_KV_BYTES,
    ENGINE_KV_BUDGET,
    ENGINE_TOKENS_RATE,
    ENGINE_PREFIX_BYTES,
)


# --------------------------------------------------------------------------- #
# Redis layout (all under LMSP_REDIS_PREFIX)
# --------------------------------------------------------------------------- #


def metrics_key(*parts: str) -> str:
    return ":".join((settings.LMSP_REDIS_PREFIX, "metrics", *parts))


def finished_key() -> str:
    """Hash: terminal status -> tasks that reached it."""
    return metrics_key("finished")


def recovery_errors_key() -> str:
    """Hash: where recovery ran (``RECOVERY_ERROR_SOURCES``) -> tasks whose recovery raised there."""
    return metrics_key("recovery_errors")


def database_unavailable_key() -> str:
    """Hash: ``<process>|<reason>`` -> outages that process saw start; ``<process>|seconds`` -> their length."""
    return metrics_key("database_unavailable")


def workers_key() -> str:
    """Sorted set: worker node name -> unix time of its newest report."""
    return metrics_key("workers")


def worker_key(node: str) -> str:
    """Hash of one node's histograms: ``<series>:le:<bound>`` (not cumulative), ``<series>:sum``, ``<series>:count``.

    ``<series>`` is the metric's name, or ``<name>|<model>`` for an engine's
    (a model name never holds ``|``).
    """
    return metrics_key("worker", node)


def processes_key() -> str:
    """Sorted set: worker process (``<node>/<pid>``) -> unix time of its newest gauge report."""
    return metrics_key("processes")


def process_key(worker: str) -> str:
    """Hash of one worker process's engine gauges: ``<name>|<model>`` -> latest value."""
    return metrics_key("process", worker)


def node_name(worker: str) -> str:
    """The Celery node of a task's ``worker`` (``<node>/<pid>``): the children of one node share its metrics."""
    return worker.rsplit("/", 1)[0]


def series_name(spec: HistogramSpec | GaugeSpec, model: str | None = None) -> str:
    return spec.name if model is None else f"{spec.name}|{model}"


def bucket_field(spec: HistogramSpec, bound: float, model: str | None = None) -> str:
    return f"{series_name(spec, model)}:le:{floatToGoString(bound)}"


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


# Where a recovery runs, the label values of ``lmsp_recovery_errors_total`` (all always present).
RECOVERY_ERROR_SOURCES = ("startup", "reaper", "pool_process_lost", "hand_back")


def recovery_error_count(*, source: str, count: int = 1) -> None:
    """Add ``count`` tasks whose recovery raised at ``source``; never raises (as :func:`task_finished_count`)."""
    _counter_add(recovery_errors_key(), source, count, what="a recovery error")


# The processes and reasons of ``lmsp_database_unavailable_total`` (tasks_app/plumbing/database_outages.py).
DATABASE_PROCESSES = ("web", "worker", "maintenance", "webhooks")
DATABASE_REASONS = ("unreachable", "read_only", "full", "locked")


def database_unavailable_count(*, process: str, reason: str) -> None:
    """One more outage seen by a ``process``, as it started (``reason``); never raises."""
    _counter_add(database_unavailable_key(), f"{process}|{reason}", 1, what="a database outage")


def database_unavailable_seconds_add(*, process: str, seconds: float) -> None:
    """Add an ended outage's length, as ``process`` saw it; never raises."""
    _counter_add(database_unavailable_key(), f"{process}|seconds", float(seconds), what="a database outage's length")


# --------------------------------------------------------------------------- #
# What a scrape reads
# --------------------------------------------------------------------------- #


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


# --------------------------------------------------------------------------- #
# Exposition
# --------------------------------------------------------------------------- #


# A histogram's series as read from the node hashes: label values -> {"le:<bound>" | "sum" | "count": value}.
HistogramSeries = dict[tuple[str, ...], dict[str, float]]


def _node_series(spec: HistogramSpec, workers: Mapping[str, Mapping[str, float]]) -> HistogramSeries:
    prefix = f"{spec.name}:"
    return {
        (node,): {name[len(prefix) :]: value for name, value in fields.items() if name.startswith(prefix)}
        for node, fields in workers.items()
    }


def _engine_series(spec: HistogramSpec, workers: Mapping[str, Mapping[str, float]]) -> HistogramSeries:
    """``<name>|<model>:<part>`` fields split into (node, model) series.

    A model's tag may be ``le``, ``sum`` or ``count`` (``demo:le``), so the
    part is found from the end: ``:sum``, ``:count``, else ``:le:<bound>``.
    """
    prefix = f"{spec.name}|"
    series: HistogramSeries = {}
    for node, fields in workers.items():
        for name, value in fields.items():
            if not name.startswith(prefix):
                continue
            rest = name[len(prefix) :]
            if rest.endswith((":sum", ":count")):
                model, _, part = rest.rpartition(":")
            else:
                model, _, bound = rest.rpartition(":le:")
                part = f"le:{bound}"
            series.setdefault((node, model), {})[part] = value
    return series


def _histogram(spec: HistogramSpec, labels: list[str], series: HistogramSeries) -> HistogramMetricFamily:
    family = HistogramMetricFamily(spec.name, spec.help, labels=labels)
    for label_values, fields in sorted(series.items()):
        count = fields.get("count")
        if count is None:
            continue
        per_bound = dict.fromkeys(spec.buckets, 0.0)
        for name, value in fields.items():
            if name.startswith("le:"):
                # A bound recorded by another version still adds up; +Inf is the count.
                bound = float(name[len("le:") :])
                per_bound[bound] = per_bound.get(bound, 0.0) + value
        buckets, running = [], 0.0
        for bound in sorted(b for b in per_bound if b != math.inf):
            running += per_bound[bound]
            buckets.append((floatToGoString(bound), running))
        buckets.append(("+Inf", count))
        family.add_metric(list(label_values), buckets, fields.get("sum", 0.0))
    return family


def _engine_gauges(processes: Mapping[str, Mapping[str, float]]) -> dict[str, dict[tuple[str, str], float]]:
    """Gauge name -> (node, model) -> the sum over the node's processes (prefork children each run engines)."""
    sums: dict[str, dict[tuple[str, str], float]] = {spec.name: {} for spec in ENGINE_GAUGES}
    for process, fields in processes.items():
        node = node_name(process)
        for name, value in fields.items():
            metric, sep, model = name.partition("|")
            if sep and metric in sums:
                per_series = sums[metric]
                per_series[node, model] = per_series.get((node, model), 0.0) + value
    return sums


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
            errors = CounterMetricFamily(
                "lmsp_recovery_errors",
                "Tasks whose recovery raised (logged with the task id; left for the next round), by where it ran.",
                labels=["source"],
            )
            for source in RECOVERY_ERROR_SOURCES:
                errors.add_metric([source], readout.recovery_errors.get(source, 0))
            yield errors
            yield from self._database_outages(readout)
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
            yield from self._workers(readout)

    @staticmethod
    def _database_outages(readout: RedisReadout) -> Iterator[Metric]:
        outages = CounterMetricFamily(
            "lmsp_database_unavailable",
            "Outages of the database as each kind of process saw them start (one per process and outage), by reason.",
            labels=["process", "reason"],
        )
        seconds = CounterMetricFamily(
            "lmsp_database_unavailable_seconds",
            "How long the ended outages lasted, summed over the processes that saw them.",
            labels=["process"],
        )
        found = readout.database_unavailable
        processes = sorted({*DATABASE_PROCESSES, *(key.split("|", 1)[0] for key in found)})
        for process in processes:
            for reason in DATABASE_REASONS:
                outages.add_metric([process, reason], found.get(f"{process}|{reason}", 0))
            seconds.add_metric([process], found.get(f"{process}|seconds", 0.0))
        yield outages
        yield seconds

    @staticmethod
    def _workers(readout: RedisReadout) -> Iterator[Metric]:
        for spec in WORKER_HISTOGRAMS:
            yield _histogram(spec, ["worker"], _node_series(spec, readout.workers))
        engine_labels = ["worker", "model"]
        for spec in ENGINE_HISTOGRAMS:
            series = _engine_series(spec, readout.workers)
            yield _histogram(spec, engine_labels, series)
            if spec is ENGINE_BATCH_ROWS:
                # Every row of a step generates one token: the rows' sum is the tokens' counter.
                tokens = CounterMetricFamily(
                    "lmsp_engine_generated_tokens",
                    "Tokens generated by batched decode steps, one per row and step (rate() is the aggregate speed).",
                    labels=engine_labels,
                )
                for label_values, fields in sorted(series.items()):
                    tokens.add_metric(list(label_values), fields.get("sum", 0.0))
                yield tokens
        sums = _engine_gauges(readout.processes)
        for spec in ENGINE_GAUGES:
            gauge = GaugeMetricFamily(spec.name, spec.help, labels=engine_labels)
            for label_values, total in sorted(sums[spec.name].items()):
                gauge.add_metric(list(label_values), total)
            yield gauge


def metrics_exposition(scrape: Scrape, *, accept: str) -> tuple[bytes, str]:
    """The body and content type for ``accept`` (Prometheus text, or OpenMetrics when asked for).

    A registry of our own per scrape: nothing registered globally (by a
    library, or twice by a reload) ends up in the answer.
    """
    registry = CollectorRegistry(auto_describe=False)
    registry.register(ScrapeCollector(scrape))
    encoder, content_type = choose_encoder(accept)
    return encoder(registry), content_type
