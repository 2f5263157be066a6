"""Several processes writing one database at once: no "database is locked"."""

from __future__ import annotations

import multiprocessing

import pytest
from django.db import connection

from tasks_app.models import Task, TaskEvent
from tests.support import procs
from tests.support.db import database_url

WRITERS = 3
PER_WRITER = 80


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_concurrent_task_creation_from_processes(make_client, demo_model):
    """task_create reads (model, queue depth) before it writes: with SQLite's
    default DEFERRED transactions concurrent writers fail at once with
    "database is locked"; IMMEDIATE makes them wait their turn."""
    client, _ = make_client()
    ctx = multiprocessing.get_context("spawn")
    barrier = ctx.Barrier(WRITERS)
    results = ctx.Queue()
    children = [
        ctx.Process(target=procs.create_tasks, args=(database_url(), client.pk, PER_WRITER, barrier, results))
        for _ in range(WRITERS)
    ]
    for child in children:
        child.start()
    created = [task_id for _ in children for task_id in results.get(timeout=300)]
    for child in children:
        child.join(timeout=60)
        assert child.exitcode == 0
    assert len(set(created)) == WRITERS * PER_WRITER
    assert Task.objects.count() == WRITERS * PER_WRITER
    assert TaskEvent.objects.filter(sequence_number=0, type="response.created").count() == WRITERS * PER_WRITER


@pytest.mark.django_db
def test_sqlite_runs_in_wal_with_immediate_transactions():
    if connection.vendor != "sqlite":
        assert connection.vendor == "postgresql"
        assert connection.settings_dict["CONN_HEALTH_CHECKS"] is True
        return
    with connection.cursor() as cursor:
        cursor.execute("PRAGMA journal_mode")
        assert cursor.fetchone()[0] == "wal"
        cursor.execute("PRAGMA busy_timeout")
        assert cursor.fetchone()[0] >= 1000
    assert connection.transaction_mode == "IMMEDIATE"
