"""What a worker measures about its generations, reported to Redis for the web's ``GET /metrics``.

Workers run on other hosts and in prefork children, so nobody scrapes them:
each process adds its observations to the histograms of its node in Redis
(``tasks_app.metrics.store`` has the layout), and the web process exposes them with
a ``worker`` label. Observing only bumps numbers in memory under a lock; a
thread of the process sends what piled up at most once per
``FLUSH_INTERVAL_SECONDS`` and right after each task, as one MULTI/EXEC of
``HINCRBY``/``HINCRBYFLOAT``, so a generation never waits for Redis and Redis
sees a few commands per second, never one per token.

A failed flush drops its observations (a retry could count them twice) and
logs a rate-limited warning. A node's hash expires once it has not reported
for ``LMSP_METRICS_WORKER_TTL_SECONDS``; a live but idle process refreshes it.

A batch engine's gauges (rows, KV cache bytes) are latest values, not sums,
so two processes of one node would overwrite each other in one field: each
process writes them into a hash of its own (``HSET``, key named by its
``<node>/<pid>``), and the scrape adds up a node's processes. The same flush
sends them when they changed, or every quarter of ``GAUGE_TTL_SECONDS``;
that hash expires with that short TTL, so the rows of a process that died
stop counting within seconds. A failed flush keeps them to send again (a
latest value cannot count twice). A closed engine's zeros are sent once,
then it is forgotten: a process with no engine left lets its hash expire.
"""

from __future__ import annotations

import bisect
import functools
import logging
import math
import os
import threading
import time
from collections.abc import Callable, Sequence
from datetime import datetime
from typing import ParamSpec

import redis
from django.conf import settings
from django.utils import timezone
from redis.client import Pipeline

from tasks_app.metrics.catalog import (
    BATCH_EVENTS,
    BATCH_TOKENS,
    CANCEL_LATENCY,
    CLAIM_TO_FIRST_TOKEN,
    COMMIT_GROUP_TASKS,
    CONSTRAINT_FAILURES,
    ENGINE_BATCH_ROWS,
    ENGINE_CONSTRAINED_ROWS,
    ENGINE_KV_BUDGET,
    ENGINE_KV_BYTES,
    ENGINE_MASK_SECONDS,
    ENGINE_MAX_BATCH,
    ENGINE_PREFILL_SECONDS,
    ENGINE_PREFILL_TOKENS,
    ENGINE_PREFIX_BYTES,
    ENGINE_PREFIX_EVICTED_BYTES,
    ENGINE_PREFIX_HIT_TOKENS,
    ENGINE_QUEUE_WAIT,
    ENGINE_ROWS_RUNNING,
    ENGINE_ROWS_WAITING,
    ENGINE_STEP_SECONDS,
    ENGINE_TOKENS_RATE,
    TIME_TO_FIRST_TOKEN,
    TOKENS_PER_SECOND,
    HistogramSpec,
)
from tasks_app.metrics.store import (
    GAUGE_TTL_SECONDS,
    RateLimitedWarning,
    bucket_field,
    metrics_redis,
    node_name,
    process_key,
    processes_key,
    series_name,
    worker_key,
    workers_key,
)
from tasks_app.models import Task

logger = logging.getLogger(__name__)

FLUSH_INTERVAL_SECONDS = 1.0

P = ParamSpec("P")


@functools.cache
def _series_fields(spec: HistogramSpec, model: str | None) -> tuple[tuple[str, ...], str, str]:
    """The hash fields of one series: a bucket's per bound (``inf`` last), its count and its sum.

    Made once: an engine observes on every decode step, and formatting the
    names each time cost more than the rest of an observation.
    """
    series = series_name(spec, model)
    bounds = (*spec.buckets, math.inf)
    return tuple(bucket_field(spec, bound, model) for bound in bounds), f"{series}:count", f"{series}:sum"


