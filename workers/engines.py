"""This worker process's batch engines: one per loaded model, shared by every task thread.

A task thread asks :func:`engine_for` for the engine of the model its task
runs on and submits its generation there (``workers.execution``). The
engine's model thread steps every row of that model together; the settings
(``LMSP_MAX_BATCH``, automatic by default, ``LMSP_KV_CACHE_BYTES``/``LMSP_KV_CACHE_SHARE``, the
delta batch window, ``LMSP_SAMPLING_THREADS``) are read here, so the backend knows nothing of Django.

:func:`engines_drain` is what a SIGTERM calls (``workers.shutdown``): engines
take no new rows, and rows still running after the grace period end
interrupted, their tasks handed back by their ``on_restart`` policy.
"""

from __future__ import annotations

import sys
import threading
import time
import weakref

from django.conf import settings

from workers.backends.base import Engine, LoadedModel
from workers.run_metrics import EngineMetrics

SWITCH_INTERVAL_SECONDS = 0.0005
# LMSP_MAX_BATCH 0: rows as the KV budgets allow, at most this many (vLLM's default max_num_seqs).
AUTOMATIC_MAX_BATCH = 256

_engines: weakref.WeakSet[Engine] = weakref.WeakSet()
_lock = threading.Lock()
_drain_deadline: float | None = None


def max_rows() -> int:
    """Rows this process runs at once: ``LMSP_MAX_BATCH``, or (0, automatic) at most ``AUTOMATIC_MAX_BATCH``,
    as the engines' KV budgets allow (:func:`engines_full`)."""
    return settings.LMSP_MAX_BATCH or AUTOMATIC_MAX_BATCH


def engines_full() -> bool:
    """Whether an engine of this process holds a row back because its KV budget is spent."""
    with _lock:
        engines = list(_engines)
    return any(engine.waiting for engine in engines)


def engine_for(model: LoadedModel, *, worker: str, model_name: str) -> Engine:
    """The engine of ``model`` in this process (started on first use)."""
    # The model thread gives the GIL up for every session call; with Python's
    # 5 ms switch interval it then waits behind a task thread's commit code
    # for up to 5 ms per step. A short interval hands it back at once.
    sys.setswitchinterval(SWITCH_INTERVAL_SECONDS)
    # Here, not at the top: a process that never loads a model never imports numpy (docs/decisions/0003).
    from workers.backends.sampling import automatic_sampling_threads

    engine = model.engine(
        max_batch=max_rows(),
        kv_budget_bytes=settings.LMSP_KV_CACHE_BYTES,
        kv_share=settings.LMSP_KV_CACHE_SHARE,
        delta_tokens=settings.LMSP_DELTA_BATCH_TOKENS,
        delta_seconds=settings.LMSP_DELTA_BATCH_MS / 1000,
        sampling_threads=settings.LMSP_SAMPLING_THREADS or automatic_sampling_threads(),
        prefill_share=settings.LMSP_PREFILL_SHARE,
        prefix_cache=settings.LMSP_PREFIX_CACHE,
        observer=lambda: EngineMetrics(worker=worker, model=model_name, max_batch=max_rows()),
    )
    with _lock:
        if engine not in _engines:
            _engines.add(engine)
            if _drain_deadline is not None:
                engine.drain(grace_seconds=max(0.0, _drain_deadline - time.monotonic()))
    return engine


def engines_drain(*, grace_seconds: float) -> None:
    """Stop taking rows; rows still running after ``grace_seconds`` end interrupted. Returns at once."""
    global _drain_deadline
    deadline = time.monotonic() + max(0.0, grace_seconds)
    with _lock:
        # Only ever nearer: a cold shutdown after a warm one shortens the grace.
        _drain_deadline = deadline if _drain_deadline is None else min(_drain_deadline, deadline)
        engines = list(_engines)
    for engine in engines:
        engine.drain(grace_seconds=grace_seconds)


def draining() -> bool:
    """Whether this process is shutting down (no new generations start)."""
    return _drain_deadline is not None
