"""Running one task: claim, load, generate, commit in batches, finish exactly once.

This module decides which lifecycle verb to call and when; the verbs
(``tasks_app.core.lifecycle``) write the columns and build the events. The claim
``queued -> loading`` is a compare-and-set, so a duplicated or redelivered
message whose task is no longer queued is dropped here, and Celery never
decides what runs.

The generation itself runs in the process's batch engine for its model
(``workers.engines``): the task thread submits it and the run loop reads its
chunks, while the engine's model thread steps it together with the other
tasks' rows. So this module is the only place that touches the database for
a task, and the model never waits for it.

Deltas are committed in batches: the engine hands over a row's first token
at once, then every ``LMSP_DELTA_BATCH_TOKENS`` tokens or
``LMSP_DELTA_BATCH_MS`` milliseconds, and what piled up while a commit ran
is merged into the next one. Each batch appends the deltas, stores the
snapshot row and checks, through the compare-and-set on ``running``, that no
cancel won meanwhile. Once started, a row is carried by the process's run
loop (``workers.run_loop``), not by a thread of its own: the loop writes the
batches of all its rows that are ready in one transaction
(``tasks_progress``), each task's compare-and-set on its own. The engine
watches a flag the cancel watcher sets from Redis before every model call
of the row, so a cancel stops its row within one decode step; a lost
compare-and-set stops the row from here.

The run is carved by concern: this module takes a task in (claim, model,
set-up, start); ``workers.run_rows`` carries the started rows;
``workers.run_endings`` commits their batches and ends them;
``workers.run_state`` is what a run knows; ``workers.database_retries``,
``workers.heartbeat`` and ``workers.run_problems`` serve them all; and
``workers.generation_inputs`` maps the task's generation spec onto the
runtime.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from contextlib import ExitStack

from django.conf import settings
from django.db import close_old_connections

from tasks_app import states
from tasks_app.core import lifecycle
from tasks_app.core.lifecycle import TransitionResult
from tasks_app.core.output_items import OutputItems
from tasks_app.exceptions import ServerRestarted, TaskNotFound
from tasks_app.generation.spec import GenerationSpec
from tasks_app.generation.tool_call_parser import ToolCallParser
from tasks_app.ids import new_message_id
from tasks_app.plumbing import broker
from tasks_app.plumbing.affinity import affinity_remember
from tasks_app.selectors.tasks import (
    StoredSnapshot,
    task_output_items,
    task_output_text,
    task_run_spec,
    task_snapshot_get,
)
from tasks_app.services.dispatch import task_dispatch
from tasks_app.states import TaskStatus
from workers.backends.base import Chunk, LoadedModel, RowStream
from workers.cancel_watcher import cancel_watcher
from workers.database_retries import DatabaseGaveUp, committed
from workers.engines import engine_for, engines_full, max_rows
from workers.generation_inputs import prompt_of, sampling_params_of, tool_format_of, tool_prompt_of
from workers.heartbeat import Heartbeat
from workers.model_cache import model_cache
from workers.run_endings import (
    after_lost_race,
    batch_stored,
    database_lost,
    fail,
    failed_by,
    finish_cancelled,
    load_failure,
    read_chunk,
)
from workers.run_metrics import RunMetrics
from workers.run_rows import Held, run_loop
from workers.run_state import Run, ToolRun

logger = logging.getLogger(__name__)

S = TaskStatus


# A claim waits this long for a database it cannot reach, then, after a pause, sends its message again.
CLAIM_PATIENCE_SECONDS = 5.0


CLAIM_RETRY_PAUSE_SECONDS = 2.0


# How often a task thread waiting for room among the rows checks whether the worker is stopping.
ROOM_POLL_SECONDS = 0.5


def room_wait(*, stopping: Callable[[], bool]) -> bool:
    """Wait for a place among this process's rows (``LMSP_MAX_BATCH``, or as the KV budget allows) before a
    task is claimed.

    A task thread only claims what the process can run now, so a busy worker
    leaves the queue's messages to the others. False if ``stopping`` became
    true meanwhile: the message goes back to the queue. The place is the
    claimed task's until its run ends (:func:`task_execute` gives it back).
    """
    while True:
        if run_loop.reserve(max_rows(), timeout=ROOM_POLL_SECONDS):
            # Automatic batch size: the rows the KV budgets hold. A row held back for the budget means
            # the engine is full: the next task waits here, unclaimed, free for another worker. (Task
            # threads check at once, so each may have claimed one task that now waits in the engine.)
            if settings.LMSP_MAX_BATCH or not engines_full():
                return True
            run_loop.unreserve()
            time.sleep(ROOM_POLL_SECONDS / 10)
        if stopping():
            return False


def task_execute(*, task_id: str, worker: str, wait: bool = True, reserved: bool = False) -> str:
    """Run one task to a terminal state, or (``wait`` False) until its row runs in the run loop.

    Returns what happened (for the log and tests): the terminal outcome, or
    ``"running"`` for a row handed to the run loop. Claims a queued task, or
    adopts one that recovery left ``running`` without a worker and resumes it
    from its snapshot. Never raises for a task's own failure: load errors and
    backend errors end the task as ``failed`` and the worker process goes on
    to the next task. ``reserved``: :func:`room_wait` took this task's place.
    """
    if not reserved:
        run_loop.reserve(max_rows(), timeout=None)
    held = None
    try:
        outcome = _intake(task_id, worker)
        if isinstance(outcome, str):
            return outcome
        held = outcome
    finally:
        if held is None:
            run_loop.unreserve()
    run_loop.hold(held, held.stream.notify)
    if not wait:
        return "running"
    held.done.wait()
    return held.outcome


# The tasks a thread of this process is claiming or running now. A second message of one (a duplicate, the
# sweeper's) is dropped here; and only a task absent from it may be taken up as this worker's own when the
# database shows it ``loading`` under this worker's name (a claim whose answer the connection lost).
_intakes: set[str] = set()


_intakes_lock = threading.Condition()

# How long a message waits for this worker's own thread to let its task go. A row this worker handed
# back while it goes on (its engine process was lost) is requeued before the thread that ran it has
# closed the run; the new message must not be dropped as a duplicate of that ending run.
INTAKE_RELEASE_WAIT_SECONDS = 5.0


def _intake(task_id: str, worker: str) -> str | Held:
    """Claim (or adopt), load, set up and start the task: its row, or how the task ended before."""
    broker.dispatch_marker_clear(task_id=task_id)
    with _intakes_lock:
        if not _intakes_lock.wait_for(lambda: task_id not in _intakes, timeout=INTAKE_RELEASE_WAIT_SECONDS):
            logger.info("dropped message for task %s: a thread of this worker has it", task_id)
            return "dropped"
        _intakes.add(task_id)
    outcome: str | Held = "dropped"
    try:
        outcome = _intake_claimed(task_id, worker)
        return outcome
    finally:
        if not isinstance(outcome, Held):
            _intake_ended(task_id)


def _claim_lost_in_transit(claim: TransitionResult, worker: str) -> bool:
    """Whether a lost claim was this worker's own: a try whose commit reached the database while the
    connection broke before its answer came (a server restart, a cut network), so that its retry found the
    task already ``loading`` under this worker's name. No thread of this process has it (``_intakes``)."""
    return not claim.won and claim.task.status == S.LOADING and claim.task.worker == worker


