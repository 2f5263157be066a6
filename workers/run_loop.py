"""The run loop: one thread per worker process that carries every started generation to its end.

A task's intake (``workers.execution``: the claim, the model, the set-up,
the start) runs in a Celery task thread; once the task is running, its row
is handed to this loop and the thread is free for the next message. So a
worker holds as many rows as its engines admit, not as many as it has
threads and database connections: rows cost no thread and no connection
(``docs/workers.md``, issue 28).

The loop sleeps until a row's stream has a chunk (the engine's model thread
only puts the row on a queue: it never waits here), takes every row that is
ready, and hands them to ``advance`` together, which commits all their
batches in one transaction (``tasks_progress``) and finishes the rows that
ended. Chunks that come while that transaction runs are merged into the
next one, so the slower the database, the larger and fewer the commits.
Every ``beat_seconds`` it asks ``beat`` to write the heartbeat of the rows
that committed nothing for that long (a long prefill beside running rows),
so the reaper can tell them from a dead worker's.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Iterable
from typing import Generic, Protocol, TypeVar

logger = logging.getLogger(__name__)


class Held(Protocol):
    """A row in the loop: its stream, and when its task's heartbeat was last written."""

    @property
    def last_beat(self) -> float: ...


H = TypeVar("H", bound=Held)


class RunLoop(Generic[H]):
    """See the module docstring. ``advance`` returns the rows that ended (they leave the loop)."""

    def __init__(
        self,
        *,
        advance: Callable[[list[H]], Iterable[H]],
        beat: Callable[[list[H]], None],
        beat_seconds: float,
        name: str = "lmsp-run-loop",
    ) -> None:
        self._advance = advance
        self._beat = beat
        self.beat_seconds = beat_seconds
        self._name = name
        self._ready: queue.SimpleQueue[H] = queue.SimpleQueue()
        self._held: dict[int, H] = {}
        self._reserved = 0
        self._changed = threading.Condition()
        self._thread: threading.Thread | None = None

    def reserve(self, limit: int, timeout: float) -> bool:
        """Take a place for a row about to start, once fewer than ``limit`` are carried or reserved.

        False if ``timeout`` passed first. The place becomes the row's in :meth:`hold`, or goes
        back with :meth:`unreserve` if the task never reaches the loop.
        """
        with self._changed:
            if not self._changed.wait_for(lambda: len(self._held) + self._reserved < limit, timeout):
                return False
            self._reserved += 1
            return True

    def unreserve(self) -> None:
        with self._changed:
            self._reserved = max(0, self._reserved - 1)
            self._changed.notify_all()

    def hold(self, row: H, notify: Callable[[Callable[[], None]], None]) -> None:
        """Carry ``row`` from now on (in its reserved place, if it has one); ``notify`` registers the
        callback its stream calls for each chunk."""
        with self._changed:
            self._reserved = max(0, self._reserved - 1)
            self._held[id(row)] = row
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._loop, name=self._name, daemon=True)
                self._thread.start()
        notify(lambda: self._ready.put(row))
        # Once at once: a row may hold a chunk already taken from its stream.
        self._ready.put(row)

    @property
    def held(self) -> int:
        """Rows carried now."""
        return len(self._held)

    @property
    def taken(self) -> int:
        """Places taken now: rows carried, and rows reserved that are still starting."""
        with self._changed:
            return len(self._held) + self._reserved

    def wait_empty(self, timeout: float) -> bool:
        """Wait until no row is carried (a shutdown's last hand-backs); False if ``timeout`` passed first."""
        with self._changed:
            return self._changed.wait_for(lambda: not self._held, timeout)

    def _loop(self) -> None:
        next_beat = time.monotonic() + self.beat_seconds
        while True:
            try:
                first = self._ready.get(timeout=max(0.0, next_beat - time.monotonic()))
            except queue.Empty:
                first = None
            ready: dict[int, H] = {} if first is None else {id(first): first}
            while True:
                try:
                    row = self._ready.get_nowait()
                except queue.Empty:
                    break
                ready.setdefault(id(row), row)
            rows = [row for key, row in ready.items() if key in self._held]
            if rows:
                self._run(rows)
            now = time.monotonic()
            if now >= next_beat:
                next_beat = now + self.beat_seconds
                quiet = [row for row in list(self._held.values()) if now - row.last_beat >= self.beat_seconds]
                if quiet:
                    try:
                        self._beat(quiet)
                    except Exception:  # a missed heartbeat must not stop the rows
                        logger.exception("the run loop's heartbeat failed")

    def _run(self, rows: list[H]) -> None:
        try:
            ended = list(self._advance(rows))
        except Exception:
            # ``advance`` ends each row's failures itself; this is a bug, and the rows must not wait on it forever.
            logger.exception("the run loop could not advance %d rows; trying them again", len(rows))
            time.sleep(0.1)
            for row in rows:
                self._ready.put(row)
            return
        if ended:
            with self._changed:
                for row in ended:
                    self._held.pop(id(row), None)
                self._changed.notify_all()
