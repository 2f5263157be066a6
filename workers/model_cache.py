"""Models loaded once per worker process and kept while they are in use.

A worker process owns one device; loading a model is its most expensive
step, so loaded models are kept (least recently used is closed first) and
reloaded only when the models table says the files changed.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass

from django.conf import settings

from tasks_app.selectors import model_find_by_name
from workers.backends import get_backend
from workers.backends.base import LoadedModel
from workers.backends.errors import ModelLoadError

logger = logging.getLogger(__name__)


@dataclass
class _Entry:
    digest: str
    model: LoadedModel


class ModelCache:
    def __init__(self, capacity: int) -> None:
        self.capacity = max(1, capacity)
        self._entries: OrderedDict[str, _Entry] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, name: str) -> LoadedModel:
        """The loaded model ``name`` (as the models table knows it); raises ``ModelLoadError``."""
        record = model_find_by_name(name)
        if record is None:
            raise ModelLoadError(f"model {name!r} is no longer registered")
        with self._lock:
            entry = self._entries.get(record.name)
            if entry is not None and entry.digest == record.digest:
                self._entries.move_to_end(record.name)
                return entry.model
            if entry is not None:
                del self._entries[record.name]
                entry.model.close()
            while len(self._entries) >= self.capacity:
                old_name, old = self._entries.popitem(last=False)
                logger.info("unloading model %s to make room", old_name)
                old.model.close()
            started = time.perf_counter()
            model = get_backend(record.backend).load(
                settings.LMSP_MODELS_DIR / record.path,
                graph=record.graph,
                device=settings.LMSP_DEVICE,
                device_id=settings.LMSP_DEVICE_ID,
                prefill_chunk=settings.LMSP_PREFILL_CHUNK,
                intra_op_threads=settings.LMSP_INTRA_OP_THREADS or None,
                spinning=settings.LMSP_ORT_SPINNING,
            )
            logger.info(
                "model %s loaded on %s (device %s, id %d) in %.0f ms",
                record.name,
                model.provider,
                settings.LMSP_DEVICE,
                settings.LMSP_DEVICE_ID,
                (time.perf_counter() - started) * 1000,
            )
            self._entries[record.name] = _Entry(digest=record.digest, model=model)
            return model

    def clear(self) -> None:
        with self._lock:
            while self._entries:
                _, entry = self._entries.popitem()
                entry.model.close()


_cache: ModelCache | None = None


def model_cache() -> ModelCache:
    """This process's cache (created in the worker child, after the fork)."""
    global _cache
    if _cache is None:
        _cache = ModelCache(settings.LMSP_WORKER_MAX_MODELS)
    return _cache
