"""What a task thread holds of its row in a batch engine (:class:`RowStream`): the chunks, as they come.

Any engine's rows use it: the ONNX batch engine's, in its model thread, and the engine process's
client (``workers.engine_process``), which puts the chunks the process sends.

The model thread puts each chunk on the row's queue and tells the reader
(:meth:`RowStream.notify`); a task thread reads them, merged as they queued,
and ends its row with :meth:`RowStream.stop`. Nothing here waits on the
model thread, and the model thread never waits on a reader.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterator

from workers.backends.base import Chunk, Generation


class RowStream:
    """What a task thread holds of its row: iterate it for chunks; :meth:`stop` ends the row.

    ``wake`` wakes the engine's model thread (so a stop is seen before the row's next call).
    """

    def __init__(self, generation: Generation, *, wake: Callable[[], None]) -> None:
        self.generation = generation
        self._wake = wake
        self._queue: queue.SimpleQueue[Chunk] = queue.SimpleQueue()
        self._arrived = threading.Event()
        self.stopped = threading.Event()
        self._notify: Callable[[], None] | None = None

    def stop(self) -> None:
        """End the row before its next model call (a lost compare-and-set, a task thread leaving)."""
        self.stopped.set()
        self._wake()

    def put(self, chunk: Chunk) -> None:
        self._queue.put(chunk)
        if not self._arrived.is_set():  # the first chunk only: set() takes a lock and wakes every waiter
            self._arrived.set()
        notify = self._notify
        if notify is not None:
            notify()

    def notify(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` (on the model thread: it must only hand over) whenever a chunk comes."""
        self._notify = callback
        if not self._queue.empty():
            callback()

    def take(self) -> Chunk | None:
        """What came since the last read, as one chunk (an error chunk as it is), or None: never waits."""
        try:
            chunk = self._queue.get_nowait()
        except queue.Empty:
            return None
        while not chunk.final:
            try:
                chunk = chunk.then(self._queue.get_nowait())
            except queue.Empty:
                break
        return chunk

    def ready(self, timeout: float) -> bool:
        """Whether a chunk has come, waiting at most ``timeout`` seconds for the first."""
        return self._arrived.wait(timeout)

    def __iter__(self) -> Iterator[Chunk]:
        """Chunks as they come; what queued meanwhile is merged, so a slow reader commits fewer, larger batches."""
        while True:
            chunk = self._queue.get()
            while not chunk.final:
                try:
                    chunk = chunk.then(self._queue.get_nowait())
                except queue.Empty:
                    break
            if chunk.error is not None:
                raise chunk.error
            yield chunk
            if chunk.final:
                return
