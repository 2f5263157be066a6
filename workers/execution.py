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
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from contextlib import ExitStack
from dataclasses import dataclass, field
from typing import Any, TypeVar

from django.conf import settings
from django.db import DatabaseError, close_old_connections, connection

from tasks_app import faults, states
from tasks_app.core import lifecycle
from tasks_app.core.events import Event
from tasks_app.core.lifecycle import Partial, TransitionResult
from tasks_app.core.output_items import OutputItems
from tasks_app.core.wire import usage_object
from tasks_app.exceptions import (
    BackendError,
    ContextLengthExceeded,
    DatabaseBusy,
    InvalidRequest,
    LmspError,
    ModelLoadFailed,
    ServerRestarted,
    TaskNotFound,
)
from tasks_app.generation.spec import GenerationSpec
from tasks_app.generation.tool_call_parser import (
    CALL_ARGUMENTS,
    CALL_END,
    CALL_START,
    MalformedToolCall,
    Op,
    ToolCallParser,
)
from tasks_app.ids import new_message_id
from tasks_app.plumbing import broker
from tasks_app.plumbing.affinity import affinity_remember
from tasks_app.plumbing.database_outages import database_unavailable_noted
from tasks_app.plumbing.db_locks import is_database_unavailable
from tasks_app.selectors.tasks import (
    StoredSnapshot,
    task_output_items,
    task_output_text,
    task_run_spec,
    task_snapshot_get,
)
from tasks_app.services.dispatch import task_dispatch
from tasks_app.services.recovery import BUSY, held_task_release
from tasks_app.states import TaskStatus
from workers.backends.base import (
    FINISH_CANCELLED,
    FINISH_LENGTH,
    Chunk,
    Generation,
    LoadedModel,
    RowStream,
)
from workers.backends.errors import ConstraintFailed, ContextTooLong, ModelLoadError, PromptRejected, RuntimeFailure
from workers.cancel_watcher import cancel_watcher
from workers.engines import engine_for, engines_full, max_rows
from workers.generation_inputs import prompt_of, sampling_params_of, tool_format_of, tool_prompt_of
from workers.model_cache import model_cache
from workers.run_loop import RunLoop
from workers.run_metrics import RunMetrics, commit_group_observed
from workers.shutdown import task_handed_back_log

logger = logging.getLogger(__name__)

S = TaskStatus
_DETAIL_LIMIT = 500
# A claim waits this long for a database it cannot reach, then, after a pause, sends its message again.
CLAIM_PATIENCE_SECONDS = 5.0
CLAIM_RETRY_PAUSE_SECONDS = 2.0
# How often a task thread waiting for room among the rows checks whether the worker is stopping.
ROOM_POLL_SECONDS = 0.5


def _usage(generation: Generation | None) -> dict[str, Any] | None:
    if generation is None:
        return None
    return usage_object(generation.prompt_tokens, generation.output_tokens, cached_tokens=generation.cached_tokens)


def runtime_problem(exc: BaseException) -> dict[str, Any]:
    """The problem a task ends with when the runtime raised ``exc``.

    The runtime knows nothing of HTTP; this is where its errors get their
    problem codes: a model that does not load is ``model_load_failed``, an
    input the chat template refuses is ``invalid_request``, anything else
    the backend did is ``backend_error``.
    """
    if isinstance(exc, ModelLoadError):
        return ModelLoadFailed(str(exc)).to_problem()
    if isinstance(exc, PromptRejected):
        return InvalidRequest(str(exc)).to_problem()
    if isinstance(exc, ContextTooLong):
        return ContextLengthExceeded(str(exc)).to_problem()
    if isinstance(exc, RuntimeFailure):  # GenerationError, and any the runtime adds later
        return BackendError(str(exc)).to_problem()
    if isinstance(exc, LmspError):
        return exc.to_problem()
    detail = f"{type(exc).__name__}: {exc}"
    if len(detail) > _DETAIL_LIMIT:
        detail = detail[: _DETAIL_LIMIT - 3] + "..."
    return BackendError(f"The inference backend failed ({detail})").to_problem()


