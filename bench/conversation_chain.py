"""What continuing a conversation costs at depth 1, 10 and 100 (issue 26, PROFILE.md 10.2).

Builds one chain of responses through the real services: each turn is
accepted by ``POST /lmsp/v1/responses`` (``background: true``, with
``previous_response_id`` from turn 2 on) through the whole Django stack,
then finished by the lifecycle verbs a worker calls (claim, start,
succeed with a 40-word answer), so the next turn continues a completed
response. At the depths asked for, it measures the accept of the next turn:
the SQL statements it runs, the statements that read the chain (those on
the response table before the insert), its time (median of repeated
accepts continuing the same response), and the size of the context stored
in the new request. The chain is resolved by one query at any depth: the
context is copied at accept time (docs/decisions/0004).

    .venv/bin/python bench/conversation_chain.py [--depths 1,10,100] [--repeat 20] [--database-url URL]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from scratch import demo_model_register, django_in_scratch

ANSWER = " ".join(f"word{n}" for n in range(40))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--depths", default="1,10,100")
    parser.add_argument("--repeat", type=int, default=20, help="accepts measured at each depth")
    parser.add_argument("--database-url", default=None)
    args = parser.parse_args()
    depths = sorted({int(d) for d in args.depths.split(",")})

    scratch = django_in_scratch("chain", database_url=args.database_url, env={"LMSP_MAX_QUEUED_TASKS": "1000000"})
    from django.db import connection
    from django.test import Client as HttpClient
    from django.test.utils import CaptureQueriesContext

    from tasks_app.core import lifecycle
    from tasks_app.core.wire import usage_object
    from tasks_app.models import Response, Task
    from tasks_app.services.clients import client_create

    demo_model_register(scratch)
    _, token = client_create(name=f"bench-{time.time_ns()}", scopes="responses,read")
    http = HttpClient(HTTP_AUTHORIZATION=f"Bearer {token}")

    def accept(previous: str | None, turn: int) -> dict:
        body = {"model": "demo", "input": f"Turn {turn}: tell me more.", "background": True, "max_output_tokens": 64}
        if previous is not None:
            body["previous_response_id"] = previous
        reply = http.post("/lmsp/v1/responses", body, content_type="application/json")
        assert reply.status_code == 200, reply.content
        return reply.json()

    def finish(response_id: str) -> None:
        task_id = Task.objects.values_list("id", flat=True).get(response_id=response_id)
        worker = "bench-worker"
        assert lifecycle.task_claim(task_id=task_id, worker=worker).won
        assert lifecycle.task_start(task_id=task_id, worker=worker, item_id=f"msg_{task_id}").won
        usage = usage_object(10, 40)
        done = lifecycle.task_succeed(
            task_id=task_id, worker=worker, item_id=f"msg_{task_id}", text=ANSWER, usage=usage, output_tokens=40
        )
        assert done.won

    for n in range(20):  # warm imports, connections and statement caches
        accept(None, -1 - n)

    previous: str | None = None
    depth = 0
    rows = []
    while depth < max(depths):
        created = accept(previous, depth + 1)
        finish(created["id"])
        previous, depth = created["id"], depth + 1
        if depth not in depths:
            continue
        times, statements, chain_reads = [], 0, 0
        for n in range(args.repeat):
            with CaptureQueriesContext(connection) as queries:
                started = time.perf_counter()
                probe = accept(previous, depth + 1)
                times.append((time.perf_counter() - started) * 1000)
            statements = len(queries.captured_queries)
            table = connection.ops.quote_name(Response._meta.db_table)
            chain_reads = sum(
                1
                for q in queries.captured_queries
                if q["sql"].lstrip().upper().startswith("SELECT") and f"FROM {table}" in q["sql"]
            )
            if n == 0:
                generation = Response.objects.values_list("generation", flat=True).get(pk=probe["id"])
                items = generation["context_turns"]
                stored = len(json.dumps(generation["turns"][:items]))
        rows.append((depth, items, stored, statements, chain_reads, statistics.median(times)))

    print(f"database: {connection.vendor}; {args.repeat} accepts continuing the response at each depth")
    print("| depth | context turns | context bytes | statements per accept | response-table reads | median accept |")
    print("|---:|---:|---:|---:|---:|---:|")
    for depth, items, stored, statements, chain_reads, median in rows:
        print(f"| {depth} | {items} | {stored:,} | {statements} | {chain_reads} | {median:.2f} ms |")


if __name__ == "__main__":
    main()