def _intake_claimed(task_id: str, worker: str) -> str | Held:
    close_old_connections()
    try:
        claim = committed(lifecycle.task_claim, patience=CLAIM_PATIENCE_SECONDS, task_id=task_id, worker=worker)
        resuming = False
        if not claim.won and claim.task.status in states.ORPHANABLE and claim.task.worker == "":
            claim = committed(lifecycle.task_adopt, patience=CLAIM_PATIENCE_SECONDS, task_id=task_id, worker=worker)
            resuming = claim.won
    except TaskNotFound:
        logger.info("dropped message for task %s: no such task", task_id)
        return "missing"
    except DatabaseGaveUp as exc:
        return _claim_not_reached(task_id, worker, exc)
    ours = _claim_lost_in_transit(claim, worker)
    if not claim.won and not ours:
        logger.info("dropped message for task %s: it is %s, not queued", task_id, claim.task.status)
        return "dropped"
    how = "adopted to resume" if resuming else "claimed (its first claim's answer was lost)" if ours else "claimed"
    logger.info("task %s %s by %s", task_id, how, worker)
    metrics = RunMetrics(worker=worker, accepted_at=None if resuming else claim.task.created_at)
    with ExitStack() as resources:
        # Released in this order when the run ends: the model's lease, the cancel watch, the metrics, the
        # task's place in _intakes.
        resources.callback(_intake_ended, task_id)
        resources.callback(metrics.run_ended)
        cancelled = cancel_watcher.watch(task_id)
        resources.callback(cancel_watcher.unwatch, task_id)
        try:
            with Heartbeat(task_id, worker, settings.LMSP_HEARTBEAT_SECONDS) as heartbeat:
                if resuming:
                    outcome = _resume(task_id, worker, claim.task.status, cancelled, heartbeat, metrics, resources)
                else:
                    outcome = _run(task_id, worker, cancelled, heartbeat, metrics, resources)
        except DatabaseGaveUp as exc:
            return database_lost(task_id, worker, exc)
        if isinstance(outcome, Held):
            # From here the run loop carries the row, and ends these with it.
            outcome.resources = resources.pop_all()
        return outcome