class Recorder:
    """Observations not yet sent to Redis; :meth:`start` adds the thread that sends them."""

    def __init__(self) -> None:
        self.pid = os.getpid()
        self._lock = threading.Lock()
        # node -> hash field -> amount to add
        self._pending: dict[str, dict[str, float]] = {}
        self._reported: set[str] = set()
        self._reported_at = -math.inf
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self._warning = RateLimitedWarning(logger)
        # (worker, model) -> the engine whose gauges are reported; a closed one until its zeros are sent.
        self._engines: dict[tuple[str, str], EngineMetrics] = {}
        # Flushes run one at a time: the gauges last sent are compared with the next.
        self._flush_lock = threading.Lock()
        # worker process -> its gauge fields as last written to Redis, and when (monotonic)
        self._gauges_sent: dict[str, dict[str, float]] = {}
        self._gauges_sent_at: dict[str, float] = {}

    def observe(self, spec: HistogramSpec, node: str, value: float, *, model: str | None = None) -> None:
        self.observe_each(node, model, ((spec, value),))

    def observe_each(self, node: str, model: str | None, observations: tuple[tuple[HistogramSpec, float], ...]) -> None:
        """Several observations of one node (and model) under one taking of the lock."""
        with self._lock:
            fields = self._pending.setdefault(node, {})
            for spec, value in observations:
                if not math.isfinite(value):
                    continue  # Redis refuses to add NaN or infinity to a sum
                buckets, count, total = _series_fields(spec, model)
                bucket = buckets[bisect.bisect_left(spec.buckets, value)]
                fields[bucket] = fields.get(bucket, 0) + 1
                fields[count] = fields.get(count, 0) + 1
                fields[total] = fields.get(total, 0) + value

    def engine_opened(self, engine: EngineMetrics) -> None:
        """Report ``engine``'s gauges from now on, in place of an earlier engine of its process and model."""
        with self._lock:
            self._engines[engine.worker, engine.model] = engine

    def engine_readings(self) -> list[dict[str, float | str]]:
        """Each open engine of this process now (``EngineMetrics.reading``)."""
        with self._lock:
            engines = list(self._engines.values())
        return [reading for engine in engines if not (reading := engine.reading())["closed"]]

    def _gauges_due(self) -> tuple[dict[str, dict[str, float]], list[EngineMetrics]]:
        """Per worker process, its gauge fields if they changed since they were sent or are due for a refresh;
        and the engines that were closed when read."""
        with self._lock:
            engines = list(self._engines.values())
        current: dict[str, dict[str, float]] = {}
        closed = []
        for engine in engines:
            fields, is_closed = engine.gauge_fields()
            current.setdefault(engine.worker, {}).update(fields)
            if is_closed:
                closed.append(engine)
        now = time.monotonic()
        for worker in set(self._gauges_sent) - set(current):
            del self._gauges_sent[worker], self._gauges_sent_at[worker]
        due = {
            worker: fields
            for worker, fields in current.items()
            if fields != self._gauges_sent.get(worker)
            or now - self._gauges_sent_at.get(worker, -math.inf) > GAUGE_TTL_SECONDS / 4
        }
        return due, closed

    def _forget(self, closed: list[EngineMetrics]) -> None:
        """Closed engines whose zeros Redis holds now: no longer refreshed, their process's hash may expire."""
        with self._lock:
            for engine in closed:
                if self._engines.get((engine.worker, engine.model)) is engine:
                    del self._engines[engine.worker, engine.model]

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="lmsp-metrics", daemon=True)
        self._thread.start()

    def flush_soon(self) -> None:
        self._wake.set()

    def flush(self) -> bool:
        """Send what piled up and the engines' gauges (and keep an idle node's keys alive); False if Redis refused."""
        with self._flush_lock:
            return self._flush()

    def _flush(self) -> bool:
        with self._lock:
            pending, self._pending = self._pending, {}
        gauges, closed = self._gauges_due()
        ttl = settings.LMSP_METRICS_WORKER_TTL_SECONDS
        refresh = time.monotonic() - self._reported_at > ttl / 4
        nodes = set(pending) | (self._reported if refresh else set())
        if not nodes and not gauges:
            self._forget(closed)
            return True
        now = time.time()
        try:
            pipe = metrics_redis().pipeline(transaction=True)
            if nodes:
                self._add_histograms(pipe, pending, nodes, now)
            if gauges:
                self._add_gauges(pipe, gauges, now)
            pipe.execute()
        except (redis.RedisError, OSError) as exc:
            dropped = sum(int(v) for fields in pending.values() for k, v in fields.items() if k.endswith(":count"))
            self._warning("worker metrics not reported, %d observations dropped: Redis: %s", dropped, exc)
            return False
        if nodes:
            self._reported |= nodes
            self._reported_at = time.monotonic()
        sent_at = time.monotonic()
        for worker, fields in gauges.items():
            self._gauges_sent[worker] = fields
            self._gauges_sent_at[worker] = sent_at
        self._forget(closed)
        return True

    @staticmethod
    def _add_histograms(pipe: Pipeline, pending: dict[str, dict[str, float]], nodes: set[str], now: float) -> None:
        ttl = settings.LMSP_METRICS_WORKER_TTL_SECONDS
        for node, fields in pending.items():
            key = worker_key(node)
            for name, amount in fields.items():
                if name.endswith(":sum"):
                    pipe.hincrbyfloat(key, name, amount)
                else:
                    pipe.hincrby(key, name, int(amount))
        for node in nodes:
            pipe.expire(worker_key(node), ttl)
            pipe.zadd(workers_key(), {node: now})
        # Nodes gone for longer than the TTL: their hashes have expired too.
        pipe.zremrangebyscore(workers_key(), "-inf", now - ttl)
        pipe.expire(workers_key(), ttl)

    @staticmethod
    def _add_gauges(pipe: Pipeline, gauges: dict[str, dict[str, float]], now: float) -> None:
        for worker, fields in gauges.items():
            pipe.hset(process_key(worker), mapping=fields)
            pipe.expire(process_key(worker), GAUGE_TTL_SECONDS)
            pipe.zadd(processes_key(), {worker: now})
        # Processes that stopped reporting: their hashes have expired too.
        pipe.zremrangebyscore(processes_key(), "-inf", now - GAUGE_TTL_SECONDS)
        pipe.expire(processes_key(), GAUGE_TTL_SECONDS)

    def _run(self) -> None:
        while True:
            self._wake.wait(FLUSH_INTERVAL_SECONDS)
            self._wake.clear()
            try:
                self.flush()
            except Exception:  # the reporting thread must outlive any bug in one flush
                logger.exception("worker metrics: flush failed")


