"""Entry points for child processes that work on the test database.

Children are started with the ``spawn`` method, so they set Django up from
scratch against the DATABASE_URL they are given: a separate process, a
separate connection, exactly like a worker or a second web process.
"""

from __future__ import annotations

import os
from typing import Any

# The one worker that claimed every task of the cancel race.
WORKER = "racer@host/1"


def setup_django(database_url: str) -> None:
    os.environ["DATABASE_URL"] = database_url
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "lmsp_project.settings")
    import django

    django.setup()


def cancel_all(database_url: str, task_ids: list[str], barrier: Any, results: Any) -> None:
    """Cancel each task as the API would (the canceller side of the race)."""
    setup_django(database_url)
    from tasks_app.exceptions import TaskNotCancelable
    from tasks_app.models import Task
    from tasks_app.services.tasks import task_cancel

    outcome = {"cancelled": 0, "not_cancelable": 0}
    for task_id in task_ids:
        barrier.wait()  # both sides start on each task together
        try:
            task_cancel(task=Task.objects.get(pk=task_id))
            outcome["cancelled"] += 1
        except TaskNotCancelable:
            outcome["not_cancelable"] += 1
    results.put(("canceller", outcome))


def complete_all(database_url: str, task_ids: list[str], barrier: Any, results: Any) -> None:
    """Finish each task as a worker would: last deltas, then complete or honour a cancel."""
    setup_django(database_url)
    from tasks_app.core import lifecycle
    from tasks_app.states import TaskStatus

    outcome = {"succeeded": 0, "acknowledged_cancel": 0}
    for task_id in task_ids:
        barrier.wait()
        lifecycle.task_progress(task_id=task_id, worker=WORKER, item_id="msg_race", deltas=["tail"], output_tokens=1)
        done = lifecycle.task_succeed(
            task_id=task_id, worker=WORKER, item_id="msg_race", text="tail", usage=None, output_tokens=1
        )
        if done.won:
            outcome["succeeded"] += 1
            continue
        assert done.task.status == TaskStatus.CANCELLING, done.task.status
        stopped = lifecycle.task_finish_cancel(task_id=task_id, worker=WORKER)
        assert stopped.won
        outcome["acknowledged_cancel"] += 1
    results.put(("completer", outcome))


def create_tasks(database_url: str, client_id: int, count: int, barrier: Any, results: Any) -> None:
    """Accept ``count`` tasks as the API would (each a read-then-write transaction)."""
    setup_django(database_url)
    from tasks_app.models import Client
    from tasks_app.services.tasks import task_create
    from tasks_app.states import RestartPolicy
    from tests.support.specs import spec_of

    client = Client.objects.get(pk=client_id)
    barrier.wait()
    created = []
    for index in range(count):
        request = {"model": "demo", "input": f"prompt {index}"}
        reply = task_create(
            client=client,
            request=request,
            spec=spec_of(request),
            on_restart=RestartPolicy.FAIL,
            idempotency_key=None,
            request_hash=None,
        )
        created.append(reply.body["id"])
    results.put(created)
