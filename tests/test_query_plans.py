"""The hot task queries read unfinished or finished tasks through their partial index.

SQLite uses ``task_active`` / ``task_finished`` only when the query spells
out the index's condition (``tasks_app.plumbing.querying``); without it these queries
scan an index over every task ever kept (tens of milliseconds at 200,000
tasks, bench/partial_indexes.py). Each test runs the real service on a small
table, checks what it did (on both databases), and on SQLite asks for the
plan of the very statements the service ran, with their parameters bound as
they were. PostgreSQL proves the implication itself and picks its plans from
statistics, so its plans are not asserted here.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

import pytest
from django.db import connection, transaction
from django.utils import timezone

from tasks_app import states
from tasks_app.core import lifecycle
from tasks_app.exceptions import QueueFull, ServerRestarted
from tasks_app.models import Batch, BatchStatus, Task, WorkerNodeState
from tasks_app.plumbing.notify import key, redis_client
from tasks_app.plumbing.querying import status_in
from tasks_app.selectors import tasks as selectors
from tasks_app.services.batches import batches_advance
from tasks_app.services.dispatch import queued_tasks_sweep
from tasks_app.services.recovery import LiveWorkers, abandoned_tasks_reap, leftover_tasks_recover
from tasks_app.services.retention import retention_cleanup
from tasks_app.services.tasks import task_accept
from tasks_app.services.workers import worker_node_report
from tasks_app.states import RestartPolicy, TaskStatus
from tests.support import moves
from tests.support.specs import spec_json, spec_of
from tests.support.states import PATHS

S = TaskStatus
GHOST = "ghost@nowhere/1"
FAILURE = ServerRestarted("test").to_problem()


@contextmanager
def statements() -> Iterator[list[tuple[str, Any]]]:
    """Every statement run inside, as handed to the driver: SQL and parameters apart."""
    captured: list[tuple[str, Any]] = []

    def capture(execute: Callable[..., Any], sql: str, params: Any, many: bool, context: Any) -> Any:
        captured.append((sql, params))
        return execute(sql, params, many, context)

    with connection.execute_wrapper(capture):
        yield captured


def assert_read_through(index: str, captured: list[tuple[str, Any]]) -> None:
    """On SQLite, each statement's plan searches ``index``; on PostgreSQL nothing is asserted."""
    assert captured, "the service ran none of the statements looked for"
    if connection.vendor != "sqlite":
        return
    for sql, params in captured:
        with connection.cursor() as cursor:
            cursor.execute("EXPLAIN QUERY PLAN " + sql, params)
            plan = "; ".join(str(row[-1]) for row in cursor.fetchall())
        assert re.search(rf"\bINDEX {index}\b", plan), f"{plan}\n  for {sql}"


def tasks_selects(captured: list[tuple[str, Any]], *marks: str) -> list[tuple[str, Any]]:
    """The SELECTs over ``tasks`` whose SQL holds every one of ``marks``."""
    return [
        (sql, params)
        for sql, params in captured
        if sql.startswith("SELECT") and 'FROM "tasks"' in sql and all(mark in sql for mark in marks)
    ]


@pytest.fixture
def make_task(make_client, demo_model) -> Callable[..., str]:
    """``make_task(status, age=seconds, policy=...)``: a task moved there the lifecycle's way.

    A held task's worker is GHOST, its last heartbeat ``age`` old; every task's
    ``updated_at`` is set ``age`` back too.
    """
    client, _ = make_client()

    def make(status: TaskStatus, *, age: int = 0, policy: RestartPolicy = RestartPolicy.FAIL) -> str:
        task = lifecycle.task_insert(
            client=client,
            request={"model": "demo", "input": "x"},
            generation=spec_json({"model": "demo", "input": "x"}),
            model="demo",
        )
        Task.objects.filter(pk=task.id).update(on_restart=policy)
        then = timezone.now() - timedelta(seconds=age)
        for step in PATHS[status]:
            moved = moves.move(task.id, step, worker=GHOST, error=FAILURE) if step == S.FAILED else None
            moved = moved or moves.move(task.id, step, worker=GHOST)
            assert moved.won, (task.id, step)
        Task.objects.filter(pk=task.id).update(updated_at=then)
        if status in states.HELD:
            Task.objects.filter(pk=task.id).update(heartbeat_at=then)
        return task.id

    return make


