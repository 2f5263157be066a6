"""A worker stopped in the middle of a generation: one line per interrupted task.

honcho (the quick start) and tini (the compose images) send SIGTERM to the
worker's whole process group, so the pool process dies at once and the main
process, in its warm shutdown, finds the job lost. ``workers.tasks`` then
applies the task's ``on_restart`` policy right away (``lost_task_recover``).
Celery would log that loss as an error with two nested tracebacks, billiard
adds a line about the pool process, recovery one more, and none of them says
plainly what became of the task. While the node is stopping, this module
says it in one line (``task … interrupted by shutdown; on_restart=resume: it
resumes at the next start``) and drops the three records that line replaces.
A pool process lost while the node is not stopping (the OOM killer, a crash)
is still logged in full.

With the threads pool (the batched worker) no process is lost: SIGTERM
starts Celery's warm shutdown, which waits for the task threads still
starting a run. The receiver of ``worker_shutting_down`` tells the
process's engines to drain (``workers.engines.engines_drain``): rows may go
on for ``LMSP_DRAIN_SECONDS``, then stop; the run loop that carries them
(``workers.run_loop``) commits each one's last batch, hands its task back
by its policy (``held_task_release``) and says so through
:func:`task_handed_back_log`, in the same line as above, and the process
waits for it at exit. A cold shutdown (SIGQUIT, a second Ctrl-C) cuts the
drain short.

Imported by the Celery app (``imports`` in ``lmsp_project/celery.py``) and by
``workers.execution``, so it imports neither ``workers.tasks`` nor the
execution: its ``task_failure`` receiver may be connected before the one in
``workers.tasks`` that recovers, and so applies the recovery itself before
it reads what became of the task (the second call finds nothing to move).
"""

from __future__ import annotations

import atexit
import logging
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from celery import Task as CeleryTask
from celery.exceptions import Reject, WorkerLostError
from celery.signals import task_failure, worker_process_init, worker_shutting_down
from celery.worker import state as worker_state
from django.conf import settings
from django.db import DatabaseError

from tasks_app import states
from tasks_app.plumbing.broker import RUN_TASK
from tasks_app.selectors.tasks import task_outcome_get
from tasks_app.services.recovery import BUSY, RecoverySummary, lost_task_recover
from tasks_app.states import TaskStatus

logger = logging.getLogger(__name__)

S = TaskStatus

# After the drain, how long the run loop's rows get for their last commits and hand-backs (each may
# wait for SQLite's write lock): within the 45 s that docker-compose.yml's grace period allows them.
RUNS_END_SECONDS = 40.0

# billiard's own line when a pool process exits with a signal (its logger, "multiprocessing").
_POOL_EXIT_TEMPLATE = "Process %r pid:%r exited with %r"


def node_stopping() -> bool:
    """Whether this Celery node has begun a warm or cold shutdown."""
    return worker_state.should_stop is not None or worker_state.should_terminate is not None


class ShutdownNoiseFilter(logging.Filter):
    """Drops, while the node stops, the records the one line per interrupted task replaces."""

    def filter(self, record: logging.LogRecord) -> bool:
        if not node_stopping():
            return True
        if record.name == "celery.worker.request":
            args = record.args if isinstance(record.args, tuple) else ()
            return not any(isinstance(arg, WorkerLostError) for arg in args)
        if record.name == "multiprocessing":
            return record.msg != _POOL_EXIT_TEMPLATE
        if record.name == "celery.app.trace":
            # A message a stopping worker gave back (workers.tasks): said in one line there, not with a traceback.
            return not (record.exc_info and isinstance(record.exc_info[1], Reject))
        # The recovery module's "recovered task" line: said again, plainly, below.
        return record.levelno > logging.INFO


_noise = ShutdownNoiseFilter()
for _name in ("celery.worker.request", "celery.app.trace", "multiprocessing", "tasks_app.services.recovery"):
    logging.getLogger(_name).addFilter(_noise)


def interrupted_task_outcome(row: dict[str, Any] | None) -> str:
    """What became of a task whose pool process the shutdown killed, as the line says it."""
    if row is None:
        return "it no longer exists"
    policy = f"on_restart={row['on_restart']}"
    status = row["status"]
    if status == S.FAILED:
        code = (row["error"] or {}).get("code", "server_restarted")
        return f"{policy}: it failed ({code})"
    if status == S.QUEUED:
        return f"{policy}: it is queued again and runs anew at the next start (or on another running worker)"
    if status == S.RUNNING and row["worker"] == "":
        return f"{policy}: it resumes at the next start (or on another running worker)"
    if status in states.TERMINAL:
        return f"it had already {status}"
    # Still held by the dead process: the recovery could not run here.
    return f"{policy}: lmsp_recover applies it at the next start (or the reaper, sooner, if other workers run)"


