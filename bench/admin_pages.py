"""The operator's admin pages on a large history: the task list (plain and triage filters), a task page with
many attempts and events, the workers page (issue 47).

Fills a fresh database (a new SQLite file, or ``--database-url``: an empty database) with ``--finished``
finished tasks (bulk, as ``bench/partial_indexes.py`` does: a task and its response per row, a third of them
failed), a few hundred queued and held tasks through the lifecycle (the held ones on ``--nodes`` worker
nodes, some with a silent heartbeat), one task with ``--attempts`` attempts that each committed ``--deltas``
batches, and the nodes' reports. Then times whole admin requests through Django's test client (a staff
session), ``--repeat`` times each, and prints the median and the minimum in milliseconds, with the number
of queries of the last run.

    .venv/bin/python bench/admin_pages.py
    .venv/bin/python bench/admin_pages.py --database-url postgres://postgres@127.0.0.1:5432/benchadmin
"""

from __future__ import annotations

import argparse
import statistics
import time
from datetime import timedelta

from scratch import django_in_scratch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--finished", type=int, default=200_000, help="finished tasks (the history kept)")
    parser.add_argument("--queued", type=int, default=300)
    parser.add_argument("--held", type=int, default=200, help="running tasks on the nodes")
    parser.add_argument("--nodes", type=int, default=8, help="worker nodes that report themselves")
    parser.add_argument("--attempts", type=int, default=5, help="attempts of the one task with a long history")
    parser.add_argument("--deltas", type=int, default=200, help="delta batches each of its attempts committed")
    parser.add_argument("--repeat", type=int, default=20)
    parser.add_argument("--database-url", default=None, help="default: a new SQLite file in a temp dir")
    args = parser.parse_args()

    django_in_scratch("admin", database_url=args.database_url)
    from django.contrib.auth.models import User
    from django.db import connection, transaction
    from django.test import Client as Browser
    from django.test.utils import CaptureQueriesContext
    from django.utils import timezone

    from tasks_app.core import lifecycle
    from tasks_app.exceptions import ServerRestarted
    from tasks_app.ids import new_response_id, new_task_id
    from tasks_app.models import Response, Task, WorkerNode, WorkerNodeState
    from tasks_app.services.clients import client_create
    from tasks_app.services.workers import worker_node_report
    from tasks_app.states import AttemptEnd, ResponseStatus, TaskStatus
    from tests.support.specs import spec_json

    S = TaskStatus
    clients = [client_create(name=f"bench-{n}", scopes="responses,read")[0] for n in range(10)]
    now = timezone.now()
    error = ServerRestarted("bench").to_problem()
    kinds = [(S.SUCCEEDED, ResponseStatus.COMPLETED), (S.FAILED, ResponseStatus.FAILED), (S.CANCELLED, None)]
    for first in range(0, args.finished, 5000):
        responses, tasks = [], []
        for n in range(first, min(first + 5000, args.finished)):
            status, response_status = kinds[n % 3]
            at = now - timedelta(days=30) + timedelta(days=30) * n / args.finished
            response = Response(
                id=new_response_id(),
                client=clients[n % 10],
                model="demo",
                status=response_status or ResponseStatus.CANCELLED,
                request={"model": "demo", "input": "x"},
                error=error if status == S.FAILED else None,
                created_at=at,
                updated_at=at,
            )
            responses.append(response)
            tasks.append(
                Task(
                    id=new_task_id(),
                    client=clients[n % 10],
                    status=status,
                    response=response,
                    error=error if status == S.FAILED else None,
                    attempts=1,
                    created_at=at,
                    updated_at=at,
                    finished_at=at,
                )
            )
        with transaction.atomic():
            Response.objects.bulk_create(responses)
            Task.objects.bulk_create(tasks)

    def insert() -> str:
        request = {"model": "demo", "input": "x"}
        return lifecycle.task_insert(client=clients[0], request=request, generation=spec_json(request), model="demo").id

    for _ in range(args.queued):
        insert()
    nodes = [f"node{n}@host" for n in range(args.nodes)]
    for n in range(args.held):
        task_id = insert()
        worker = f"{nodes[n % args.nodes]}/{100 + n % 4}"
        lifecycle.task_claim(task_id=task_id, worker=worker)
        lifecycle.task_start(task_id=task_id, worker=worker, item_id=f"msg_{n}")
        if n % args.nodes == 0:
            Task.objects.filter(pk=task_id).update(heartbeat_at=now - timedelta(minutes=5))
    long_id = insert()
    for attempt in range(args.attempts):
        worker = f"{nodes[attempt % args.nodes]}/7"
        lifecycle.task_claim(task_id=long_id, worker=worker)
        lifecycle.task_start(task_id=long_id, worker=worker, item_id=f"msg_long{attempt}")
        for batch in range(args.deltas):
            lifecycle.task_progress(
                task_id=long_id, worker=worker, item_id=f"msg_long{attempt}", deltas=["ab"] * 4, output_tokens=batch * 4
            )
        if attempt < args.attempts - 1:
            row = Task.objects.get(pk=long_id)
            move = lifecycle.RecoveryMove(
                long_id, S.RUNNING, S.QUEUED, worker, row.heartbeat_at, end=AttemptEnd.REAPED, reason="bench"
            )
            lifecycle.tasks_recover(moves=[move])
    for name in nodes:
        engines = [{"model": "demo", "device": "CPUExecutionProvider", "rows": 25, "waiting": 0, "tokens_per_s": 900.0}]
        worker_node_report(
            name=name,
            hostname="host",
            pid=1,
            pool="threads",
            state=WorkerNodeState.ONLINE,
            started_at=now,
            max_rows=64,
            engines=engines,
        )
    WorkerNode.objects.filter(pk=nodes[0]).update(reported_at=now - timedelta(minutes=5))

    User.objects.create_superuser("bench", "bench@example.org", "bench")
    browser = Browser()
    browser.force_login(User.objects.get(username="bench"))
    pages = {
        "task list": "/admin/tasks_app/task/",
        "task list, server_restarted, last 24 h": "/admin/tasks_app/task/?error=server_restarted&created=24h",
        "task list, stuck (silent heartbeat)": "/admin/tasks_app/task/?heartbeat=silent",
        "task list, queued": "/admin/tasks_app/task/?status=queued",
        f"task page, {args.attempts} attempts, {Task.objects.get(pk=long_id).last_sequence} events": (
            f"/admin/tasks_app/task/{long_id}/change/"
        ),
        "task liveness (polled every 2 s)": f"/admin/tasks_app/task/{long_id}/liveness/",
        f"workers page, {args.nodes} nodes, {args.held} held tasks": "/admin/tasks_app/workernode/",
    }
    print(f"{args.finished} finished tasks, {args.queued} queued, {args.held} running; {connection.vendor}")
    print(f"{'page':<58} {'median ms':>10} {'min ms':>8} {'queries':>8}")
    for label, url in pages.items():
        assert browser.get(url).status_code == 200, url
        times = []
        for _ in range(args.repeat):
            with CaptureQueriesContext(connection) as queries:
                started = time.perf_counter()
                reply = browser.get(url)
                times.append((time.perf_counter() - started) * 1000)
            assert reply.status_code == 200, url
        print(f"{label:<58} {statistics.median(times):>10.1f} {min(times):>8.1f} {len(queries):>8}")


if __name__ == "__main__":
    main()