def _intake_ended(task_id: str) -> None:
    with _intakes_lock:
        _intakes.discard(task_id)
        _intakes_lock.notify_all()


def _claim_not_reached(task_id: str, worker: str, exc: DatabaseGaveUp) -> str:
    """The claim could not reach the database: the task is as it was, still waiting, or (a try whose
    answer the broken connection lost) ``loading`` under this worker's name.

    Its message must not go with this try: after a pause (a cut-off worker
    must not spin on it), a new one goes on the queue, with its marker, before
    this one is acknowledged. A worker that can reach the database takes it,
    or this one once it can. When a try broke on an open connection (its
    commit may have landed) the message prefers this worker's node, which
    alone can take the task up then (``_claim_lost_in_transit``); a worker
    that never reached the database sends it to any. If Redis fails too, the
    sweeper sends it (no marker vouches for it).
    """
    logger.info("task %s: %s; sending its message again", task_id, exc)
    time.sleep(CLAIM_RETRY_PAUSE_SECONDS)
    task_dispatch(task_id=task_id, prefer_worker=worker if exc.maybe_written else "")
    return "sent again"


def _model_leased(run: Run, resources: ExitStack) -> LoadedModel:
    """The run's model, leased until ``resources`` close. Its record is read from the database: an outage
    there is waited out as a commit's is, never taken for a model that does not load."""

    def model_lease() -> LoadedModel:
        return resources.enter_context(model_cache().lease(run.model_name))

    return committed(model_lease, subject=run.task_id)


def _run(
    task_id: str,
    worker: str,
    cancelled: threading.Event,
    heartbeat: Heartbeat,
    metrics: RunMetrics,
    resources: ExitStack,
) -> str | Held:
    # The run's reads wait out a database that is away as its commits do (committed): an outage while a
    # task starts must not fail it, nor leave it to the reaper.
    spec = committed(task_run_spec, task_id=task_id)
    model_name = spec.model
    # Later turns of this conversation that the client echoes back prefer this node (tasks_app.plumbing.affinity).
    affinity_remember(conversation=spec.conversation_key(), worker=worker)
    run = Run(
        task_id=task_id,
        worker=worker,
        item_id=new_message_id(),
        heartbeat=heartbeat,
        metrics=metrics,
        model_name=model_name,
        calls_tools=spec.calls_tools,
    )
    try:
        model = _model_leased(run, resources)
    except DatabaseGaveUp:
        raise
    except Exception as exc:
        return load_failure(run, exc, [S.LOADING])
    try:
        return _generate(run, model, spec, cancelled)
    except DatabaseGaveUp:
        raise
    except Exception as exc:
        return failed_by(run, exc, sources=states.HELD & states.sources_for(S.FAILED))


