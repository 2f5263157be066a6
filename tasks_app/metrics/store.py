"""Where metrics live in Redis (all under LMSP_REDIS_PREFIX), and how they reach it.

The keys and field names are written once here for the recorders
(``tasks_app.metrics.counters``, ``workers.run_metrics``) and the scrape
(``tasks_app.metrics.scrape``). Every Redis call of metrics goes through
:func:`metrics_redis` (short timeouts, no retries), and a failure is logged
through a :class:`RateLimitedWarning`: a metric lost to an outage is
acceptable, a scrape or a generation that waits for Redis is not.
"""

from __future__ import annotations

import logging
import math
import threading
import time

import redis
from django.conf import settings
from prometheus_client.utils import floatToGoString
from redis.backoff import NoBackoff
from redis.retry import Retry

from tasks_app.metrics.catalog import GaugeSpec, HistogramSpec

logger = logging.getLogger("tasks_app.metrics")

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
