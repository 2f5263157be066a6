"""How long startup recovery takes on a large table of leftover tasks.

Fills a fresh SQLite file (or ``--database-url``) with finished tasks and
leftover ones (a mix of queued, loading and running, with all three
policies), then runs ``leftover_tasks_recover`` as ``lmsp_recover`` does and
reports the time, the statements issued and how many of them were the scan.
Needs Redis (retried and resumed tasks are dispatched; to a queue nobody
consumes, removed at the end).

    .venv/bin/python bench/recover_scale.py --leftover 2000 --finished 20000
"""

from __future__ import annotations

import argparse
import time
from typing import Any

from scratch import django_in_scratch

from tests.support.specs import spec_json


def clone(task_id: str, copies: int, chunk: int = 2000) -> None:
    """Copy a task with its response, events and snapshots ``copies`` times, in bulk."""
    from django.db import transaction

    from tasks_app.ids import new_response_id, new_task_id
    from tasks_app.models import Response, Task, TaskEvent, TaskSnapshot

    task = Task.objects.get(pk=task_id)
    response = Response.objects.get(pk=task.response_id)
    events = list(TaskEvent.objects.filter(task_id=task_id))
    snapshots = list(TaskSnapshot.objects.filter(task_id=task_id))
    done = 0
    while done < copies:
        n = min(chunk, copies - done)
        responses, tasks, rows, snaps = [], [], [], []
        for _ in range(n):
            response.pk, task.pk = new_response_id(), new_task_id()
            task.response_id = response.pk
            responses.append(Response(**{f.attname: getattr(response, f.attname) for f in Response._meta.fields}))
            tasks.append(Task(**{f.attname: getattr(task, f.attname) for f in Task._meta.fields}))
            for event in events:
                fields = {f.attname: getattr(event, f.attname) for f in TaskEvent._meta.fields if f.attname != "id"}
                rows.append(TaskEvent(**{**fields, "task_id": task.pk}))
            for snap in snapshots:
                fields = {f.attname: getattr(snap, f.attname) for f in TaskSnapshot._meta.fields if f.attname != "id"}
                snaps.append(TaskSnapshot(**{**fields, "task_id": task.pk}))
        with transaction.atomic():
            Response.objects.bulk_create(responses)
            Task.objects.bulk_create(tasks)
            TaskEvent.objects.bulk_create(rows, batch_size=1000)
            TaskSnapshot.objects.bulk_create(snaps, batch_size=1000)
        done += n


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--leftover", type=int, default=2000, help="unfinished tasks to recover")
    parser.add_argument("--finished", type=int, default=20000, help="finished tasks the scan must skip")
    parser.add_argument("--database-url", default=None, help="default: a new SQLite file in a temp dir")
    args = parser.parse_args()

    django_in_scratch("recover", database_url=args.database_url)
    from django.db import connection, transaction
    from django.utils import timezone

    from tasks_app.core import lifecycle
    from tasks_app.exceptions import ServerRestarted
    from tasks_app.models import Task
    from tasks_app.services.clients import client_create
    from tasks_app.services.recovery import LiveWorkers, leftover_tasks_recover
    from tasks_app.states import RestartPolicy

    client, _ = client_create(name="bench", scopes="responses,read")
    policies = list(RestartPolicy)
    started = time.perf_counter()
    # One task of each kind made by the lifecycle itself, then cloned row for
    # row (response, task, events, snapshots) in bulk: a large table fills in
    # seconds, and every clone is exactly what the verbs write.
    templates = []
    with transaction.atomic():
        task = lifecycle.task_insert(
            client=client,
            request={"model": "demo", "input": "x"},
            generation=spec_json({"model": "demo", "input": "x"}),
            model="demo",
        )
        lifecycle.task_fail(task_id=task.id, error=ServerRestarted("old").to_problem())
        finished_template = task.id
        for n in range(9):
            task = lifecycle.task_insert(
                client=client,
                request={"model": "demo", "input": "x"},
                generation=spec_json({"model": "demo", "input": "x"}),
                model="demo",
            )
            Task.objects.filter(pk=task.id).update(on_restart=policies[n // 3])
            templates.append(task.id)
            if n % 3 == 0:
                continue  # queued
            lifecycle.task_claim(task_id=task.id, worker="gone@host/1")
            if n % 3 == 2:
                lifecycle.task_start(
                    task_id=task.id,
                    worker="gone@host/1",
                    item_id=f"msg_{n}",
                    snapshot={"token_ids": [], "state": {"item_id": f"msg_{n}", "backend": {}}},
                )
    clone(finished_template, args.finished)
    for n, template in enumerate(templates):
        clone(template, args.leftover // len(templates) + (n < args.leftover % len(templates)))
    Task.objects.filter(pk__in=[finished_template, *templates]).update(status="succeeded")
    print(
        f"filled {args.finished} finished and {args.leftover} leftover tasks in {time.perf_counter() - started:.1f} s"
    )

    statements = {"all": 0, "scan": 0}

    def count(execute: Any, sql: str, params: Any, many: bool, context: Any) -> Any:
        statements["all"] += 1
        if '"tasks"."id" >' in sql and '"tasks"."status" IN' in sql:
            statements["scan"] += 1
        return execute(sql, params, many, context)

    nobody = LiveWorkers(frozenset(), frozenset(), timezone.now())
    with connection.execute_wrapper(count):
        started = time.perf_counter()
        summary = leftover_tasks_recover(live=nobody)
        wall = time.perf_counter() - started
    print(
        f"recovered {args.leftover} leftover tasks among {args.finished + args.leftover} in {wall:.2f} s "
        f"({wall / max(1, args.leftover) * 1000:.2f} ms per task); {statements['all']} statements, "
        f"{statements['scan']} of them the scan"
    )
    print("; ".join(summary.lines()))
    started = time.perf_counter()
    again = leftover_tasks_recover(live=nobody)
    print(f"second run: {time.perf_counter() - started:.2f} s, moved {again.moved}")


if __name__ == "__main__":
    main()
