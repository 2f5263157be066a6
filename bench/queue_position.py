"""What ``queue_position`` costs a read: one count over the active index, against counting the table.

Fills a fresh database (a new SQLite file, or ``--database-url``: an empty
database) with ``--finished`` finished tasks (bulk-inserted, as
``partial_indexes.py`` does) and ``--queued`` queued ones, then times:

- ``selectors.task_queue_positions`` for the last queued task (the longest
  line ahead), for the first one, and for a page of 20 (one statement);
- the same count written plainly (``status=queued``, bound as a parameter),
  which SQLite cannot read through the partial index;
- ``GET /lmsp/v1/responses/{id}`` of the last queued background response,
  the whole request through Django's test client, and of a finished one.

    .venv/bin/python bench/queue_position.py
    .venv/bin/python bench/queue_position.py --database-url postgres://postgres@127.0.0.1:5432/benchqueue
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

from scratch import django_in_scratch


def timed(fn: Callable[[], Any], repeat: int) -> tuple[float, float, Any]:
    """Median and minimum milliseconds of ``repeat`` calls, and the last result."""
    times = []
    result = None
    for _ in range(repeat):
        started = time.perf_counter()
        result = fn()
        times.append((time.perf_counter() - started) * 1000)
    return statistics.median(times), min(times), result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--finished", type=int, default=200_000, help="finished tasks (the history kept)")
    parser.add_argument("--queued", type=int, default=2_000, help="queued tasks (the line)")
    parser.add_argument("--repeat", type=int, default=50)
    parser.add_argument("--database-url", default=None, help="default: a new SQLite file in a temp dir")
    args = parser.parse_args()

    django_in_scratch("queue", database_url=args.database_url, env={"LMSP_MAX_QUEUED_TASKS": str(args.queued + 10)})
    from django.db import connection, transaction
    from django.test import Client as HttpClient
    from django.utils import timezone

    from tasks_app.ids import new_response_id, new_task_id
    from tasks_app.models import ModelRecord, Response, Task
    from tasks_app.openai.responses.translate import generation_spec_of
    from tasks_app.selectors import tasks as selectors
    from tasks_app.services.clients import client_create
    from tasks_app.services.responses import response_start
    from tasks_app.states import ResponseStatus, TaskStatus

    client, token = client_create(name="bench", scopes="responses,read")
    ModelRecord.objects.create(name="demo", path="demo", backend="onnxruntime", size_bytes=0, digest="sha256:0")
    now = timezone.now()
    started = time.perf_counter()
    for offset in range(0, args.finished, 5_000):
        with transaction.atomic():
            responses, tasks = [], []
            for _ in range(min(5_000, args.finished - offset)):
                response = Response(
                    id=new_response_id(),
                    client=client,
                    model="demo",
                    status=ResponseStatus.COMPLETED,
                    request={"model": "demo", "input": "x"},
                    created_at=now,
                    updated_at=now,
                )
                responses.append(response)
                tasks.append(
                    Task(
                        id=new_task_id(),
                        client=client,
                        status=TaskStatus.SUCCEEDED,
                        response=response,
                        created_at=now,
                        updated_at=now,
                    )
                )
            Response.objects.bulk_create(responses)
            Task.objects.bulk_create(tasks)
    request = {"model": "demo", "input": "x", "background": True, "store": True}
    queued_responses = []
    for _ in range(args.queued):
        started_response = response_start(
            client=client,
            request=request,
            spec=generation_spec_of(request),
            idempotency_key=None,
            request_hash=None,
            background=True,
        )
        queued_responses.append(started_response.answer.body["id"])
    fill_seconds = time.perf_counter() - started
    queued = list(Task.objects.filter(status=TaskStatus.QUEUED).order_by("id").values_list("id", flat=True))
    print(
        f"{connection.vendor}: {args.finished:,} finished + {len(queued):,} queued tasks "
        f"(filled in {fill_seconds:.0f} s)"
    )

    rows = [
        ("position of the last in line", lambda: selectors.task_queue_positions(task_ids=[queued[-1]])),
        ("position of the first in line", lambda: selectors.task_queue_positions(task_ids=[queued[0]])),
        ("positions of a page of 20", lambda: selectors.task_queue_positions(task_ids=queued[-20:])),
        (
            "plain count (status bound as a parameter)",
            lambda: Task.objects.filter(status=TaskStatus.QUEUED, id__lt=queued[-1]).count() + 1,
        ),
    ]
    http = HttpClient()
    auth = {"Authorization": f"Bearer {token}"}
    finished_response = Task.objects.filter(status=TaskStatus.SUCCEEDED).values_list("response_id", flat=True)[0]
    rows.append(
        (
            "GET /responses/{id}, last in line",
            lambda: http.get(f"/lmsp/v1/responses/{queued_responses[-1]}", headers=auth).json()["queue_position"],
        )
    )
    rows.append(
        (
            "GET /responses/{id}, finished",
            lambda: http.get(f"/lmsp/v1/responses/{finished_response}", headers=auth).json()["status"],
        )
    )
    print(f"{'read':<45}{'median ms':>12}{'min ms':>10}  result")
    for label, fn in rows:
        median, low, result = timed(fn, args.repeat)
        shown = result if not isinstance(result, dict) else (max(result.values()) if result else None)
        print(f"{label:<45}{median:>12.3f}{low:>10.3f}  {shown}")


if __name__ == "__main__":
    main()