_recorder: Recorder | None = None
_recorder_lock = threading.Lock()


def recorder() -> Recorder:
    """This process's recorder; a forked child (a prefork pool process) gets its own."""
    global _recorder
    with _recorder_lock:
        if _recorder is None or _recorder.pid != os.getpid():
            _recorder = Recorder()
            _recorder.start()
        return _recorder


_bug_warning = RateLimitedWarning(logger)


def _never_raises(method: Callable[P, None]) -> Callable[P, None]:
    """Recording must not end a generation: a bug here is logged, never raised."""

    @functools.wraps(method)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> None:
        try:
            method(*args, **kwargs)
        except Exception:
            _bug_warning("worker metrics: %s failed", method.__name__)
            logger.debug("worker metrics failure", exc_info=True)

    return wrapper


@_never_raises
def commit_group_observed(worker: str, tasks: int) -> None:
    """One transaction of the run loop wrote ``tasks`` tasks' batches (``workers.run_loop``)."""
    recorder().observe(COMMIT_GROUP_TASKS, worker, tasks)


class RunMetrics:
    """The measurements of one run of a task (a claim, or an adoption to resume).

    ``accepted_at`` is the task's ``created_at``; None for a resumed run,
    whose first token is not the task's first (no time-to-first-token then).
    """

    def __init__(self, *, worker: str, accepted_at: datetime | None) -> None:
        self.node = node_name(worker)
        self.accepted_at = accepted_at
        self.claimed_at = time.monotonic()
        self.first_token_at: float | None = None
        self.first_token_count = 0
        self.stopped = False

    @_never_raises
    def batch_started(self, at: float, output_tokens: int) -> None:
        """The first token of a batch arrived at ``at`` (monotonic); the run's first is its first token."""
        if self.first_token_at is not None:
            return
        self.first_token_at, self.first_token_count = at, output_tokens
        if self.accepted_at is None:
            return
        # Wall clocks: created_at was written by the web host (keep hosts on NTP).
        since_accepted = (timezone.now() - self.accepted_at).total_seconds()
        recorder().observe(TIME_TO_FIRST_TOKEN, self.node, max(0.0, since_accepted))
        recorder().observe(CLAIM_TO_FIRST_TOKEN, self.node, at - self.claimed_at)

    @_never_raises
    def batch_committed(self, *, events: int, tokens: int) -> None:
        recorder().observe(BATCH_EVENTS, self.node, events)
        recorder().observe(BATCH_TOKENS, self.node, tokens)

    @_never_raises
    def generation_stopped(self, output_tokens: int, at: float | None = None) -> None:
        """The model produced its last token of this run at ``at`` (monotonic; default now): it ended,
        was cancelled or lost the task."""
        if self.stopped or self.first_token_at is None:
            return
        self.stopped = True
        after_first = output_tokens - self.first_token_count
        elapsed = (time.monotonic() if at is None else at) - self.first_token_at
        if after_first > 0 and elapsed > 0:
            recorder().observe(TOKENS_PER_SECOND, self.node, after_first / elapsed)

    @_never_raises
    def cancelled(self, task: Task) -> None:
        """This run committed ``cancelled``: the latency from the request (``cancel_requested_at``) to now."""
        if task.cancel_requested_at is None:
            return
        # Both are commit times of the database rows; written by different hosts' clocks.
        latency = (task.updated_at - task.cancel_requested_at).total_seconds()
        recorder().observe(CANCEL_LATENCY, self.node, max(0.0, latency))

    @_never_raises
    def constraint_failed(self, output_tokens: int) -> None:
        """The run's output constraint failed it (a grammar error, no token left, a broken tool call)."""
        recorder().observe(CONSTRAINT_FAILURES, self.node, output_tokens)

    @_never_raises
    def run_ended(self) -> None:
        recorder().flush_soon()


