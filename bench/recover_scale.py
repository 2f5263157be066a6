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
import os
import time
from typing import Any

from scratch import django_in_scratch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--leftover", type=int, default=2000, help="unfinished tasks to recover")
    parser.add_argument("--finished", type=int, default=20000, help="finished tasks the scan must skip")
    parser.add_argument("--database-url", default=None, help="default: a new SQLite file in a temp dir")
    args = parser.parse_args()

    django_in_scratch("recover", database_url=args.database_url)
    from django.db import connection, transaction
    from django.utils import timezone

    from tasks_app import lifecycle
    from tasks_app.exceptions import ServerRestarted
    from tasks_app.models import Task
    from tasks_app.notify import redis_client
    from tasks_app.services.clients import client_create
    from tasks_app.services.recovery import LiveWorkers, leftover_tasks_recover
    from tasks_app.states import RestartPolicy

    client, _ = client_create(name="bench", scopes="responses,read")
    policies = list(RestartPolicy)
    started = time.perf_counter()
    with transaction.atomic():
        for _ in range(args.finished):
            task = lifecycle.task_insert(client=client, request={"model": "demo", "input": "x"}, model="demo")
            lifecycle.task_fail(task_id=task.id, error=ServerRestarted("old").to_problem())
        for n in range(args.leftover):
            task = lifecycle.task_insert(client=client, request={"model": "demo", "input": "x"}, model="demo")
            Task.objects.filter(pk=task.id).update(on_restart=policies[(n // 3) % 3])
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
    for key in redis_client().scan_iter(match=f"{os.environ['LMSP_REDIS_PREFIX']}*", count=1000):
        redis_client().delete(key)


if __name__ == "__main__":
    main()