Result = TypeVar("Result")


class DatabaseGaveUp(Exception):
    """The database could not be written for as long as a commit may wait (locked, or unreachable)."""

    def __init__(
        self, verb: str, task_id: str | None, seconds: float, cause: BaseException, *, maybe_written: bool = False
    ) -> None:
        super().__init__(f"{verb} for {task_id}: the database could not be written for {seconds:.0f} s ({cause})")
        self.seconds = seconds
        self.cause = cause
        # A try broke on an open connection: its commit may have reached the database before the answer was lost.
        self.maybe_written = maybe_written


def _unavailable(exc: BaseException) -> bool:
    return isinstance(exc, DatabaseBusy) or (isinstance(exc, DatabaseError) and is_database_unavailable(exc))


def _committed(
    verb: Callable[..., Result], *, patience: float | None = None, subject: str | None = None, **kwargs: Any
) -> Result:
    """Call a lifecycle verb, retrying while the database cannot be written (its lock, or its connection).

    A failed try wrote nothing, or (a connection that broke after its commit
    was sent) wrote it all: the verbs compare-and-set on the old status, so
    trying again is exact either way. Another process
    frozen inside a transaction holds the lock until it thaws or dies; a
    connection that broke (a server restart, a cut network, a session the
    server ended) is dropped and opened again. Past ``patience`` (the
    heartbeat timeout) the reaper may have taken the task, which the
    compare-and-set then reports as a lost race; if the database still cannot
    be written, :class:`DatabaseGaveUp` says so and the run hands its task back.
    """
    patience = settings.LMSP_HEARTBEAT_TIMEOUT_SECONDS if patience is None else patience
    subject = kwargs.get("task_id") if subject is None else subject
    started = time.monotonic()
    pause = 0.05
    maybe_written = False
    while True:
        connected = connection.connection is not None
        try:
            return verb(**kwargs)
        except (DatabaseBusy, DatabaseError) as exc:
            if not _unavailable(exc):
                raise
            if not isinstance(exc, DatabaseBusy):
                # A broken connection stays broken: the next try opens a new one.
                connection.close()
                maybe_written = maybe_written or connected
            if time.monotonic() + pause - started >= patience:
                raise DatabaseGaveUp(
                    verb.__name__, subject, time.monotonic() - started, exc, maybe_written=maybe_written
                ) from exc
            # The outage itself is logged once per process (tasks_app.plumbing.database_outages), not per try.
            database_unavailable_noted(exc)
            logger.debug(
                "%s for %s: the database cannot be written now (%s); retrying",
                verb.__name__,
                subject,
                "locked by another writer" if isinstance(exc, DatabaseBusy) else _one_line(exc),
            )
            time.sleep(pause)
            pause = min(pause * 2, 1.0)


def _progress_group(batches: Sequence[lifecycle.ProgressBatch]) -> list[TransitionResult | None]:
    results = _committed(lifecycle.tasks_progress, batches=batches, subject=f"{len(batches)} tasks")
    commit_group_observed(batches[0].worker, len(batches))
    return results


def _one_line(exc: BaseException) -> str:
    return " ".join(line.strip() for line in str(exc).splitlines() if line.strip())[:200] or type(exc).__name__


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
                        logger.warning("heartbeat for %s failed: %s", self.task_id, _one_line(exc))
                    if isinstance(exc, DatabaseError):
                        connection.close()  # the next beat opens a new connection
                    continue
                if not result.won:
                    return
        finally:
            connection.close()