class EngineMetrics:
    """Observations of one batch engine: one model in one worker process.

    ``worker`` is the ``worker`` of the engine's tasks (``<node>/<pid>``).
    The engine's model thread calls these on every step: each only updates
    numbers in memory under a lock (no I/O, never raises); the recorder's
    thread sends them. Histograms add up per node and model; gauges are this
    process's latest values, and the scrape adds up a node's processes.
    """

    def __init__(self, *, worker: str, model: str, max_batch: int) -> None:
        self.worker, self.model, self.node = worker, model, node_name(worker)
        self._lock = threading.Lock()
        self._max_batch = max_batch
        self._running = self._waiting = self._kv_in_use = self._kv_budget = self._prefix_bytes = 0
        self._closed = False
        # Tokens the decode steps generated since _window_start (monotonic), for the rate gauge.
        self._window_tokens = 0
        self._window_start = time.monotonic()
        self._rate = 0.0
        self._recorder: Recorder | None = None
        self._register()

    @_never_raises
    def _register(self) -> None:
        self._recorder = recorder()
        self._recorder.engine_opened(self)

    def _observe(self, *observations: tuple[HistogramSpec, float]) -> None:
        if self._recorder is not None:
            self._recorder.observe_each(self.node, self.model, observations)

    @_never_raises
    def step(self, *, rows: int, seconds: float) -> None:
        """One batched decode step: ``rows`` in it (one token each), its wall time (model run and sampling)."""
        with self._lock:
            self._window_tokens += rows
        self._observe((ENGINE_BATCH_ROWS, rows), (ENGINE_STEP_SECONDS, seconds))

    @_never_raises
    def masks(self, *, rows: int, seconds: float) -> None:
        """A decode step's grammar masks: its constrained rows, and the time the masks took beside the model."""
        self._observe((ENGINE_CONSTRAINED_ROWS, rows), (ENGINE_MASK_SECONDS, seconds))

    @_never_raises
    def prefill(self, *, tokens: int, seconds: float) -> None:
        """One prefill call of a joining row (a whole prompt or a chunk of it)."""
        self._observe((ENGINE_PREFILL_TOKENS, tokens), (ENGINE_PREFILL_SECONDS, seconds))

    @_never_raises
    def queue_wait(self, seconds: float) -> None:
        """A row's wait from its submission to its first model call (batch full, or the KV cache budget)."""
        self._observe((ENGINE_QUEUE_WAIT, seconds))

    @_never_raises
    def kv(self, *, in_use: int, budget: int) -> None:
        """KV cache bytes the rows reserve now, and the budget."""
        with self._lock:
            if not self._closed:
                self._kv_in_use, self._kv_budget = in_use, budget

    @_never_raises
    def prefix_hit(self, *, tokens: int) -> None:
        """A joining row's prefix cache lookup: the prompt tokens it found cached (0: a miss)."""
        self._observe((ENGINE_PREFIX_HIT_TOKENS, tokens))

    @_never_raises
    def prefix_cache(self, *, cached_bytes: int, evicted: Sequence[int]) -> None:
        """The prefix cache's bytes now, and the sizes of the entries it just evicted."""
        with self._lock:
            if not self._closed:
                self._prefix_bytes = cached_bytes
        if evicted:
            self._observe(*((ENGINE_PREFIX_EVICTED_BYTES, size) for size in evicted))

    @_never_raises
    def rows(self, *, running: int, waiting: int) -> None:
        """Rows in the batch now, and rows waiting to join it."""
        with self._lock:
            if not self._closed:
                self._running, self._waiting = running, waiting

    @_never_raises
    def close(self) -> None:
        """The engine stopped: its gauges read zero, and are no longer refreshed once sent."""
        with self._lock:
            self._closed = True
            self._max_batch = self._running = self._waiting = self._kv_in_use = self._kv_budget = 0
            self._prefix_bytes = 0
            self._window_tokens, self._rate = 0, 0.0
        if self._recorder is not None:
            self._recorder.flush_soon()

    def reading(self) -> dict[str, float | str]:
        """The engine now, for its node's report (``workers.node_report``): rows, waiting rows, the batch
        size, and the tokens/s of the rate gauge's last window. Moves no window."""
        with self._lock:
            return {
                "model": self.model,
                "rows": self._running,
                "waiting": self._waiting,
                "max_batch": self._max_batch,
                "tokens_per_s": round(self._rate, 1),
                "closed": self._closed,
            }

    def gauge_fields(self) -> tuple[dict[str, float], bool]:
        """The gauges' fields for this process's hash, and whether the engine was closed when they were read.

        The recorder's flush calls it: it moves the rate's window.
        """
        model = self.model
        with self._lock:
            now = time.monotonic()
            elapsed = now - self._window_start
            # Over at least a flush interval: a report right after a task ends must not read a burst.
            if elapsed >= FLUSH_INTERVAL_SECONDS:
                self._rate = self._window_tokens / elapsed
                self._window_tokens, self._window_start = 0, now
            values = (
                (ENGINE_MAX_BATCH, self._max_batch),
                (ENGINE_ROWS_RUNNING, self._running),
                (ENGINE_ROWS_WAITING, self._waiting),
                (ENGINE_KV_BYTES, self._kv_in_use),
                (ENGINE_KV_BUDGET, self._kv_budget),
                (ENGINE_TOKENS_RATE, self._rate),
                (ENGINE_PREFIX_BYTES, self._prefix_bytes),
            )
            closed = self._closed
        return {series_name(spec, model): float(value) for spec, value in values}, closed