@task_failure.connect
def _interrupted_by_shutdown(
    sender: CeleryTask | None = None, exception: BaseException | None = None, **kwargs: object
) -> None:
    """Runs in the worker's main process when the shutdown killed the pool process running a task."""
    if sender is None or sender.name != RUN_TASK or not isinstance(exception, WorkerLostError):
        return
    if not node_stopping():
        return
    args = kwargs.get("args") or ()
    if not args:
        return
    task_id = str(args[0])
    try:
        # Whichever receiver runs first moves the task; the other finds it moved.
        lost_task_recover(task_id=task_id, node=sender.request.hostname or "worker")
    except DatabaseError:
        pass  # the line below says that the database did not answer
    _log_interrupted(task_id, interrupted_task_outcome)


SHUT_DOWN = "its worker was shut down"


def task_handed_back_log(*, task_id: str, summary: RecoverySummary, reason: str = SHUT_DOWN) -> None:
    """The line for a task a shutdown (or its engine process's loss, ``reason``) stopped and its thread handed
    back (``held_task_release``'s summary)."""

    def outcome(row: dict[str, Any] | None) -> str:
        # Not moved, not for a lock, yet still held: another worker took it over meanwhile.
        taken = row is not None and row["status"] in states.HELD and row["worker"] != ""
        if taken and not summary.moved and not summary.counts[BUSY]:
            return f"on_restart={row['on_restart']}: {row['worker']} holds it now"
        return interrupted_task_outcome(row)

    _log_interrupted(task_id, outcome, why="by shutdown" if reason == SHUT_DOWN else f"({reason})")


def _log_interrupted(
    task_id: str, outcome: Callable[[dict[str, Any] | None], str], *, why: str = "by shutdown"
) -> None:
    try:
        row = task_outcome_get(task_id=task_id)
    except DatabaseError:
        said = "lmsp_recover applies its on_restart policy at the next start (the database did not answer)"
    else:
        said = outcome(row)
    logger.warning("task %s interrupted %s; %s", task_id, why, said)


_drain_asked: float | None = None


@worker_shutting_down.connect
def _drain_engines(sender: object = None, how: str = "Warm", **kwargs: object) -> None:
    """Runs in the worker's main process, inside its signal handler: must return at once.

    A warm shutdown (SIGTERM, the first Ctrl-C) lets rows run for
    ``LMSP_DRAIN_SECONDS``; a cold one (SIGQUIT, a second Ctrl-C) stops them
    now. honcho's group Ctrl-C delivers SIGINT and then SIGTERM: only a
    shorter grace than the one already asked is passed on. A prefork parent
    has no engine (its pool processes do, and die with the group's signal),
    and before ``workers.engines`` exists there is nothing to drain.
    """
    global _drain_asked
    grace = 0.0 if how == "Cold" else float(settings.LMSP_DRAIN_SECONDS)
    if _drain_asked is not None and grace >= _drain_asked:
        return
    try:
        from workers.engines import engines_drain
    except ImportError:
        return
    if _drain_asked is None:
        atexit.register(_wait_for_runs)
    _drain_asked = grace
    engines_drain(grace_seconds=grace)


# Set in a prefork pool process (worker_process_init fires only there).
_pool_process = False


@worker_process_init.connect
def _mark_pool_process(**kwargs: object) -> None:
    global _pool_process
    _pool_process = True


def in_pool_process() -> bool:
    """Whether this is a prefork pool process (not the threads pool's one process)."""
    return _pool_process


def _wait_for_runs() -> None:
    """At the drained process's exit (``atexit``: after Celery's warm or cold shutdown, while the run
    loop's thread still runs): the task threads are done, but the run loop may still carry rows; their
    last commits and hand-backs end before the process does."""
    rows = sys.modules.get("workers.run_rows")
    if rows is None:  # this process never ran a task (a prefork parent, the maintenance node)
        return
    grace = _drain_asked if _drain_asked is not None else float(settings.LMSP_DRAIN_SECONDS)
    if not rows.run_loop_empty(timeout=grace + RUNS_END_SECONDS):
        logger.error("rows were still running at exit; the reaper or lmsp_recover hands their tasks back")


def _drain_on_sigterm(signum: int, frame: object) -> None:
    from workers.engines import engines_drain

    engines_drain(grace_seconds=float(settings.LMSP_DRAIN_SECONDS))


@contextmanager
def sigterm_drains_engines() -> Iterator[None]:
    """While a prefork pool process runs a task, SIGTERM drains its engines instead of raising SystemExit.

    billiard's handler raises SystemExit wherever the process is. Landing
    inside a database commit, the cleanup of the half-sent command replaced it
    with a database error: the task body failed as a backend error, Celery
    reported a failure rather than a lost process, and the task stayed held by
    a process that was gone until the next recovery. Drained, the row ends
    interrupted between two steps and the task is handed back by its policy,
    as in the threads pool. Outside a task billiard's own handler applies.
    """
    if not _pool_process or threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, _drain_on_sigterm)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