@dataclass
class _ToolRun:
    """A run whose model may call tools (PROFILE.md 10.4): its text read for calls as it comes, and the
    output items (messages and calls) that reading makes, with their events not yet committed."""

    parser: ToolCallParser
    items: OutputItems
    pending_events: list[Event] = field(default_factory=list)

    def read(self, raw: str) -> None:
        """Text the model wrote; raises ``MalformedToolCall`` for a call that breaks once opened."""
        self._apply(self.parser.feed(raw))

    def end(self, *, incomplete: bool) -> None:
        """The generation ended: what the parser held is decided, and the item still open closes.

        Cut by the token limit (``incomplete``), what the parser held is dropped, never text (a call whose
        name is known is open, and closes ``incomplete``)."""
        self._apply(self.parser.finish(cut=incomplete))
        if self.parser.call_open and not incomplete:
            raise MalformedToolCall("the model's tool call is malformed: the output ended inside it")
        self.pending_events += self.items.finish("incomplete" if incomplete else "completed")

    def _apply(self, ops: list[Op]) -> None:
        for kind, value in ops:
            if kind == CALL_START:
                self.pending_events += self.items.call_start(value)
            elif kind == CALL_ARGUMENTS:
                self.pending_events += self.items.call_arguments(value)
            elif kind == CALL_END:
                self.pending_events += self.items.call_end(value)
            else:
                self.pending_events += self.items.text(value)


@dataclass
class _Run:
    """The state of one generation as far as the event log knows it."""

    task_id: str
    worker: str
    item_id: str
    heartbeat: Heartbeat
    metrics: RunMetrics
    generation: Generation | None = None
    model_name: str = ""
    chunk: Chunk | None = None
    """The last chunk read from the engine: its state is the next snapshot's."""
    committed_text: list[str] = field(default_factory=list)
    pending: list[str] = field(default_factory=list)
    pending_tokens: int = 0
    last_token_at: float = 0.0
    # Generated ids already in snapshot rows, and whether the prompt is.
    stored_tokens: int = 0
    prompt_stored: bool = False
    _snapshot_tokens: int = 0
    tools: _ToolRun | None = None
    """Set for a run whose model may call tools once its generation is set up."""
    calls_tools: bool = False
    """The request may call tools: its output is items (messages and calls), not one message."""

    def snapshot(self) -> dict[str, Any]:
        """The next snapshot row: new token ids and the small state (see ``TaskSnapshot``).

        Prompt ids go into the first row only, generated ids into the row of
        the batch that made them, and the released text is not stored at all
        (the committed deltas are it), so a batch copies nothing that grows
        with the output.
        """
        assert self.generation is not None
        chunk = self.chunk
        if chunk is None or chunk.state is None:
            # Before the engine has the generation: this thread is the only one touching it.
            new_ids, state = self.generation.snapshot_since(self.stored_tokens, with_prompt=not self.prompt_stored)
        else:
            # The model thread is ahead: the state and ids as of the chunk's last step.
            new_ids = self.generation.generated_ids[self.stored_tokens : chunk.output_tokens]
            state = dict(chunk.state)
            if not self.prompt_stored:
                state["prompt_ids"] = list(self.generation.prompt_ids)
        self._snapshot_tokens = self.stored_tokens + len(new_ids)
        row_state: dict[str, Any] = {"item_id": self.item_id, "backend": state}
        if self.tools is not None:
            # The model's own text of this batch (markers and all): a resumed run's parser reads it again.
            row_state["raw"] = "".join(self.pending)
        return {"token_ids": new_ids, "state": row_state}

    def snapshot_stored(self) -> None:
        """The row from the last :meth:`snapshot` was committed."""
        self.stored_tokens = self._snapshot_tokens
        self.prompt_stored = True

    def text(self) -> str:
        return "".join(self.committed_text)

    def partial(self) -> Partial:
        """What the event log shows of this attempt, for a run that stops early."""
        if self.calls_tools:
            # Only what was committed: the items as the event log has them.
            items = task_output_items(task_id=self.task_id)
            return Partial(self.item_id, "", _usage(self.generation), items=items)
        return Partial(self.item_id, self.text(), _usage(self.generation))

    @property
    def output_tokens(self) -> int:
        """Tokens as far as this thread has read them (the engine may be ahead)."""
        if self.chunk is not None:
            return self.chunk.output_tokens
        return self.generation.output_tokens if self.generation is not None else 0


