"""The started runs, carried by the process's run loop (``workers.run_loop``): each step reads every
ready row's chunks and commits their batches in one transaction; a row that ended is released."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass, field

from django.conf import settings
from django.db import DatabaseError, connection

from tasks_app.core import lifecycle
from tasks_app.core.lifecycle import TransitionResult
from tasks_app.exceptions import BackendError
from tasks_app.generation.tool_call_parser import MalformedToolCall
from tasks_app.plumbing.database_outages import database_unavailable_noted
from tasks_app.states import TaskStatus
from workers.backends.base import Chunk, RowStream
from workers.database_retries import DatabaseGaveUp, Result, one_line
from workers.run_endings import (
    after_lost_race,
    commit_result,
    count_constraint_failure,
    database_lost,
    fail,
    failed_by,
    progress_batch,
    progress_group,
    read_chunk,
    stream_ended,
)
from workers.run_loop import RunLoop
from workers.run_state import Run

# Every line of a task's run goes under one logger, wherever its code lives: an operator follows a run by it.
logger = logging.getLogger("workers.execution")

S = TaskStatus


@dataclass(eq=False)
class Held:
    """A started run as the run loop carries it: its row's stream, and what its end releases."""

    run: Run
    stream: RowStream
    head: Chunk | None = None
    """A chunk already taken from the stream (by the start), read before the stream's next."""
    resources: ExitStack = field(default_factory=ExitStack)
    """The model's lease, the cancel watch, the run's metrics: closed when the run ends."""
    done: threading.Event = field(default_factory=threading.Event)
    outcome: str = ""

    @property
    def last_beat(self) -> float:
        return self.run.heartbeat.last

    def take(self) -> Chunk | None:
        chunk, self.head = self.head, None
        later = self.stream.take()
        if chunk is None or chunk.final:
            return chunk or later
        return chunk if later is None else chunk.then(later)


def rows_advance(rows: list[Held]) -> list[Held]:
    """The run loop's step: read every ready row's chunks, commit their batches in one transaction,
    end the rows that ended. Returns those; never raises (each row's failure ends that row alone)."""
    ended: list[Held] = []
    batches: list[tuple[Held, lifecycle.ProgressBatch]] = []
    for held in rows:
        step = _guarded(held, lambda held=held: _read_step(held))
        if isinstance(step, lifecycle.ProgressBatch):
            batches.append((held, step))
        elif step is not None:
            _end(held, step)
            ended.append(held)
    if not batches:
        return ended
    try:
        results: list[TransitionResult | None] | None = progress_group([batch for _, batch in batches])
        error: BaseException | None = None
    except Exception as exc:  # DatabaseGaveUp, or a bug: each row ends by it as its own commit would
        results, error = None, exc
    for index, (held, _) in enumerate(batches):
        result = None if results is None else results[index]
        outcome = _guarded(held, lambda held=held, result=result: _progressed(held, result, error))
        if outcome is not None:
            _end(held, outcome)
            ended.append(held)
    return ended


def _read_step(held: Held) -> lifecycle.ProgressBatch | str | None:
    """What the row made since its last commit: a batch to commit, how the run ended, or None (nothing)."""
    run, stream = held.run, held.stream
    chunk = held.take()
    if chunk is None:
        return None
    if chunk.error is not None:
        raise chunk.error
    read = len(run.pending)
    read_chunk(run, chunk)
    texts = run.pending[read:]
    if run.tools is not None and texts:
        try:
            run.tools.read("".join(texts))
        except MalformedToolCall as exc:
            stream.stop()
            count_constraint_failure(run, exc)
            return fail(run, BackendError(str(exc)).to_problem(), sources=[S.RUNNING])
    if chunk.final:
        stream.stop()
        return stream_ended(run)
    return progress_batch(run)


def _progressed(held: Held, result: TransitionResult | None, error: BaseException | None) -> str | None:
    """After the group commit: None if the row goes on, else how its run ended (a lost compare-and-set)."""
    if isinstance(error, DatabaseGaveUp):  # said per task, as its own commit would have said it
        raise DatabaseGaveUp("task_progress", held.run.task_id, error.seconds, error.cause) from error.cause
    if error is not None:
        raise error
    lost = commit_result(held.run, result)
    if lost is None:
        return None
    held.stream.stop()
    return after_lost_race(held.run, lost)


def _guarded(held: Held, action: Callable[[], Result]) -> Result | str:
    """``action``, or how the run ended when it raised: handed back if the database was lost, else failed."""
    run = held.run
    try:
        return action()
    except DatabaseGaveUp as exc:
        held.stream.stop()
        return database_lost(run.task_id, run.worker, exc)
    except Exception as exc:
        held.stream.stop()
        try:
            return failed_by(run, exc, sources=[S.RUNNING])
        except DatabaseGaveUp as again:
            return database_lost(run.task_id, run.worker, again)
        except Exception:
            logger.exception("task %s: could not be failed; the reaper applies its on_restart policy", run.task_id)
            return "left to the reaper"


def _end(held: Held, outcome: str) -> None:
    held.outcome = outcome
    try:
        held.resources.close()
    except Exception:
        logger.exception("task %s: releasing its run failed", held.run.task_id)
    finally:
        held.done.set()


def rows_beat(rows: list[Held]) -> None:
    """The run loop's heartbeat for rows that committed nothing for a while (a long prefill)."""
    for held in rows:
        run = held.run
        try:
            lifecycle.task_heartbeat(task_id=run.task_id, worker=run.worker)
        except Exception as exc:  # a missed heartbeat must not stop the rows
            if database_unavailable_noted(exc) is None:
                logger.warning("heartbeat for %s failed: %s", run.task_id, one_line(exc))
            if isinstance(exc, DatabaseError):
                connection.close()  # the next beat opens a new connection
            continue
        # A lost one (the task moved on) is seen by the row's next commit, which stops it.
        run.heartbeat.touched()


run_loop: RunLoop[Held] = RunLoop(advance=rows_advance, beat=rows_beat, beat_seconds=settings.LMSP_HEARTBEAT_SECONDS)


def run_loop_taken() -> int:
    """Places of this process's rows taken now (running, or claimed and starting)."""
    return run_loop.taken


def run_loop_empty(*, timeout: float) -> bool:
    """Wait until the run loop carries no row (a shutdown's hand-backs done); False on ``timeout``."""
    return run_loop.wait_empty(timeout)
