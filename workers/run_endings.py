"""How a run's generation becomes events: the batches it commits, and each way a run ends (succeeded,
cancelled, failed, handed back, left to the reaper), each through one lifecycle verb."""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from django.conf import settings
from django.db import DatabaseError, connection

from tasks_app.core import lifecycle
from tasks_app.core.lifecycle import TransitionResult
from tasks_app.exceptions import BackendError, DatabaseBusy, ModelLoadFailed, TaskNotFound
from tasks_app.generation.tool_call_parser import MalformedToolCall
from tasks_app.services.recovery import BUSY, held_task_release
from tasks_app.states import TaskStatus
from workers.backends.base import FINISH_CANCELLED, FINISH_LENGTH, Chunk
from workers.backends.errors import ConstraintFailed, ModelLoadError
from workers.database_retries import DatabaseGaveUp, committed, database_unavailable, one_line
from workers.run_metrics import commit_group_observed
from workers.run_problems import is_fault, runtime_problem
from workers.run_state import Run, ToolRun, run_usage
from workers.shutdown import SHUT_DOWN, task_handed_back_log

# Every line of a task's run goes under one logger, wherever its code lives: an operator follows a run by it.
logger = logging.getLogger("workers.execution")

S = TaskStatus


def progress_group(batches: Sequence[lifecycle.ProgressBatch]) -> list[TransitionResult | None]:
    results = committed(lifecycle.tasks_progress, batches=batches, subject=f"{len(batches)} tasks")
    commit_group_observed(batches[0].worker, len(batches))
    return results


def database_lost(task_id: str, worker: str, exc: DatabaseGaveUp) -> str:
    """The run could not write for the heartbeat timeout: it stopped; hand the task back by its policy.

    What its committed deltas hold stays its output (``resume`` continues
    after them, ``fail`` keeps them in the failed response); what was never
    committed was never shown. If the database still cannot be written, the
    task stays held by this (silent) worker, and the reaper applies the same
    policy once its heartbeat is old: either way, never a ``backend_error``.
    """
    reason = f"its worker could not write to the database for {exc.seconds:.0f} s"
    logger.error("task %s stopped: %s; handing it back by its on_restart policy", task_id, exc)
    try:
        summary = held_task_release(task_id=task_id, worker=worker, reason=reason)
    except (DatabaseBusy, DatabaseError) as again:
        if not database_unavailable(again):
            raise
        connection.close()
        logger.error(
            "task %s: the hand-back could not write either (%s); the reaper applies its on_restart policy "
            "once its heartbeat is %d s old",
            task_id,
            one_line(again),
            settings.LMSP_HEARTBEAT_TIMEOUT_SECONDS,
        )
        return "left to the reaper"
    if summary.counts[BUSY]:
        logger.error("task %s: the database is still locked; the reaper applies its on_restart policy", task_id)
        return "left to the reaper"
    if not summary.moved:
        # Reaped (and maybe resumed elsewhere) while this worker could not write: its late commits wrote nothing.
        logger.warning("task %s was taken from this worker while it could not write; it stops here", task_id)
        return "taken over"
    moved = [label for label, count in summary.counts.items() if count]
    logger.warning("task %s handed back after the database was lost: %s", task_id, ", ".join(moved))
    return "handed back"


def load_failure(run: Run, exc: Exception, sources: Iterable[TaskStatus]) -> str:
    """The outcome of failing the task because its model would not load."""
    if isinstance(exc, ModelLoadError):
        logger.warning("task %s: %s", run.task_id, exc)
        return fail(run, runtime_problem(exc), sources=sources)
    logger.error("task %s: loading model %s failed", run.task_id, run.model_name, exc_info=exc)
    return fail(run, ModelLoadFailed(f"Model {run.model_name!r} could not be loaded").to_problem(), sources)


def failed_by(run: Run, exc: Exception, sources: Iterable[TaskStatus]) -> str:
    """Fail the task by what its run raised.

    A problem of the request's own (a 4xx: a prompt over the context, an
    input the template refuses) is the client's to fix, and the failure's one
    line names it; anything else is a fault of the service, logged with its
    traceback.
    """
    problem = runtime_problem(exc)
    if is_fault(problem):
        logger.error("task %s: backend error", run.task_id, exc_info=exc)
    count_constraint_failure(run, exc)
    return fail(run, problem, sources=sources)


def count_constraint_failure(run: Run, exc: BaseException) -> None:
    if isinstance(exc, ConstraintFailed | MalformedToolCall):
        run.metrics.constraint_failed(run.output_tokens)


def read_chunk(run: Run, chunk: Chunk) -> None:
    """Take a chunk's steps into the pending batch (and its timing into the run's metrics)."""
    if chunk.tokens:
        # Timed on the model thread: a chunk read late still measures when its tokens came.
        run.metrics.batch_started(chunk.first_at, chunk.output_tokens - chunk.tokens)
        run.last_token_at = chunk.last_at
    run.chunk = chunk
    run.pending.extend(step.text for step in chunk.steps if step.text)
    run.pending_tokens += chunk.tokens


def stream_ended(run: Run) -> str:
    """The row left the engine: finish the task by how it ended."""
    assert run.chunk is not None and run.generation is not None
    run.metrics.generation_stopped(run.output_tokens, at=run.last_token_at or None)
    if run.chunk.interrupted:
        return hand_back(run)
    if run.generation.finish_reason == FINISH_CANCELLED:
        # The flag is only set by a committed move to cancelling; what the
        # pending batch held was never committed, so it is not part of the output.
        return finish_cancelled(run)
    return succeed(run)


