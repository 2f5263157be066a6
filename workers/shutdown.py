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

Imported by the Celery app (``imports`` in ``lmsp_project/celery.py``); it
imports ``workers.tasks`` first, so that its receiver runs after the one that
recovers.
"""

from __future__ import annotations

import logging
from typing import Any

from celery import Task as CeleryTask
from celery.exceptions import WorkerLostError
from celery.signals import task_failure
from celery.worker import state as worker_state
from django.db import DatabaseError

# Its receiver applies the policy; imported first, it is connected (and runs) before the one below.
import workers.tasks  # noqa: F401
from tasks_app import states
from tasks_app.broker import RUN_TASK
from tasks_app.selectors import task_outcome_get
from tasks_app.states import TaskStatus

logger = logging.getLogger(__name__)

S = TaskStatus

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
        # The recovery module's "recovered task" line: said again, plainly, below.
        return record.levelno > logging.INFO


_noise = ShutdownNoiseFilter()
for _name in ("celery.worker.request", "multiprocessing", "tasks_app.services.recovery"):
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
    """Runs in the worker's main process, after ``workers.tasks`` applied the task's policy."""
    if sender is None or sender.name != RUN_TASK or not isinstance(exception, WorkerLostError):
        return
    if not node_stopping():
        return
    args = kwargs.get("args") or ()
    if not args:
        return
    task_id = str(args[0])
    try:
        row = task_outcome_get(task_id=task_id)
    except DatabaseError:
        outcome = "lmsp_recover applies its on_restart policy at the next start (the database did not answer)"
    else:
        outcome = interrupted_task_outcome(row)
    logger.warning("task %s interrupted by shutdown; %s", task_id, outcome)
