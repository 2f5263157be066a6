"""What the partial indexes save the hot task queries on a large table, before and after ``status_in``.

Fills a fresh database (a new SQLite file, or ``--database-url``: an empty
database) with ``--finished`` finished tasks and a few hundred unfinished ones
(queued, loading, running, cancelling; some running ones orphaned, waiting to
be adopted), refreshes PostgreSQL's statistics as autovacuum would (SQLite
gets none, as in the service, unless ``--sqlite-analyze``), then times each
query in two forms and checks that both return the same rows:

- before: ``status=...`` / ``status__in=[...]`` as the services wrote them
  (Django binds the statuses as parameters);
- after: ``tasks_app.plumbing.querying.status_in``, as the services write them now.

The queries: ``task_accept``'s count of queued tasks (run for every new
task), a page of startup recovery's keyset scan, a page of the reaper's, one
sweep, retention's first page of expired tasks and a chunk halfway through
them (the one ``_delete_events`` reads; "before" is also without the
``updated_at >=`` bound it now has) and the metrics' ``GROUP BY``. Each
runs ``--repeat`` times; the median and the minimum are printed with the
plan of the statement as run.

The finished tasks are inserted with ``bulk_create`` (a task and its response
per row, no events): going through ``lifecycle`` costs about 3 ms per
finished task here, ten minutes for 200,000, and none of these queries reads
events. The unfinished ones go through ``lifecycle`` as in the service.

    .venv/bin/python bench/partial_indexes.py
    .venv/bin/python bench/partial_indexes.py --database-url postgres://postgres@127.0.0.1:5432/benchpartial
"""

from __future__ import annotations

import argparse
import re
import shutil
import statistics
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from scratch import django_in_scratch

