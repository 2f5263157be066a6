"""Celery tasks are interfaces: take an id, call one service."""

from __future__ import annotations

import os

from celery import Task, shared_task

from tasks_app.services.dispatch import RUN_TASK, queued_tasks_sweep
from workers.execution import task_execute


@shared_task(name=RUN_TASK, bind=True, ignore_result=True)
def run_task(self: Task, task_id: str) -> str:
    worker = f"{self.request.hostname or 'worker'}/{os.getpid()}"
    return task_execute(task_id=task_id, worker=worker)


@shared_task(name="lmsp.sweep_queued", ignore_result=True, acks_late=False)
def sweep_queued() -> int:
    return len(queued_tasks_sweep())
