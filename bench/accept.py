"""What accepting a task costs: ``POST /lmsp/v1/tasks`` through the whole Django stack, in process.

Each request goes through the middleware, authentication, validation, the
idempotency record (with ``--keyed``), the queue-limit count, the insert of
task, response and event 0 in one transaction, and the dispatch to Redis
after the commit (nobody consumes the queue). Prints the median and p90 per
request. Needs Redis on REDIS_URL. Uses only HTTP and two long-lived
services, so it runs on older commits too, for a before/after comparison.

    .venv/bin/python bench/accept.py [--requests 2000] [--keyed] [--database-url URL]
"""

from __future__ import annotations

import argparse
import statistics
import time

from scratch import demo_model_register, django_in_scratch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--keyed", action="store_true", help="send an Idempotency-Key with each request")
    parser.add_argument("--database-url", default=None)
    args = parser.parse_args()

    scratch = django_in_scratch("accept", database_url=args.database_url, env={"LMSP_MAX_QUEUED_TASKS": "1000000"})
    from django.test import Client as HttpClient

    from tasks_app.services.clients import client_create

    demo_model_register(scratch)
    _, token = client_create(name=f"bench-{time.time_ns()}", scopes="responses,read")
    http = HttpClient(HTTP_AUTHORIZATION=f"Bearer {token}")
    body = {"type": "response", "input": {"model": "demo", "input": "Hello", "max_output_tokens": 16}}

    def post(n: int) -> None:
        headers = {"HTTP_IDEMPOTENCY_KEY": f"key-{n}"} if args.keyed else {}
        reply = http.post("/lmsp/v1/tasks", body, content_type="application/json", **headers)
        assert reply.status_code == 202, reply.content

    for n in range(50):  # warm imports, connections and statement caches
        post(-1 - n)
    times = []
    for n in range(args.requests):
        started = time.perf_counter()
        post(n)
        times.append((time.perf_counter() - started) * 1000)
    times.sort()
    p90 = times[int(len(times) * 0.9)]
    kind = "keyed" if args.keyed else "unkeyed"
    print(f"{args.requests} {kind} accepts: median {statistics.median(times):.3f} ms, p90 {p90:.3f} ms")


if __name__ == "__main__":
    main()