def room_wait(*, stopping: Callable[[], bool]) -> bool:
    """Wait for a place among this process's rows (``LMSP_MAX_BATCH``, or as the KV budget allows) before a
    task is claimed.

    A task thread only claims what the process can run now, so a busy worker
    leaves the queue's messages to the others. False if ``stopping`` became
    true meanwhile: the message goes back to the queue. The place is the
    claimed task's until its run ends (:func:`task_execute` gives it back).
    """
    while True:
        if _run_loop.reserve(max_rows(), timeout=ROOM_POLL_SECONDS):
            # Automatic batch size: the rows the KV budgets hold. A row held back for the budget means
            # the engine is full: the next task waits here, unclaimed, free for another worker. (Task
            # threads check at once, so each may have claimed one task that now waits in the engine.)
            if settings.LMSP_MAX_BATCH or not engines_full():
                return True
            _run_loop.unreserve()
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
        _run_loop.reserve(max_rows(), timeout=None)
    held = None
    try:
        outcome = _intake(task_id, worker)
        if isinstance(outcome, str):
            return outcome
        held = outcome
    finally:
        if held is None:
            _run_loop.unreserve()
    _run_loop.hold(held, held.stream.notify)
    if not wait:
        return "running"
    held.done.wait()
    return held.outcome


# The tasks a thread of this process is claiming or running now. A second message of one (a duplicate, the
# sweeper's) is dropped here; and only a task absent from it may be taken up as this worker's own when the
# database shows it ``loading`` under this worker's name (a claim whose answer the connection lost).
_intakes: set[str] = set()
_intakes_lock = threading.Lock()


def _intake(task_id: str, worker: str) -> str | _Held:
    """Claim (or adopt), load, set up and start the task: its row, or how the task ended before."""
    broker.dispatch_marker_clear(task_id=task_id)
    with _intakes_lock:
        if task_id in _intakes:
            logger.info("dropped message for task %s: a thread of this worker has it", task_id)
            return "dropped"
        _intakes.add(task_id)
    outcome: str | _Held = "dropped"
    try:
        outcome = _intake_claimed(task_id, worker)
        return outcome
    finally:
        if not isinstance(outcome, _Held):
            with _intakes_lock:
                _intakes.discard(task_id)


def _claim_lost_in_transit(claim: TransitionResult, worker: str) -> bool:
    """Whether a lost claim was this worker's own: a try whose commit reached the database while the
    connection broke before its answer came (a server restart, a cut network), so that its retry found the
    task already ``loading`` under this worker's name. No thread of this process has it (``_intakes``)."""
    return not claim.won and claim.task.status == S.LOADING and claim.task.worker == worker


def _intake_claimed(task_id: str, worker: str) -> str | _Held:
    close_old_connections()
    try:
        claim = _committed(lifecycle.task_claim, patience=CLAIM_PATIENCE_SECONDS, task_id=task_id, worker=worker)
        resuming = False
        if not claim.won and claim.task.status in states.ORPHANABLE and claim.task.worker == "":
            claim = _committed(lifecycle.task_adopt, patience=CLAIM_PATIENCE_SECONDS, task_id=task_id, worker=worker)
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
            return _database_lost(task_id, worker, exc)
        if isinstance(outcome, _Held):
            # From here the run loop carries the row, and ends these with it.
            outcome.resources = resources.pop_all()
        return outcome


def _intake_ended(task_id: str) -> None:
    with _intakes_lock:
        _intakes.discard(task_id)


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


