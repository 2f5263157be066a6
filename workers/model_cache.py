"""Models loaded once per worker process (in its engine process) and kept while they are in use.

A worker process owns one device; loading a model is its most expensive
step, so loaded models are kept (least recently used is closed first) and
reloaded only when the models table says the files changed, or when the engine
process that held them was lost (``workers.engine_process``).

Many task threads share a process (and a model's batch engine), so a model
is taken with :meth:`ModelCache.lease`: one in use is never closed under its
rows. Evicting or replacing it waits until its last lease ends; meanwhile the
cache may hold more models than its capacity.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from django.conf import settings

from tasks_app.selectors.tasks import model_find_by_name
from workers.backends.errors import ModelLoadError
from workers.engine_process.client import RemoteModel, model_load

logger = logging.getLogger(__name__)


@dataclass(eq=False)
class _Entry:
    digest: str
    model: RemoteModel
    users: int = 0
    retired: bool = False
    """Out of the cache (evicted or replaced); closed when its last user leaves."""


class ModelCache:
    def __init__(self, capacity: int) -> None:
        self.capacity = max(1, capacity)
        self._entries: OrderedDict[str, _Entry] = OrderedDict()
        self._lock = threading.Lock()

    @contextmanager
    def lease(self, name: str) -> Iterator[RemoteModel]:
        """The loaded model ``name``, kept open until the block ends; raises ``ModelLoadError``."""
        entry = self._acquire(name)
        try:
            yield entry.model
        finally:
            with self._lock:
                entry.users -= 1
                closing = entry.retired and entry.users == 0
            if closing:
                entry.model.close()

    def _retire(self, entry: _Entry) -> None:
        """Out of the cache; closed now if unused (the caller holds the lock)."""
        entry.retired = True
        if entry.users == 0:
            entry.model.close()

    def _acquire(self, name: str) -> _Entry:
        record = model_find_by_name(name)
        if record is None:
            raise ModelLoadError(f"model {name!r} is no longer registered")
        with self._lock:
            entry = self._entries.get(record.name)
            if entry is not None and entry.digest == record.digest and not entry.model.lost:
                self._entries.move_to_end(record.name)
                entry.users += 1
                return entry
            if entry is not None:
                del self._entries[record.name]
                self._retire(entry)
            idle = [key for key, cached in self._entries.items() if cached.users == 0]
            while len(self._entries) >= self.capacity and idle:
                old_name = idle.pop(0)
                logger.info("unloading model %s to make room", old_name)
                self._retire(self._entries.pop(old_name))
            started = time.perf_counter()
            # Into this worker's engine process (started here if it is not running, or was lost).
            model = model_load(
                record.backend,
                settings.LMSP_MODELS_DIR / record.path,
                silence_seconds=settings.LMSP_ENGINE_SILENCE_SECONDS,
                start_seconds=settings.LMSP_ENGINE_START_SECONDS,
                graph=record.graph,
                device=settings.LMSP_DEVICE,
                device_id=settings.LMSP_DEVICE_ID,
                prefill_chunk=settings.LMSP_PREFILL_CHUNK,
                intra_op_threads=settings.LMSP_INTRA_OP_THREADS or None,
                spinning=settings.LMSP_ORT_SPINNING,
                gpu_mem_limit=settings.LMSP_GPU_MEM_LIMIT_BYTES or None,
            )
            logger.info(
                "model %s loaded on %s (device %s, id %d) in %.0f ms",
                record.name,
                model.provider,
                settings.LMSP_DEVICE,
                settings.LMSP_DEVICE_ID,
                (time.perf_counter() - started) * 1000,
            )
            entry = _Entry(digest=record.digest, model=model, users=1)
            self._entries[record.name] = entry
            return entry

    def loaded(self) -> dict[str, str]:
        """The models loaded now, and the execution provider each runs on (its device)."""
        with self._lock:
            return {name: entry.model.provider for name, entry in self._entries.items() if not entry.retired}

    def clear(self) -> None:
        with self._lock:
            while self._entries:
                _, entry = self._entries.popitem()
                self._retire(entry)


_cache: ModelCache | None = None


def model_cache() -> ModelCache:
    """This process's cache (created in the worker child, after the fork)."""
    global _cache
    if _cache is None:
        _cache = ModelCache(settings.LMSP_WORKER_MAX_MODELS)
    return _cache