def _resume(
    task_id: str,
    worker: str,
    status: str,
    cancelled: threading.Event,
    heartbeat: Heartbeat,
    metrics: RunMetrics,
    resources: ExitStack,
) -> str | Held:
    """Continue a task from its snapshot: the same output item, right after its last committed event."""
    spec = committed(task_run_spec, task_id=task_id)
    model_name = spec.model
    stored = committed(task_snapshot_get, task_id=task_id)
    _, text = committed(task_output_text, task_id=task_id)
    item_id = stored.last_state.get("item_id") if stored is not None else None
    run = Run(
        task_id=task_id,
        worker=worker,
        item_id=item_id or new_message_id(),
        heartbeat=heartbeat,
        metrics=metrics,
        model_name=model_name,
        calls_tools=spec.calls_tools,
    )
    run.committed_text = [text]
    if status == S.CANCELLING:
        # Cancelled while it waited for a worker: nothing to generate.
        return finish_cancelled(run)
    if stored is None or not item_id:
        problem = ServerRestarted("The service restarted and the task has no snapshot to resume from").to_problem()
        return fail(run, problem, sources=[S.RUNNING])
    run.stored_tokens, run.prompt_stored = len(stored.token_ids), True
    try:
        model = _model_leased(run, resources)
    except DatabaseGaveUp:
        raise
    except Exception as exc:
        return load_failure(run, exc, [S.RUNNING])
    fmt = tool_format_of(model, model_name)
    if spec.calls_tools:
        # The parser reads the committed text again (its reading does not depend on the cuts) and the
        # items are the ones the event log shows: both as they were at the last commit.
        text = stored.raw_text
        run.tools = ToolRun(
            ToolCallParser(fmt, max_calls=spec.tool_choice.max_calls),
            OutputItems(
                committed(task_output_items, task_id=task_id),
                call_id_length=fmt.call_id_length,
                namespaces=spec.namespaces,
            ),
        )
        run.tools.parser.feed(text)
        run.committed_text = [text]
    return _resume_generation(run, model, spec, stored, text, cancelled)


def _resume_generation(
    run: Run,
    model: LoadedModel,
    spec: GenerationSpec,
    stored: StoredSnapshot,
    text: str,
    cancelled: threading.Event,
) -> str | Held:
    try:
        backend_state = {
            **stored.last_state["backend"],
            "prompt_ids": stored.first_state["backend"]["prompt_ids"],
            "generated_ids": stored.token_ids,
            "text": text,
        }
        params = sampling_params_of(spec, model, run.model_name)
        run.generation = model.resume(backend_state, params, should_stop=cancelled.is_set)
        logger.info(
            "task %s resumed after %d output tokens, seed %d",
            run.task_id,
            run.generation.output_tokens,
            run.generation.seed,
        )
        return Held(run, _submit(run, model))
    except DatabaseGaveUp:
        raise
    except Exception as exc:
        return failed_by(run, exc, sources=[S.RUNNING])


def _submit(run: Run, model: LoadedModel) -> RowStream:
    assert run.generation is not None
    return engine_for(model, worker=run.worker, model_name=run.model_name).submit(run.generation)


def _generate(run: Run, model: LoadedModel, spec: GenerationSpec, cancelled: threading.Event) -> str | Held:
    params = sampling_params_of(spec, model, run.model_name)
    prompt_ids = model.prompt_ids(prompt_of(spec), tools=tool_prompt_of(spec, model, run.model_name))
    if spec.calls_tools:
        fmt = tool_format_of(model, run.model_name)
        run.tools = ToolRun(
            ToolCallParser(fmt, max_calls=spec.tool_choice.max_calls),
            OutputItems(call_id_length=fmt.call_id_length, namespaces=spec.namespaces),
        )
    run.generation = model.generate(prompt_ids, params, should_stop=cancelled.is_set)
    # Taken before the engine has the generation; the prefill then overlaps the start's commit.
    first = run.snapshot()
    stream = _submit(run, model)
    # A run that may call tools opens its items as the model writes them.
    opened = None if run.tools is not None else run.item_id
    head: Chunk | None = None
    folded = False
    try:
        # A short prompt's first token comes within a few milliseconds: then the start and the
        # first delta are one commit, not two (a tool-calling run's items open as parsed: never).
        if run.tools is None and settings.LMSP_START_FOLD_MS > 0 and stream.ready(settings.LMSP_START_FOLD_MS / 1000):
            head = stream.take()
            folded = head is not None and not head.final and head.error is None
        if folded:
            assert head is not None
            read_chunk(run, head)
            started = committed(
                lifecycle.task_start,
                task_id=run.task_id,
                worker=run.worker,
                item_id=opened,
                snapshot=run.snapshot(),
                deltas=run.pending,
                output_tokens=run.output_tokens,
            )
        else:
            started = committed(
                lifecycle.task_start, task_id=run.task_id, worker=run.worker, item_id=opened, snapshot=first
            )
    except BaseException:
        stream.stop()
        raise
    if not started.won:
        stream.stop()
        return after_lost_race(run, started)
    if folded:
        batch_stored(run, started)
    else:
        run.snapshot_stored()
    logger.info(
        "task %s running: %d prompt tokens, seed %d", run.task_id, run.generation.prompt_tokens, run.generation.seed
    )
    return Held(run, stream, head=None if folded else head)