def test_the_queue_limit_counts_only_queued_tasks_through_the_active_index(make_task, settings):
    for status in (S.QUEUED, S.LOADING, S.RUNNING, S.CANCELLING, S.FAILED, S.SUCCEEDED, S.CANCELLED):
        first = make_task(status)
    make_task(S.QUEUED)
    client = Task.objects.get(pk=first).client
    settings.LMSP_MAX_QUEUED_TASKS = 3
    request = {"model": "demo", "input": "one more"}

    # Two queued: room for one more, whatever the other tasks are.
    with statements() as captured, transaction.atomic():
        accepted = task_accept(
            client=client, request=request, spec=spec_of(request), on_restart=RestartPolicy.FAIL
        ).task
    assert Task.objects.get(pk=accepted.id).status == S.QUEUED
    with pytest.raises(QueueFull), transaction.atomic():
        task_accept(client=client, request=request, spec=spec_of(request), on_restart=RestartPolicy.FAIL)

    assert_read_through("task_active", tasks_selects(captured, "SELECT COUNT(*)"))


def test_the_batch_keepers_window_counts_the_active_tasks_through_the_active_index(make_task, make_client):
    for status in (S.QUEUED, S.RUNNING, S.SUCCEEDED, S.FAILED, S.CANCELLED):
        make_task(status)
    client, _ = make_client()
    now = timezone.now()
    # A worker that reports its rows: the window is those rows less what runs, counted each round.
    worker_node_report(
        name="w@host",
        hostname="host",
        pid=1,
        pool="threads",
        state=WorkerNodeState.ONLINE,
        started_at=now,
        max_rows=4,
        engines=[],
    )
    Batch.objects.create(
        id="batch_01J0000000000000000000000B",
        client=client,
        endpoint="/v1/responses",
        input_file_id="file-x",
        status=BatchStatus.IN_PROGRESS,
        created_at=now,
        expires_at=now + timedelta(hours=24),
    )

    with statements() as captured:
        batches_advance(render=lambda endpoint, response: response)

    assert_read_through("task_active", tasks_selects(captured, "SELECT COUNT(*)"))


def test_startup_recovery_pages_through_unfinished_tasks_on_the_active_index(make_task):
    queued = [make_task(S.QUEUED) for _ in range(3)]
    for status in (S.SUCCEEDED, S.FAILED, S.CANCELLED):
        make_task(status, age=600)
    abandoned = [make_task(S.RUNNING, age=600) for _ in range(2)]
    # A live worker exists (the queued tasks wait for it); it does not hold the running ones.
    live = LiveWorkers(frozenset({"alive@host"}), frozenset(), timezone.now())

    with statements() as captured:
        summary = leftover_tasks_recover(live=live, batch_size=2)

    assert summary.task_ids == {"left queued": queued, "failed": abandoned}
    assert set(Task.objects.filter(pk__in=abandoned).values_list("status", flat=True)) == {S.FAILED}
    scans = tasks_selects(captured, '"tasks"."id" >', "LIMIT 2")
    assert len(scans) == 3  # 2 + 2 + 1 of the 5 unfinished tasks
    assert_read_through("task_active", scans)


