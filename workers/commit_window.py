"""One worker process's progress commits: every row's pending deltas in one transaction per window.

Each task thread used to commit its own batches, one transaction each: at 32
rows, 32 threads queued for the write lock, each paying its own BEGIN,
COMMIT and Django round trip under the GIL the model thread needs. Here a
task thread hands its batch to the process's committer and waits for the
outcome; the committer takes every batch that came in while its last
transaction ran and writes them together (``lifecycle.tasks_progress``),
each task's compare-and-set checked on its own, so a cancelled task loses
alone. The window is the length of the last commit: nothing waits on a
timer, and an idle committer writes a lone batch (a task's first delta
among them) at once.

The durability rules do not change: a task thread learns its batch's outcome
only after the commit, and only then goes on (its snapshot stored, its
heartbeat stamped), exactly as when it committed itself.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from tasks_app.lifecycle import ProgressBatch, TransitionResult

logger = logging.getLogger(__name__)

Commit = Callable[[Sequence[ProgressBatch]], list[TransitionResult | None]]

# The most batches one transaction takes: with hundreds of rows a transaction
# stays short enough that the next group's first delta does not wait long.
MAX_GROUP = 256


@dataclass
class Outcome:
    """What a batch's commit did: ``result`` (None: no such task), or the ``error`` that failed its group."""

    result: TransitionResult | None = None
    error: BaseException | None = None
    group: int = 0
    """How many tasks the transaction wrote together (this one included)."""
    done: threading.Event = field(default_factory=threading.Event)


class CommitWindow:
    """The committer of one process: :meth:`progress` from any task thread, one transaction per group."""

    def __init__(self, commit: Commit, *, observe: Callable[[str, int], None] | None = None) -> None:
        self._commit = commit
        self._observe = observe
        self._lock = threading.Condition()
        self._queue: list[tuple[ProgressBatch, Outcome]] = []
        self._thread: threading.Thread | None = None

    def progress(self, batch: ProgressBatch) -> Outcome:
        """Commit ``batch`` with whatever else is waiting; returns once it is committed (or failed)."""
        outcome = Outcome()
        with self._lock:
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="lmsp-commit-window", daemon=True)
                self._thread.start()
            self._queue.append((batch, outcome))
            self._lock.notify()
        outcome.done.wait()
        return outcome

    @property
    def waiting(self) -> int:
        """Batches handed in and not yet taken into a transaction."""
        with self._lock:
            return len(self._queue)

    def _run(self) -> None:
        while True:
            with self._lock:
                while not self._queue:
                    self._lock.wait()
                group, self._queue = self._queue[:MAX_GROUP], self._queue[MAX_GROUP:]
            self._write(group)

    def _write(self, group: list[tuple[ProgressBatch, Outcome]]) -> None:
        try:
            results = self._commit([batch for batch, _ in group])
            if len(results) != len(group):
                raise RuntimeError(f"a group commit of {len(group)} batches returned {len(results)} results")
        except BaseException as exc:  # every waiting thread gets it: its run decides, as with its own commit
            for _, outcome in group:
                outcome.error = exc
                outcome.done.set()
            return
        for (_, outcome), result in zip(group, results, strict=True):
            outcome.result, outcome.group = result, len(group)
            outcome.done.set()
        if self._observe is not None:
            self._observe(group[0][0].worker, len(group))
