"""Celery tasks are interfaces: take an id (or nothing), call one service."""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Callable
from dataclasses import asdict
from typing import Any, TypeVar

from celery import Task, shared_task
from celery.exceptions import Reject, WorkerLostError
from celery.signals import celeryd_after_setup, task_failure
from django.conf import settings
from django.db import DatabaseError, close_old_connections

from tasks_app.exceptions import DatabaseBusy
from tasks_app.plumbing.broker import CLEANUP_TASK, REAP_TASK, RUN_TASK, SWEEP_TASK
from tasks_app.plumbing.database_outages import database_unavailable_noted, outage_process_set
from tasks_app.services.dispatch import queued_tasks_sweep
from tasks_app.services.recovery import abandoned_tasks_reap, lost_task_recover
from tasks_app.services.retention import retention_cleanup
from workers.execution import room_wait, task_execute
from workers.shutdown import in_pool_process, node_stopping, sigterm_drains_engines

logger = logging.getLogger(__name__)


@shared_task(name=RUN_TASK, bind=True, ignore_result=True)
def run_task(self: Task, task_id: str) -> str:
    if node_stopping():
        # A stopping threads-pool worker may still be handed a message (its
        # own hand-backs dispatch the tasks that run again): it goes back to
        # the queue for another worker or the next start, not claimed here.
        logger.info("left task %s to another worker: this one is stopping", task_id)
        raise Reject("this worker is stopping", requeue=True)
    if not room_wait(stopping=node_stopping):
        logger.info("left task %s to another worker: this one is stopping", task_id)
        raise Reject("this worker is stopping", requeue=True)
    worker = f"{self.request.hostname or 'worker'}/{os.getpid()}"
    with sigterm_drains_engines():
        # The threads pool's task thread only starts the run: the process's run loop carries it on, and
        # the thread takes the next message. A prefork pool process waits for its run's end, so that a
        # lost process is seen as the loss of its task (workers.shutdown).
        return task_execute(task_id=task_id, worker=worker, wait=in_pool_process(), reserved=True)


Round = TypeVar("Round")


def _skipped_while_the_database_is_away(job: Callable[[], Round]) -> Callable[[], Round | None]:
    """A maintenance round that finds the database away is skipped: the outage is logged once, not a traceback
    per round, and the next round (seconds later) does the work."""

    @functools.wraps(job)
    def round_() -> Round | None:
        try:
            return job()
        except (DatabaseBusy, DatabaseError) as error:
            if database_unavailable_noted(error) is None:
                raise
            close_old_connections()
            return None

    return round_


@shared_task(name=SWEEP_TASK, ignore_result=True, acks_late=False)
@_skipped_while_the_database_is_away
def sweep_queued() -> int:
    return len(queued_tasks_sweep())


@shared_task(name=REAP_TASK, ignore_result=True, acks_late=False)
@_skipped_while_the_database_is_away
def reap_abandoned() -> int:
    return abandoned_tasks_reap().moved


@shared_task(name=CLEANUP_TASK, ignore_result=True, acks_late=False)
@_skipped_while_the_database_is_away
def cleanup() -> dict[str, int]:
    return asdict(retention_cleanup())


@celeryd_after_setup.connect
def _name_the_process(sender: str, instance: Any, **kwargs: object) -> None:
    """A node that consumes the task queue is a worker; the other one is the maintenance node."""
    consumes = instance.app.amqp.queues.consume_from
    outage_process_set("worker" if settings.LMSP_TASK_QUEUE in consumes else "maintenance")


@task_failure.connect
def _pool_process_lost(sender: Task | None = None, exception: BaseException | None = None, **kwargs: object) -> None:
    """Runs in the worker's parent process when a pool child died mid-task (OOM, a crash)."""
    if not isinstance(exception, WorkerLostError) or sender is None or sender.name != RUN_TASK:
        return
    args = kwargs.get("args") or ()
    if args:
        lost_task_recover(task_id=str(args[0]), node=sender.request.hostname or "worker")