def test_the_reaper_pages_through_held_tasks_on_the_active_index(make_task):
    stale = make_task(S.RUNNING, age=600)
    fresh = make_task(S.RUNNING, age=5)
    stale_loading = make_task(S.LOADING, age=600)
    make_task(S.QUEUED, age=600)
    make_task(S.FAILED, age=600)

    with statements() as captured:
        summary = abandoned_tasks_reap(timeout_seconds=60)

    assert summary.task_ids == {"failed": [stale, stale_loading]}
    assert Task.objects.get(pk=fresh).status == S.RUNNING
    assert_read_through("task_active", tasks_selects(captured, '"tasks"."id" >', "LIMIT 500"))


def test_the_sweeper_finds_waiting_tasks_through_the_active_index(make_task, queue):
    lost = make_task(S.QUEUED)
    orphan = make_task(S.RUNNING, age=600, policy=RestartPolicy.RESUME)
    held = make_task(S.RUNNING, age=5)
    finished = make_task(S.CANCELLED)
    young = make_task(S.QUEUED)
    # The reaper leaves the abandoned task running without a worker, to be resumed.
    assert abandoned_tasks_reap(timeout_seconds=60).task_ids == {"running (to resume)": [orphan]}
    redis_client().delete(queue, key("dispatched", orphan))
    old = timezone.now() - timedelta(seconds=60)
    Task.objects.filter(pk__in=[lost, orphan, held, finished]).update(updated_at=old)

    with statements() as captured:
        sent = queued_tasks_sweep(grace_seconds=30)

    assert sent == [lost, orphan]
    assert young not in sent
    assert_read_through("task_active", tasks_selects(captured, '"tasks"."updated_at" <='))


def test_retention_finds_expired_tasks_through_the_finished_index(make_task, settings):
    settings.LMSP_EVENT_RETENTION_SECONDS = 3600
    settings.LMSP_TASK_RETENTION_SECONDS = 2 * 3600
    expired = [make_task(status, age=3 * 3600) for status in (S.SUCCEEDED, S.FAILED, S.CANCELLED)]
    recent = make_task(S.SUCCEEDED, age=60)
    old_unfinished = [make_task(S.QUEUED, age=3 * 3600), make_task(S.RUNNING, age=3 * 3600)]

    with statements() as captured:
        summary = retention_cleanup(batch_size=2)

    assert summary.tasks == 3
    assert not Task.objects.filter(pk__in=expired).exists()
    assert set(Task.objects.values_list("pk", flat=True)) == {recent, *old_unfinished}
    pages = tasks_selects(captured, '"tasks"."updated_at" <', "LIMIT 2")
    # Events: two chunks of tasks (the second after a keyset bound); tasks: two batches.
    assert len(pages) == 4
    assert_read_through("task_finished", pages)


def test_a_status_filter_takes_only_task_statuses_and_matches_status_in(make_task):
    ids = {status: make_task(status) for status in S}

    for wanted in ([S.QUEUED], [S.RUNNING, S.LOADING], states.ACTIVE, [S.FAILED], [S.QUEUED, S.SUCCEEDED]):
        found = set(Task.objects.filter(status_in(wanted)).values_list("pk", flat=True))
        assert found == {ids[status] for status in wanted}
        assert set(Task.objects.exclude(status_in(wanted)).values_list("pk", flat=True)) == set(ids.values()) - found
    for bad in (["queued') OR 1=1 --"], ["QUEUED"], []):
        with pytest.raises(ValueError):
            status_in(bad)


def test_a_queue_position_counts_the_line_ahead_through_the_active_index(make_task):
    for status in (S.QUEUED, S.RUNNING, S.SUCCEEDED, S.QUEUED, S.CANCELLED):
        make_task(status)
    last = make_task(S.QUEUED)
    queued = list(Task.objects.filter(status=S.QUEUED).order_by("id").values_list("id", flat=True))

    with statements() as captured:
        positions = selectors.task_queue_positions(task_ids=queued)

    assert positions == {task_id: place for place, task_id in enumerate(queued, start=1)}
    assert positions[last] == 3
    assert_read_through("task_active", tasks_selects(captured, "COUNT"))