def _database_lost(task_id: str, worker: str, exc: DatabaseGaveUp) -> str:
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
        if not _unavailable(again):
            raise
        connection.close()
        logger.error(
            "task %s: the hand-back could not write either (%s); the reaper applies its on_restart policy "
            "once its heartbeat is %d s old",
            task_id,
            _one_line(again),
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


def _load_failure(run: _Run, exc: Exception, sources: Iterable[TaskStatus]) -> str:
    """The outcome of failing the task because its model would not load."""
    if isinstance(exc, ModelLoadError):
        logger.warning("task %s: %s", run.task_id, exc)
        return _fail(run, runtime_problem(exc), sources=sources)
    logger.error("task %s: loading model %s failed", run.task_id, run.model_name, exc_info=exc)
    return _fail(run, ModelLoadFailed(f"Model {run.model_name!r} could not be loaded").to_problem(), sources)


def _model_leased(run: _Run, resources: ExitStack) -> LoadedModel:
    """The run's model, leased until ``resources`` close. Its record is read from the database: an outage
    there is waited out as a commit's is, never taken for a model that does not load."""

    def model_lease() -> LoadedModel:
        return resources.enter_context(model_cache().lease(run.model_name))

    return _committed(model_lease, subject=run.task_id)


def _run(
    task_id: str,
    worker: str,
    cancelled: threading.Event,
    heartbeat: Heartbeat,
    metrics: RunMetrics,
    resources: ExitStack,
) -> str | _Held:
    # The run's reads wait out a database that is away as its commits do (_committed): an outage while a
    # task starts must not fail it, nor leave it to the reaper.
    spec = _committed(task_run_spec, task_id=task_id)
    model_name = spec.model
    # Later turns of this conversation that the client echoes back prefer this node (tasks_app.plumbing.affinity).
    affinity_remember(conversation=spec.conversation_key(), worker=worker)
    run = _Run(
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
        return _load_failure(run, exc, [S.LOADING])
    try:
        return _generate(run, model, spec, cancelled)
    except DatabaseGaveUp:
        raise
    except Exception as exc:
        return _failed_by(run, exc, sources=states.HELD & states.sources_for(S.FAILED))


def _resume(
    task_id: str,
    worker: str,
    status: str,
    cancelled: threading.Event,
    heartbeat: Heartbeat,
    metrics: RunMetrics,
    resources: ExitStack,
) -> str | _Held:
    """Continue a task from its snapshot: the same output item, right after its last committed event."""
    spec = _committed(task_run_spec, task_id=task_id)
    model_name = spec.model
    stored = _committed(task_snapshot_get, task_id=task_id)
    _, text = _committed(task_output_text, task_id=task_id)
    item_id = stored.last_state.get("item_id") if stored is not None else None
    run = _Run(
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
        return _cancelled(run)
    if stored is None or not item_id:
        problem = ServerRestarted("The service restarted and the task has no snapshot to resume from").to_problem()
        return _fail(run, problem, sources=[S.RUNNING])
    run.stored_tokens, run.prompt_stored = len(stored.token_ids), True
    try:
        model = _model_leased(run, resources)
    except DatabaseGaveUp:
        raise
    except Exception as exc:
        return _load_failure(run, exc, [S.RUNNING])
    fmt = tool_format_of(model, model_name)
    if spec.calls_tools:
        # The parser reads the committed text again (its reading does not depend on the cuts) and the
        # items are the ones the event log shows: both as they were at the last commit.
        text = stored.raw_text
        run.tools = _ToolRun(
            ToolCallParser(fmt, max_calls=spec.tool_choice.max_calls),
            OutputItems(
                _committed(task_output_items, task_id=task_id),
                call_id_length=fmt.call_id_length,
                namespaces=spec.namespaces,
            ),
        )
        run.tools.parser.feed(text)
        run.committed_text = [text]
    return _resume_generation(run, model, spec, stored, text, cancelled)


def _resume_generation(
    run: _Run,
    model: LoadedModel,
    spec: GenerationSpec,
    stored: StoredSnapshot,
    text: str,
    cancelled: threading.Event,
) -> str | _Held:
    try:
        backend_state = {
            **stored.last_state["backend"],
            "prompt_ids": stored.first_state["backend"]["prompt_ids"],
            "generated_ids": stored.token_ids,
            "text": text,
        }
        params = sampling_params_of(spec, model, run.model_name)
        run.generation = model.resume(backend_state, params, should_stop=faults.slowed(cancelled.is_set))
        logger.info(
            "task %s resumed after %d output tokens, seed %d",
            run.task_id,
            run.generation.output_tokens,
            run.generation.seed,
        )
        return _Held(run, _submit(run, model))
    except DatabaseGaveUp:
        raise
    except Exception as exc:
        return _failed_by(run, exc, sources=[S.RUNNING])


def _failed_by(run: _Run, exc: Exception, sources: Iterable[TaskStatus]) -> str:
    """Fail the task by what its run raised.

    A problem of the request's own (a 4xx: a prompt over the context, an
    input the template refuses) is the client's to fix, and the failure's one
    line names it; anything else is a fault of the service, logged with its
    traceback.
    """
    problem = runtime_problem(exc)
    if _is_fault(problem):
        logger.error("task %s: backend error", run.task_id, exc_info=exc)
    _count_constraint_failure(run, exc)
    return _fail(run, problem, sources=sources)


def _is_fault(problem: Mapping[str, Any]) -> bool:
    return int(problem.get("status") or 500) >= 500


def _count_constraint_failure(run: _Run, exc: BaseException) -> None:
    if isinstance(exc, ConstraintFailed | MalformedToolCall):
        run.metrics.constraint_failed(run.output_tokens)


def _submit(run: _Run, model: LoadedModel) -> RowStream:
    assert run.generation is not None
    return engine_for(model, worker=run.worker, model_name=run.model_name).submit(run.generation)


def _generate(run: _Run, model: LoadedModel, spec: GenerationSpec, cancelled: threading.Event) -> str | _Held:
    params = sampling_params_of(spec, model, run.model_name)
    prompt_ids = model.prompt_ids(prompt_of(spec), tools=tool_prompt_of(spec, model, run.model_name))
    if spec.calls_tools:
        fmt = tool_format_of(model, run.model_name)
        run.tools = _ToolRun(
            ToolCallParser(fmt, max_calls=spec.tool_choice.max_calls),
            OutputItems(call_id_length=fmt.call_id_length, namespaces=spec.namespaces),
        )
    run.generation = model.generate(prompt_ids, params, should_stop=faults.slowed(cancelled.is_set))
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
            _read_chunk(run, head)
            started = _committed(
                lifecycle.task_start,
                task_id=run.task_id,
                worker=run.worker,
                item_id=opened,
                snapshot=run.snapshot(),
                deltas=run.pending,
                output_tokens=run.output_tokens,
            )
        else:
            started = _committed(
                lifecycle.task_start, task_id=run.task_id, worker=run.worker, item_id=opened, snapshot=first
            )
    except BaseException:
        stream.stop()
        raise
    if not started.won:
        stream.stop()
        return _after_lost_race(run, started)
    if folded:
        _batch_stored(run, started)
    else:
        run.snapshot_stored()
    logger.info(
        "task %s running: %d prompt tokens, seed %d", run.task_id, run.generation.prompt_tokens, run.generation.seed
    )
    return _Held(run, stream, head=None if folded else head)


def _read_chunk(run: _Run, chunk: Chunk) -> None:
    """Take a chunk's steps into the pending batch (and its timing into the run's metrics)."""
    if chunk.tokens:
        # Timed on the model thread: a chunk read late still measures when its tokens came.
        run.metrics.batch_started(chunk.first_at, chunk.output_tokens - chunk.tokens)
        run.last_token_at = chunk.last_at
    run.chunk = chunk
    run.pending.extend(step.text for step in chunk.steps if step.text)
    run.pending_tokens += chunk.tokens


@dataclass(eq=False)
class _Held:
    """A started run as the run loop carries it: its row's stream, and what its end releases."""

    run: _Run
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


def _advance(rows: list[_Held]) -> list[_Held]:
    """The run loop's step: read every ready row's chunks, commit their batches in one transaction,
    end the rows that ended. Returns those; never raises (each row's failure ends that row alone)."""
    ended: list[_Held] = []
    batches: list[tuple[_Held, lifecycle.ProgressBatch]] = []
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
        results: list[TransitionResult | None] | None = _progress_group([batch for _, batch in batches])
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


def _read_step(held: _Held) -> lifecycle.ProgressBatch | str | None:
    """What the row made since its last commit: a batch to commit, how the run ended, or None (nothing)."""
    run, stream = held.run, held.stream
    chunk = held.take()
    if chunk is None:
        return None
    if chunk.error is not None:
        raise chunk.error
    read = len(run.pending)
    _read_chunk(run, chunk)
    texts = run.pending[read:]
    if run.tools is not None and texts:
        try:
            run.tools.read("".join(texts))
        except MalformedToolCall as exc:
            stream.stop()
            _count_constraint_failure(run, exc)
            return _fail(run, BackendError(str(exc)).to_problem(), sources=[S.RUNNING])
    if chunk.final:
        stream.stop()
        return _stream_ended(run)
    return _progress_batch(run)


def _progressed(held: _Held, result: TransitionResult | None, error: BaseException | None) -> str | None:
    """After the group commit: None if the row goes on, else how its run ended (a lost compare-and-set)."""
    if isinstance(error, DatabaseGaveUp):  # said per task, as its own commit would have said it
        raise DatabaseGaveUp("task_progress", held.run.task_id, error.seconds, error.cause) from error.cause
    if error is not None:
        raise error
    lost = _commit_result(held.run, result)
    if lost is None:
        return None
    held.stream.stop()
    return _after_lost_race(held.run, lost)


def _guarded(held: _Held, action: Callable[[], Result]) -> Result | str:
    """``action``, or how the run ended when it raised: handed back if the database was lost, else failed."""
    run = held.run
    try:
        return action()
    except DatabaseGaveUp as exc:
        held.stream.stop()
        return _database_lost(run.task_id, run.worker, exc)
    except Exception as exc:
        held.stream.stop()
        try:
            return _failed_by(run, exc, sources=[S.RUNNING])
        except DatabaseGaveUp as again:
            return _database_lost(run.task_id, run.worker, again)
        except Exception:
            logger.exception("task %s: could not be failed; the reaper applies its on_restart policy", run.task_id)
            return "left to the reaper"


def _end(held: _Held, outcome: str) -> None:
    held.outcome = outcome
    try:
        held.resources.close()
    except Exception:
        logger.exception("task %s: releasing its run failed", held.run.task_id)
    finally:
        held.done.set()


def _beat(rows: list[_Held]) -> None:
    """The run loop's heartbeat for rows that committed nothing for a while (a long prefill)."""
    for held in rows:
        run = held.run
        try:
            lifecycle.task_heartbeat(task_id=run.task_id, worker=run.worker)
        except Exception as exc:  # a missed heartbeat must not stop the rows
            if database_unavailable_noted(exc) is None:
                logger.warning("heartbeat for %s failed: %s", run.task_id, _one_line(exc))
            if isinstance(exc, DatabaseError):
                connection.close()  # the next beat opens a new connection
            continue
        # A lost one (the task moved on) is seen by the row's next commit, which stops it.
        run.heartbeat.touched()


_run_loop: RunLoop[_Held] = RunLoop(advance=_advance, beat=_beat, beat_seconds=settings.LMSP_HEARTBEAT_SECONDS)


def run_loop_taken() -> int:
    """Places of this process's rows taken now (running, or claimed and starting)."""
    return _run_loop.taken


def run_loop_empty(*, timeout: float) -> bool:
    """Wait until the run loop carries no row (a shutdown's hand-backs done); False on ``timeout``."""
    return _run_loop.wait_empty(timeout)


def _stream_ended(run: _Run) -> str:
    """The row left the engine: finish the task by how it ended."""
    assert run.chunk is not None and run.generation is not None
    run.metrics.generation_stopped(run.output_tokens, at=run.last_token_at or None)
    if run.chunk.interrupted:
        return _hand_back(run)
    if run.generation.finish_reason == FINISH_CANCELLED:
        # The flag is only set by a committed move to cancelling; what the
        # pending batch held was never committed, so it is not part of the output.
        return _cancelled(run)
    return _succeed(run)


def _hand_back(run: _Run) -> str:
    """The worker is stopping and the row did not finish: commit what it made, then apply the task's policy."""
    if run.pending_tokens or run.pending:
        lost = _commit_result(run, _progress_group([_progress_batch(run)])[0])
        if lost is not None:
            return _after_lost_race(run, lost)
    summary = held_task_release(task_id=run.task_id, worker=run.worker, reason="its worker was shut down")
    task_handed_back_log(task_id=run.task_id, summary=summary)
    return "handed back"


def _progress_batch(run: _Run) -> lifecycle.ProgressBatch:
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


def _commit_result(run: _Run, result: TransitionResult | None) -> TransitionResult | None:
    """Take in a batch's committed result; the lost compare-and-set's result if another writer moved the task."""
    if result is None:
        raise TaskNotFound(f"task {run.task_id} does not exist")
    if not result.won:
        run.metrics.generation_stopped(run.output_tokens, at=run.last_token_at or None)
        return result
    _batch_stored(run, result)
    return None


def _batch_stored(run: _Run, result: TransitionResult) -> None:
    """The pending batch was committed (by ``result``): it is the event log's now."""
    run.metrics.batch_committed(events=len(result.events), tokens=run.pending_tokens)
    run.heartbeat.touched()
    run.snapshot_stored()
    run.committed_text.extend(run.pending)
    run.pending, run.pending_tokens = [], 0
    if run.tools is not None:
        run.tools.pending_events = []


def _succeed(run: _Run) -> str:
    generation = run.generation
    assert generation is not None
    incomplete = generation.finish_reason == FINISH_LENGTH
    if run.tools is not None:
        return _succeed_with_items(run, run.tools, incomplete)
    done = _committed(
        lifecycle.task_succeed,
        task_id=run.task_id,
        worker=run.worker,
        item_id=run.item_id,
        deltas=run.pending,
        text=run.text() + "".join(run.pending),
        usage=_usage(generation),
        output_tokens=generation.output_tokens,
        incomplete=incomplete,
    )
    if not done.won:
        return _after_lost_race(run, done)
    run.metrics.batch_committed(events=len(done.events), tokens=run.pending_tokens)
    status = done.task.response.status
    logger.info(
        "task %s %s: %d output tokens (%s)", run.task_id, status, generation.output_tokens, generation.finish_reason
    )
    return str(status)


def _succeed_with_items(run: _Run, tools: _ToolRun, incomplete: bool) -> str:
    generation = run.generation
    assert generation is not None
    try:
        tools.end(incomplete=incomplete)
    except MalformedToolCall as exc:
        _count_constraint_failure(run, exc)
        return _fail(run, BackendError(str(exc)).to_problem(), sources=[S.RUNNING])
    done = _committed(
        lifecycle.task_succeed,
        task_id=run.task_id,
        worker=run.worker,
        item_id=run.item_id,
        text="",
        usage=_usage(generation),
        output_tokens=generation.output_tokens,
        incomplete=incomplete,
        items=tools.items,
        item_events=tools.pending_events,
    )
    if not done.won:
        return _after_lost_race(run, done)
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


def _cancelled(run: _Run) -> str:
    result = _committed(lifecycle.task_finish_cancel, task_id=run.task_id, worker=run.worker, partial=run.partial())
    if result.won:
        run.metrics.cancelled(result.task)
        logger.info("task %s cancelled", run.task_id)
        return "cancelled"
    logger.warning("task %s: expected cancelling and ours, found %s", run.task_id, result.task.status)
    return str(result.task.status)


def _after_lost_race(run: _Run, result: TransitionResult) -> str:
    """Another writer moved the task (or took it over): honour a cancel, otherwise just stop."""
    status = result.task.status
    if status == S.CANCELLING:
        return _cancelled(run)
    logger.warning("task %s left to %s by another writer; stopping", run.task_id, status)
    return str(status)


def _fail(run: _Run, problem: Mapping[str, Any], sources: Iterable[TaskStatus]) -> str:
    result = _committed(
        lifecycle.task_fail,
        task_id=run.task_id,
        error=problem,
        worker=run.worker,
        sources=sources,
        partial=run.partial(),
    )
    if result.won:
        if _is_fault(problem):
            logger.info("task %s failed: %s", run.task_id, problem.get("code"))
        else:
            # The client's problem, said once and whole: its code and what the request got wrong.
            logger.info("task %s failed: %s: %s", run.task_id, problem.get("code"), problem.get("detail"))
        return "failed"
    return _after_lost_race(run, result)
