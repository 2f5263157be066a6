"""How long the retention cleanup takes to delete the events of many finished tasks.

Fills a fresh database (a new SQLite file, or ``--database-url``) with
finished tasks of ``--events`` events each, makes every other one older than
the event retention, refreshes PostgreSQL's statistics as autovacuum would,
then times ``retention_cleanup`` and a second run that finds nothing.

    .venv/bin/python bench/cleanup_scale.py --tasks 4000 --events 100
"""

from __future__ import annotations

import argparse
import time
from datetime import timedelta

from scratch import django_in_scratch

from tests.support.specs import spec_json


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", type=int, default=4000)
    parser.add_argument("--events", type=int, default=100, help="delta events per task")
    parser.add_argument("--database-url", default=None, help="default: a new SQLite file in a temp dir")
    args = parser.parse_args()

    django_in_scratch("cleanup", database_url=args.database_url)
    from django.db import connection, transaction
    from django.utils import timezone

    from tasks_app.core import lifecycle
    from tasks_app.exceptions import ServerRestarted
    from tasks_app.models import Task, TaskEvent
    from tasks_app.services.clients import client_create
    from tasks_app.services.retention import retention_cleanup

    client, _ = client_create(name="bench", scopes="read")
    started = time.perf_counter()
    ids = []
    with transaction.atomic():
        for _ in range(args.tasks):
            task = lifecycle.task_insert(
                client=client,
                request={"model": "demo", "input": "x"},
                generation=spec_json({"model": "demo", "input": "x"}),
                model="demo",
            )
            lifecycle.task_claim(task_id=task.id, worker="bench/1")
            lifecycle.task_start(task_id=task.id, worker="bench/1", item_id="msg_bench")
            lifecycle.task_progress(
                task_id=task.id, worker="bench/1", item_id="msg_bench", deltas=["x"] * args.events, output_tokens=0
            )
            lifecycle.task_fail(task_id=task.id, error=ServerRestarted("bench").to_problem())
            ids.append(task.id)
        Task.objects.filter(pk__in=ids[::2]).update(updated_at=timezone.now() - timedelta(days=8))
    if connection.vendor == "postgresql":
        with connection.cursor() as cursor:
            cursor.execute("ANALYZE")
    print(f"filled {TaskEvent.objects.count()} events in {time.perf_counter() - started:.1f} s")
    for label in ("cleanup", "second run"):
        started = time.perf_counter()
        summary = retention_cleanup()
        print(f"{label}: {time.perf_counter() - started:.2f} s, {summary.describe()}")


if __name__ == "__main__":
    main()
