"""The items of a run that may call tools, as the event log keeps them (``tasks_app.core.output_items``).

What a worker writes (a message, then calls, through the lifecycle's verbs)
is what every reader folds back from the log: a live read, the recovery of a
task whose worker died (``fail`` keeps the items, the open one
``incomplete``), and a cancel.
"""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.utils import timezone

from tasks_app.core import lifecycle
from tasks_app.core.lifecycle import Partial
from tasks_app.core.output_items import OutputItems
from tasks_app.models import Response, Task
from tasks_app.selectors import tasks as selectors
from tasks_app.services.recovery import LiveWorkers, leftover_tasks_recover
from tasks_app.states import RestartPolicy, TaskStatus
from tests.support.specs import spec_json

GHOST = "ghost@nowhere/1"
TOOLS = [{"type": "function", "name": "get_weather", "parameters": {"type": "object"}}]


@pytest.fixture
def calling(make_client, demo_model, queue):
    """A running task that wrote a message and the first half of a call, as a worker writes them."""
    client, _ = make_client()
    request = {"model": "demo", "input": "Weather?", "tools": TOOLS}
    task = lifecycle.task_insert(client=client, request=request, generation=spec_json(request), model="demo")
    Task.objects.filter(pk=task.id).update(on_restart=RestartPolicy.FAIL)
    assert lifecycle.task_claim(task_id=task.id, worker=GHOST).won
    assert lifecycle.task_start(task_id=task.id, worker=GHOST, item_id=None).won
    items = OutputItems()
    written = [*items.text("Let me look."), *items.call_start("get_weather"), *items.call_arguments('{"city": "Os')]
    assert lifecycle.task_progress(
        task_id=task.id, worker=GHOST, item_id="", deltas=[], output_tokens=12, item_events=written
    ).won
    return task.id, items


def test_the_log_folds_back_into_the_items_the_worker_wrote(calling):
    task_id, items = calling
    folded = selectors.task_output_items(task_id=task_id)
    assert [item.wire("in_progress") for item in folded] == items.output("in_progress")
    # A live read shows them: the message done, the call still being written.
    live = selectors.response_live(response=Response.objects.select_related("task").get(task__id=task_id))
    assert [(item["type"], item["status"]) for item in live.output] == [
        ("message", "completed"),
        ("function_call", "in_progress"),
    ]
    assert live.output[1]["arguments"] == '{"city": "Os'


def test_a_task_whose_worker_died_mid_call_fails_keeping_its_items(calling):
    task_id, _ = calling
    Task.objects.filter(pk=task_id).update(heartbeat_at=timezone.now() - timedelta(seconds=600))

    leftover_tasks_recover(live=LiveWorkers(frozenset(), frozenset(), timezone.now()))

    response = Response.objects.get(task__id=task_id)
    assert Task.objects.get(pk=task_id).status == TaskStatus.FAILED
    assert [(item["type"], item["status"]) for item in response.output] == [
        ("message", "completed"),
        ("function_call", "incomplete"),
    ]
    assert response.output[0]["content"][0]["text"] == "Let me look."
    assert response.output[1]["arguments"] == '{"city": "Os'


def test_a_cancelled_call_keeps_what_was_committed(calling):
    task_id, _ = calling
    assert lifecycle.task_request_cancel(task_id=task_id).won
    partial = Partial("", "", None, items=selectors.task_output_items(task_id=task_id))

    assert lifecycle.task_finish_cancel(task_id=task_id, worker=GHOST, partial=partial).won

    response = Response.objects.get(task__id=task_id)
    assert response.status == "cancelled"
    assert [(item["type"], item["status"]) for item in response.output] == [
        ("message", "completed"),
        ("function_call", "incomplete"),
    ]
