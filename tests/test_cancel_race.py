"""Cancel racing completion, in two real processes on one database."""

from __future__ import annotations

import json
import multiprocessing
from collections import defaultdict

import pytest

from tasks_app.core import lifecycle
from tasks_app.models import Task, TaskEvent
from tasks_app.states import TaskStatus
from tests.support import procs
from tests.support.db import database_url
from tests.support.specs import spec_json

TASKS = 240
TERMINAL_EVENT_FOR = {TaskStatus.SUCCEEDED: "response.completed", TaskStatus.CANCELLED: "response.cancelled"}


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_cancel_vs_completion_each_task_ends_once(make_client, demo_model):
    client, _ = make_client()
    ids = []
    for _ in range(TASKS):
        task = lifecycle.task_insert(
            client=client,
            request={"model": "demo", "input": "x"},
            generation=spec_json({"model": "demo", "input": "x"}),
            model="demo",
        )
        lifecycle.task_claim(task_id=task.id, worker=procs.WORKER)
        lifecycle.task_start(task_id=task.id, worker=procs.WORKER, item_id="msg_race")
        ids.append(task.id)

    ctx = multiprocessing.get_context("spawn")
    barrier = ctx.Barrier(2)
    results = ctx.Queue()
    url = database_url()
    children = [
        ctx.Process(target=procs.cancel_all, args=(url, ids, barrier, results)),
        ctx.Process(target=procs.complete_all, args=(url, ids, barrier, results)),
    ]
    for child in children:
        child.start()
    outcomes = dict(results.get(timeout=300) for _ in children)
    for child in children:
        child.join(timeout=60)
        assert child.exitcode == 0

    statuses = defaultdict(int)
    for task in Task.objects.filter(pk__in=ids).select_related("response"):
        statuses[task.status] += 1
        assert task.status in TERMINAL_EVENT_FOR, task.status
        log = [
            json.loads(p)
            for p in TaskEvent.objects.filter(task=task).order_by("sequence_number").values_list("payload", flat=True)
        ]
        assert [e["sequence_number"] for e in log] == list(range(len(log))), task.id
        assert task.last_sequence == len(log) - 1
        terminal = [
            e
            for e in log
            if e["type"] in ("response.completed", "response.cancelled", "response.failed", "response.incomplete")
        ]
        assert len(terminal) == 1, task.id
        assert terminal[0] is log[-1]
        assert terminal[0]["type"] == TERMINAL_EVENT_FOR[task.status]
        assert terminal[0]["response"]["status"] == task.response.status
    # Every task was claimed by exactly one side, and the processes agree.
    assert statuses[TaskStatus.SUCCEEDED] == outcomes["completer"]["succeeded"]
    assert statuses[TaskStatus.CANCELLED] == outcomes["completer"]["acknowledged_cancel"]
    assert outcomes["canceller"]["not_cancelable"] == statuses[TaskStatus.SUCCEEDED]
    assert outcomes["canceller"]["cancelled"] == statuses[TaskStatus.CANCELLED]
    print(f"outcomes over {TASKS} tasks: {dict(statuses)} {outcomes}")
