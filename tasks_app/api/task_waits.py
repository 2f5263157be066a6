"""Waiting for a task's end on behalf of a client that asked for the whole answer in one reply.

Chat Completions, Messages and Ollama's ``stream: false`` answer once the
generation ended: ``task_end_wait`` waits for that holding no thread (wake-ups
of the task's end, or a periodic read), and a client that goes away meanwhile
cancels the generation (its answer has no id to come back for).
"""

from __future__ import annotations

import asyncio
from typing import Any

from tasks_app import states
from tasks_app.core.wire import Live, response_object
from tasks_app.plumbing.dbpool import run_db, run_db_through_outages
from tasks_app.plumbing.wakeups import Watch
from tasks_app.selectors import tasks as selectors
from tasks_app.services.responses import response_task_finished
from tasks_app.services.tasks import task_abandon


async def task_end_wait(task_id: str) -> None:
    """Return once the task ended; cancel it if the client leaves first (Django cancels the view then)."""
    try:
        with Watch(task_id, statuses=states.TERMINAL) as watch:
            while not await run_db_through_outages(response_task_finished, task_id=task_id):
                await watch.wait(watch.hub.poll_interval())
    except asyncio.CancelledError:
        await asyncio.shield(run_db(task_abandon, task_id=task_id))
        raise


def task_response_read(task_id: str) -> dict[str, Any]:
    """The response object of a task (run on the database pool: ``run_db_through_outages``)."""
    task = selectors.task_stream_task(task_id=task_id)
    return response_object(selectors.response_read(response_id=task.response_id).response, Live())
