"""The answer to ``GET /metrics``: one :class:`~tasks_app.metrics.scrape.Scrape` as Prometheus metric families.

Worker histograms are summed per node from the hashes each node's processes
add to; engine gauges are summed over a node's processes.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.exposition import choose_encoder
from prometheus_client.utils import floatToGoString

from tasks_app import states
from tasks_app.metrics.catalog import (
    DATABASE_PROCESSES,
    DATABASE_REASONS,
    ENGINE_BATCH_ROWS,
    ENGINE_GAUGES,
    ENGINE_HISTOGRAMS,
    RECOVERY_ERROR_SOURCES,
    WORKER_HISTOGRAMS,
    HistogramSpec,
)
from tasks_app.metrics.scrape import RedisReadout, Scrape
from tasks_app.metrics.store import node_name
from tasks_app.states import TaskStatus

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
