"""What a worker measures about its generations, reported to Redis for the web's ``GET /metrics``.

Workers run on other hosts and in prefork children, so nobody scrapes them:
each process adds its observations to the histograms of its node in Redis
(``tasks_app.prometheus`` has the layout), and the web process exposes them with
a ``worker`` label. Observing only bumps numbers in memory under a lock; a
thread of the process sends what piled up at most once per
``FLUSH_INTERVAL_SECONDS`` and right after each task, as one MULTI/EXEC of
``HINCRBY``/``HINCRBYFLOAT``, so a generation never waits for Redis and Redis
sees a few commands per second, never one per token.

A failed flush drops its observations (a retry could count them twice) and
logs a rate-limited warning. A node's hash expires once it has not reported
for ``LMSP_METRICS_WORKER_TTL_SECONDS``; a live but idle process refreshes it.
"""

from __future__ import annotations

import functools
import logging
import math
import os
import threading
import time
from collections.abc import Callable
from datetime import datetime
from typing import ParamSpec

import redis
from django.conf import settings
from django.utils import timezone

from tasks_app.models import Task
from tasks_app.prometheus import (
    BATCH_EVENTS,
    BATCH_TOKENS,
    CANCEL_LATENCY,
    CLAIM_TO_FIRST_TOKEN,
    TIME_TO_FIRST_TOKEN,
    TOKENS_PER_SECOND,
    HistogramSpec,
    RateLimitedWarning,
    bucket_field,
    metrics_redis,
    worker_key,
    workers_key,
)

logger = logging.getLogger(__name__)

FLUSH_INTERVAL_SECONDS = 1.0

P = ParamSpec("P")


def node_name(worker: str) -> str:
    """The Celery node of a task's ``worker`` (``<node>/<pid>``): the children of one node share its metrics."""
    return worker.rsplit("/", 1)[0]


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

    def observe(self, spec: HistogramSpec, node: str, value: float) -> None:
        if not math.isfinite(value):
            return  # Redis refuses to add NaN or infinity to a sum
        with self._lock:
            fields = self._pending.setdefault(node, {})
            for name, amount in (
                (bucket_field(spec, spec.bucket_of(value)), 1),
                (f"{spec.name}:count", 1),
                (f"{spec.name}:sum", value),
            ):
                fields[name] = fields.get(name, 0) + amount

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="lmsp-metrics", daemon=True)
        self._thread.start()

    def flush_soon(self) -> None:
        self._wake.set()

    def flush(self) -> bool:
        """Send what piled up (and keep an idle node's keys alive); False if Redis refused."""
        with self._lock:
            pending, self._pending = self._pending, {}
        ttl = settings.LMSP_METRICS_WORKER_TTL_SECONDS
        refresh = time.monotonic() - self._reported_at > ttl / 4
        nodes = set(pending) | (self._reported if refresh else set())
        if not nodes:
            return True
        now = time.time()
        try:
            pipe = metrics_redis().pipeline(transaction=True)
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
            pipe.execute()
        except (redis.RedisError, OSError) as exc:
            dropped = sum(int(v) for fields in pending.values() for k, v in fields.items() if k.endswith(":count"))
            self._warning("worker metrics not reported, %d observations dropped: Redis: %s", dropped, exc)
            return False
        self._reported |= nodes
        self._reported_at = time.monotonic()
        return True

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
    def generation_stopped(self, output_tokens: int) -> None:
        """The model produced its last token of this run (it ended, was cancelled or lost the task)."""
        if self.stopped or self.first_token_at is None:
            return
        self.stopped = True
        after_first = output_tokens - self.first_token_count
        elapsed = time.monotonic() - self.first_token_at
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
    def run_ended(self) -> None:
        recorder().flush_soon()
