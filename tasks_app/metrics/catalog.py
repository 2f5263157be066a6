"""What ``GET /metrics`` reports beyond its fixed families: the workers' histograms, the engines' gauges, the labels.

Each metric is declared once here, with its help text and (a histogram) its
bucket bounds; workers record them (``workers.run_metrics``) and the scrape
exposes them (``tasks_app.metrics.exposition``). docs/metrics.md lists them.
"""

from __future__ import annotations

from dataclasses import dataclass


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

# Where a recovery runs, the label values of ``lmsp_recovery_errors_total`` (all always present).
RECOVERY_ERROR_SOURCES = ("startup", "reaper", "pool_process_lost", "hand_back")


# The processes and reasons of ``lmsp_database_unavailable_total`` (tasks_app/plumbing/database_outages.py).
DATABASE_PROCESSES = ("web", "worker", "maintenance", "webhooks")
DATABASE_REASONS = ("unreachable", "read_only", "full", "locked")