def hand_back(run: Run) -> str:
    """The row stopped unfinished (the worker is stopping, or its engine process was lost): commit what it
    made, then apply the task's policy."""
    if run.pending_tokens or run.pending:
        lost = commit_result(run, progress_group([progress_batch(run)])[0])
        if lost is not None:
            return after_lost_race(run, lost)
    assert run.chunk is not None
    reason = run.chunk.reason or SHUT_DOWN
    summary = held_task_release(task_id=run.task_id, worker=run.worker, reason=reason)
    task_handed_back_log(task_id=run.task_id, summary=summary, reason=reason)
    return "handed back"


def progress_batch(run: Run) -> lifecycle.ProgressBatch:
    """The pending deltas and snapshot row, for the run loop's next group commit."""
    return lifecycle.ProgressBatch(
        task_id=run.task_id,
        worker=run.worker,
        item_id=run.item_id,
        deltas=run.pending,
        output_tokens=run.output_tokens,
        snapshot=run.snapshot(),
        item_events=run.tools.pending_events if run.tools is not None else None,
    )


def commit_result(run: Run, result: TransitionResult | None) -> TransitionResult | None:
    """Take in a batch's committed result; the lost compare-and-set's result if another writer moved the task."""
    if result is None:
        raise TaskNotFound(f"task {run.task_id} does not exist")
    if not result.won:
        run.metrics.generation_stopped(run.output_tokens, at=run.last_token_at or None)
        return result
    batch_stored(run, result)
    return None


def batch_stored(run: Run, result: TransitionResult) -> None:
    """The pending batch was committed (by ``result``): it is the event log's now."""
    run.metrics.batch_committed(events=len(result.events), tokens=run.pending_tokens)
    run.heartbeat.touched()
    run.snapshot_stored()
    run.committed_text.extend(run.pending)
    run.pending, run.pending_tokens = [], 0
    if run.tools is not None:
        run.tools.pending_events = []


def succeed(run: Run) -> str:
    generation = run.generation
    assert generation is not None
    incomplete = generation.finish_reason == FINISH_LENGTH
    if run.tools is not None:
        return succeed_with_items(run, run.tools, incomplete)
    done = committed(
        lifecycle.task_succeed,
        task_id=run.task_id,
        worker=run.worker,
        item_id=run.item_id,
        deltas=run.pending,
        text=run.text() + "".join(run.pending),
        usage=run_usage(generation),
        output_tokens=generation.output_tokens,
        incomplete=incomplete,
        stop_sequence=generation.stop_sequence,
    )
    if not done.won:
        return after_lost_race(run, done)
    run.metrics.batch_committed(events=len(done.events), tokens=run.pending_tokens)
    status = done.task.response.status
    logger.info(
        "task %s %s: %d output tokens (%s)", run.task_id, status, generation.output_tokens, generation.finish_reason
    )
    return str(status)


def succeed_with_items(run: Run, tools: ToolRun, incomplete: bool) -> str:
    generation = run.generation
    assert generation is not None
    try:
        tools.end(incomplete=incomplete)
    except MalformedToolCall as exc:
        count_constraint_failure(run, exc)
        return fail(run, BackendError(str(exc)).to_problem(), sources=[S.RUNNING])
    done = committed(
        lifecycle.task_succeed,
        task_id=run.task_id,
        worker=run.worker,
        item_id=run.item_id,
        text="",
        usage=run_usage(generation),
        output_tokens=generation.output_tokens,
        incomplete=incomplete,
        stop_sequence=generation.stop_sequence,
        items=tools.items,
        item_events=tools.pending_events,
    )
    if not done.won:
        return after_lost_race(run, done)
    run.metrics.batch_committed(events=len(done.events), tokens=run.pending_tokens)
    logger.info(
        "task %s %s: %d output tokens (%s), %d tool calls",
        run.task_id,
        done.task.response.status,
        generation.output_tokens,
        generation.finish_reason,
        tools.parser.calls,
    )
    return str(done.task.response.status)


def finish_cancelled(run: Run) -> str:
    result = committed(lifecycle.task_finish_cancel, task_id=run.task_id, worker=run.worker, partial=run.partial())
    if result.won:
        run.metrics.cancelled(result.task)
        logger.info("task %s cancelled", run.task_id)
        return "cancelled"
    logger.warning("task %s: expected cancelling and ours, found %s", run.task_id, result.task.status)
    return str(result.task.status)


def after_lost_race(run: Run, result: TransitionResult) -> str:
    """Another writer moved the task (or took it over): honour a cancel, otherwise just stop."""
    status = result.task.status
    if status == S.CANCELLING:
        return finish_cancelled(run)
    logger.warning("task %s left to %s by another writer; stopping", run.task_id, status)
    return str(status)


def fail(run: Run, problem: Mapping[str, Any], sources: Iterable[TaskStatus]) -> str:
    result = committed(
        lifecycle.task_fail,
        task_id=run.task_id,
        error=problem,
        worker=run.worker,
        sources=sources,
        partial=run.partial(),
    )
    if result.won:
        if is_fault(problem):
            logger.info("task %s failed: %s", run.task_id, problem.get("code"))
        else:
            # The client's problem, said once and whole: its code and what the request got wrong.
            logger.info("task %s failed: %s: %s", run.task_id, problem.get("code"), problem.get("detail"))
        return "failed"
    return after_lost_race(run, result)