from tests.support.specs import spec_json


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--finished", type=int, default=200_000, help="finished tasks (the history kept)")
    parser.add_argument("--queued", type=int, default=600, help="queued tasks")
    parser.add_argument("--held", type=int, default=300, help="loading, running and cancelling tasks")
    parser.add_argument("--clients", type=int, default=20, help="clients the tasks belong to")
    parser.add_argument("--repeat", type=int, default=30, help="runs of each query")
    parser.add_argument(
        "--sqlite-analyze", action="store_true", help="give SQLite statistics too (the service never runs ANALYZE)"
    )
    parser.add_argument("--keep", action="store_true", help="keep the temp dir (and its SQLite file of ~160 MB)")
    parser.add_argument("--database-url", default=None, help="default: a new SQLite file in a temp dir")
    args = parser.parse_args()

    scratch = django_in_scratch("partial", database_url=args.database_url)
    from django.db import connection, transaction
    from django.db.models import Count, Q
    from django.utils import timezone

    from tasks_app.core import lifecycle
    from tasks_app.exceptions import ServerRestarted
    from tasks_app.ids import new_response_id, new_task_id
    from tasks_app.models import Response, Task
    from tasks_app.plumbing.querying import status_in
    from tasks_app.services.clients import client_create
    from tasks_app.services.dispatch import SWEEP_BATCH
    from tasks_app.services.recovery import _FIELDS
    from tasks_app.states import ACTIVE, HELD, ORPHANABLE, TERMINAL, ResponseStatus, TaskStatus, in_declaration_order

    S = TaskStatus
    clients = [client_create(name=f"bench-{n}", scopes="responses,read")[0] for n in range(args.clients)]
    now = timezone.now()
    started = time.perf_counter()
    # A month of history, oldest first; statuses and clients in rotation.
    terminal = {
        S.SUCCEEDED: ResponseStatus.COMPLETED,
        S.FAILED: ResponseStatus.FAILED,
        S.CANCELLED: ResponseStatus.CANCELLED,
    }
    error = ServerRestarted("bench").to_problem()
    chunk = 5000
    for first in range(0, args.finished, chunk):
        responses, tasks = [], []
        for n in range(first, min(first + chunk, args.finished)):
            status = in_declaration_order(TERMINAL)[n % 3]
            at = now - timedelta(days=30) + timedelta(days=30) * n / args.finished
            client = clients[n % len(clients)]
            response = Response(
                id=new_response_id(),
                client=client,
                model="demo",
                status=terminal[status],
                request={"model": "demo", "input": "x"},
                error=error if status == S.FAILED else None,
                created_at=at,
                updated_at=at,
            )
            responses.append(response)
            tasks.append(
                Task(
                    id=new_task_id(),
                    client=client,
                    status=status,
                    response=response,
                    error=error if status == S.FAILED else None,
                    created_at=at,
                    updated_at=at,
                )
            )
        with transaction.atomic():
            Response.objects.bulk_create(responses)
            Task.objects.bulk_create(tasks)
    stale = now - timedelta(hours=1)
    unfinished = []
    with transaction.atomic():
        for n in range(args.queued + args.held):
            task = lifecycle.task_insert(
                client=clients[n % len(clients)],
                request={"model": "demo", "input": "x"},
                generation=spec_json({"model": "demo", "input": "x"}),
                model="demo",
            )
            unfinished.append(task.id)
            if n < args.queued:
                continue
            lifecycle.task_claim(task_id=task.id, worker="gone@host/1")
            Task.objects.filter(pk=task.id).update(heartbeat_at=stale)
            kind = n % 4
            if kind == 0:
                continue  # loading
            lifecycle.task_start(task_id=task.id, worker="gone@host/1", item_id=f"msg_{n}")
            Task.objects.filter(pk=task.id).update(heartbeat_at=stale)
            if kind == 1:
                lifecycle.task_request_cancel(task_id=task.id)
            elif kind == 2:
                # Recovered for a resume and not adopted yet: waits for the sweeper.
                Task.objects.filter(pk=task.id).update(worker="", heartbeat_at=None)
        # Old enough for the sweeper's grace period.
        Task.objects.filter(pk__in=unfinished).update(updated_at=stale)
    if connection.vendor == "postgresql" or args.sqlite_analyze:
        with connection.cursor() as cursor:
            cursor.execute("ANALYZE")
    counts = dict(Task.objects.values_list("status").annotate(n=Count("id")).order_by())
    print(
        f"{connection.vendor}: {sum(counts.values())} tasks "
        f"({', '.join(f'{counts.get(s, 0)} {s}' for s in TaskStatus)}), filled in {time.perf_counter() - started:.1f} s"
    )

    cutoff = now - timedelta(days=7)  # retention: three weeks of the month expired
    reap_before = now - timedelta(minutes=1)
    sweep_before = now - timedelta(seconds=30)
    held = in_declaration_order(HELD)
    # Where retention's chunks of expired tasks (for their events) are halfway through.
    expired = Task.objects.filter(status__in=in_declaration_order(TERMINAL), updated_at__lt=cutoff).order_by(
        "updated_at", "pk"
    )
    middle = expired.values_list("updated_at", "pk")[expired.count() // 2]
    cases: list[tuple[str, Callable[[Any], Any], Callable[[], Any], Callable[[], Any]]] = [
        (
            "task_accept: queued count",
            lambda q: q.count(),
            lambda: Task.objects.filter(status=S.QUEUED),
            lambda: Task.objects.filter(status_in([S.QUEUED])),
        ),
        (
            "recovery: first page",
            list,
            lambda: (
                Task.objects.filter(status__in=in_declaration_order(ACTIVE), id__gt="")
                .order_by("id")
                .values(*_FIELDS)[:500]
            ),
            lambda: Task.objects.filter(status_in(ACTIVE), id__gt="").order_by("id").values(*_FIELDS)[:500],
        ),
        (
            "reaper: first page",
            list,
            lambda: (
                Task.objects.filter(status__in=held, id__gt="", heartbeat_at__lt=reap_before)
                .order_by("id")
                .values(*_FIELDS)[:500]
            ),
            lambda: (
                Task.objects.filter(status_in(held), id__gt="", heartbeat_at__lt=reap_before)
                .order_by("id")
                .values(*_FIELDS)[:500]
            ),
        ),
        (
            "sweeper: candidates",
            list,
            lambda: (
                Task.objects.filter(
                    Q(status=S.QUEUED) | Q(status__in=ORPHANABLE, worker=""), updated_at__lte=sweep_before
                )
                .order_by("id")
                .values_list("id", flat=True)[:SWEEP_BATCH]
            ),
            lambda: (
                Task.objects.filter(
                    status_in([S.QUEUED, *ORPHANABLE]),
                    Q(status=S.QUEUED) | Q(worker=""),
                    updated_at__lte=sweep_before,
                )
                .order_by("id")
                .values_list("id", flat=True)[:SWEEP_BATCH]
            ),
        ),
        (
            "retention: first page",
            list,
            lambda: (
                Task.objects.filter(status__in=in_declaration_order(TERMINAL), updated_at__lt=cutoff)
                .order_by("updated_at", "pk")
                .values_list("pk", "response_id")[:500]
            ),
            lambda: (
                Task.objects.filter(status_in(TERMINAL), updated_at__lt=cutoff)
                .order_by("updated_at", "pk")
                .values_list("pk", "response_id")[:500]
            ),
        ),
        (
            "retention: events' chunk",
            list,
            lambda: (
                Task.objects.filter(status__in=in_declaration_order(TERMINAL), updated_at__lt=cutoff)
                .filter(Q(updated_at__gt=middle[0]) | Q(updated_at=middle[0], pk__gt=middle[1]))
                .order_by("updated_at", "pk")
                .values_list("updated_at", "pk")[:500]
            ),
            lambda: (
                Task.objects.filter(status_in(TERMINAL), updated_at__lt=cutoff)
                .filter(updated_at__gte=middle[0])
                .filter(Q(updated_at__gt=middle[0]) | Q(updated_at=middle[0], pk__gt=middle[1]))
                .order_by("updated_at", "pk")
                .values_list("updated_at", "pk")[:500]
            ),
        ),
        (
            "metrics: active GROUP BY",
            lambda q: sorted(q),
            lambda: (
                Task.objects.filter(status__in=in_declaration_order(ACTIVE))
                .values("status")
                .annotate(n=Count("id"))
                .order_by()
                .values_list("status", "n")
            ),
            lambda: (
                Task.objects.filter(status_in(ACTIVE))
                .values("status")
                .annotate(n=Count("id"))
                .order_by()
                .values_list("status", "n")
            ),
        ),
    ]

    def plan(run: Callable[[Any], Any], query: Any) -> str:
        statements: list[tuple[str, Any]] = []

        def capture(execute: Any, sql: str, params: Any, many: bool, context: Any) -> Any:
            statements.append((sql, params))
            return execute(sql, params, many, context)

        # The statement as run (a count is not the queryset's own SELECT), with its parameters.
        with connection.execute_wrapper(capture):
            run(query)
        ((sql, params),) = statements
        with connection.cursor() as cursor:
            if connection.vendor == "sqlite":
                cursor.execute("EXPLAIN QUERY PLAN " + sql, params)
                return "; ".join(row[-1] for row in cursor.fetchall())
            cursor.execute("EXPLAIN " + sql, params)
            rows = [re.sub(r"^->\s*|\s*\(cost=.*", "", row[0].strip()) for row in cursor.fetchall()]
            return "; ".join(row for row in rows if "Scan" in row or "Sort" in row)

    def timed(run: Callable[[Any], Any], build: Callable[[], Any]) -> tuple[float, float, Any]:
        result = run(build())  # warm the page cache and the statement
        times = []
        for _ in range(args.repeat):
            query = build()
            begin = time.perf_counter()
            run(query)
            times.append((time.perf_counter() - begin) * 1000)
        return statistics.median(times), min(times), result

    print(f"median / min of {args.repeat} runs, ms")
    for label, run, before, after in cases:
        slow_median, slow_min, slow_rows = timed(run, before)
        fast_median, fast_min, fast_rows = timed(run, after)
        same = "same rows" if slow_rows == fast_rows else "!!!!! DIFFERENT ROWS"
        before_ms = f"{slow_median:8.2f} / {slow_min:8.2f}"
        print(f"{label:26} before {before_ms}   after {fast_median:7.2f} / {fast_min:7.2f}   {same}")
        print(f"{'':26} before: {plan(run, before())}")
        print(f"{'':26} after:  {plan(run, after())}")
    connection.close()
    if not args.keep:
        shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    main()
