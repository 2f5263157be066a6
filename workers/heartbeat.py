"""The heartbeat thread of a task whose run commits nothing for a while (a model loading, a long prefill)."""

from __future__ import annotations

import logging
import threading
import time

from django.db import DatabaseError, connection

from tasks_app.core import lifecycle
from tasks_app.plumbing.database_outages import database_unavailable_noted
from workers.database_retries import one_line

# Every line of a task's run goes under one logger, wherever its code lives: an operator follows a run by it.
logger = logging.getLogger("workers.execution")


class Heartbeat:
    """Writes ``heartbeat_at`` while a model loads or a long prefill runs.

    Batch commits refresh the heartbeat themselves; this thread covers the
    stretches without commits, so that the reaper can tell a live worker from
    a dead one.
    """

    def __init__(self, task_id: str, worker: str, interval: float) -> None:
        self.task_id = task_id
        self.worker = worker
        self.interval = interval
        self._last = time.monotonic()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"heartbeat-{task_id}", daemon=True)

    def __enter__(self) -> Heartbeat:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def touched(self) -> None:
        """A commit just wrote ``heartbeat_at``: the thread need not write it again soon."""
        self._last = time.monotonic()

    @property
    def last(self) -> float:
        """When ``heartbeat_at`` was last written (``time.monotonic``), by a commit or a beat."""
        return self._last

    def _run(self) -> None:
        try:
            while not self._stop.wait(self.interval):
                if time.monotonic() - self._last < self.interval:
                    continue
                self._last = time.monotonic()
                try:
                    result = lifecycle.task_heartbeat(task_id=self.task_id, worker=self.worker)
                except Exception as exc:  # a missed heartbeat must not kill the run
                    if database_unavailable_noted(exc) is None:
                        logger.warning("heartbeat for %s failed: %s", self.task_id, one_line(exc))
                    if isinstance(exc, DatabaseError):
                        connection.close()  # the next beat opens a new connection
                    continue
                if not result.won:
                    return
        finally:
            connection.close()
