"""The database crashes under load: what clients get while it is away, and how long the service takes to come back.

A PostgreSQL database of the bench's own (created, migrated, dropped at the
end) is reached by every process through a proxy that goes down as a crashed
server does (every connection closed at once, new ones refused;
``tests/support/outage_proxy.py``): the web (uvicorn), a worker (threads
pool), the maintenance node (beat) and the webhook deliverer. Client threads
each send ``POST /lmsp/v1/tasks`` every 50 ms; after ``--warmup`` s the
database goes away for ``--down`` s, then comes back, and the load goes on for
``--after`` s; then every accepted task must end.

Prints the answers per phase by status, the time from the database's return
to the first ``202``, each process's outage lines and tracebacks, and whether
every accepted task ended with contiguous events. Uses only HTTP and the
processes' logs, so it runs on older commits too (copy this file and the
proxy there).

    .venv/bin/python bench/database_outage.py [--down 5.3] [--clients 4] [--server postgres://postgres@127.0.0.1:5432]
"""

from __future__ import annotations

import argparse
import collections
import http.client
import json
import os
import re
import threading
import time
from contextlib import ExitStack

from scratch import REPO, demo_model_register, django_in_scratch

BODY = {"type": "response", "input": {"model": "demo", "input": "Hello", "max_output_tokens": 16}}


def post(port: int, token: str) -> int:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        conn.request(
            "POST",
            "/lmsp/v1/tasks",
            body=json.dumps(BODY),
            headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"},
        )
        response = conn.getresponse()
        answer = response.read()
        if response.status == 202:
            return 202
        return response.status if answer else -response.status
    except OSError:
        return 0
    finally:
        conn.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--server", default="postgres://postgres@127.0.0.1:5432")
    parser.add_argument("--down", type=float, default=5.3, help="seconds the database is away")
    parser.add_argument("--warmup", type=float, default=3.0)
    parser.add_argument("--after", type=float, default=5.0)
    parser.add_argument("--clients", type=int, default=4)
    args = parser.parse_args()

    import psycopg

    name = f"lmsp_bench_outage_{os.getpid()}"
    admin = psycopg.connect(args.server.replace("postgres://", "postgresql://", 1) + "/postgres", autocommit=True)
    admin.execute(f'CREATE DATABASE "{name}"')
    host, port = re.match(r".*@([^:/]+):(\d+)", args.server).groups()
    try:
        run(args, name, host, int(port))
    finally:
        from django.db import connections

        connections.close_all()
        admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        admin.close()


def run(args: argparse.Namespace, name: str, host: str, port: int) -> None:
    scratch = django_in_scratch("outage", database_url=f"{args.server}/{name}")
    import sys

    sys.path.insert(0, str(REPO))
    from tasks_app.models import Task, TaskEvent
    from tasks_app.services.clients import client_create
    from tests.support.outage_proxy import outage_proxy
    from tests.support.server import uvicorn_process
    from tests.support.webhooks import deliverer_process
    from tests.support.worker import celery_worker, maintenance_queue

    demo_model_register(scratch)
    _, token = client_create(name="bench", scopes="responses,read")
    prefix = os.environ["LMSP_REDIS_PREFIX"]
    queue = f"{prefix}-work"
    logs = {process: scratch / f"{process}.log" for process in ("web", "worker", "maintenance", "webhooks")}
    answers: list[tuple[float, int]] = []
    with ExitStack() as stack:
        proxy = stack.enter_context(outage_proxy((host, port)))
        url = f"{args.server.rsplit('@', 1)[0]}@127.0.0.1:{proxy.port}/{name}"
        env = {
            "DATABASE_URL": url,
            "LMSP_TASK_QUEUE": queue,
            "LMSP_LOG_LEVEL": "INFO",
            "LMSP_MAX_QUEUED_TASKS": "100000",
            "LMSP_SWEEP_INTERVAL_SECONDS": "1",
        }
        web = stack.enter_context(uvicorn_process(url, env, log_path=logs["web"]))
        stack.enter_context(celery_worker(env=env, queue=queue, log_path=logs["worker"], pool="threads", concurrency=4))
        maintenance = maintenance_queue(queue)
        stack.enter_context(
            celery_worker(
                env=env, queue=maintenance, log_path=logs["maintenance"], beat=True, maintenance=False, name="beat"
            )
        )
        stack.enter_context(deliverer_process(env, logs["webhooks"]))
        web_port = int(web.base.rsplit(":", 1)[1])
        stop = threading.Event()

        def client() -> None:
            while not stop.is_set():
                started = time.monotonic()
                answers.append((started, post(web_port, token)))
                stop.wait(max(0.0, 0.05 - (time.monotonic() - started)))

        threads = [threading.Thread(target=client) for _ in range(args.clients)]
        for thread in threads:
            thread.start()
        time.sleep(args.warmup)
        went = time.monotonic()
        proxy.down()
        time.sleep(args.down)
        came = time.monotonic()
        proxy.up()
        time.sleep(args.after)
        stop.set()
        for thread in threads:
            thread.join()

        accepted = Task.objects.count()
        deadline = time.monotonic() + 120
        while Task.objects.exclude(status__in=("succeeded", "failed", "cancelled")).exists():
            if time.monotonic() > deadline:
                break
            time.sleep(0.5)
        phases: dict[str, collections.Counter] = {p: collections.Counter() for p in ("before", "away", "after")}
        for at, status in answers:
            phases["before" if at < went else "away" if at < came else "after"][status] += 1
        first_after = min((at for at, status in answers if at >= came and status == 202), default=None)
        print(f"database away {args.down:.1f} s under {args.clients} clients (a POST every 50 ms each)")
        for phase, counts in phases.items():
            shown = ", ".join(f"{status}: {n}" for status, n in sorted(counts.items()))
            print(f"  {phase:>6}: {shown}")
        if first_after is not None:
            print(f"  first 202 after the return: {1000 * (first_after - came):.0f} ms")
        unfinished = Task.objects.exclude(status__in=("succeeded", "failed", "cancelled")).count()
        statuses = collections.Counter(Task.objects.values_list("status", flat=True))
        gaps = 0
        for task_id in Task.objects.values_list("id", flat=True):
            numbers = list(
                TaskEvent.objects.filter(task_id=task_id)
                .order_by("sequence_number")
                .values_list("sequence_number", flat=True)
            )
            gaps += numbers != list(range(numbers[0], numbers[0] + len(numbers)))
        print(f"  tasks accepted: {accepted} ({dict(statuses)}); unfinished: {unfinished}; with gaps: {gaps}")
        for process, log in logs.items():
            text = log.read_text(errors="replace")
            started = text.count("database unavailable: ")
            ended = re.findall(r"database available again: .* after ([0-9.]+) s", text)
            print(
                f"  {process:>11}: outage lines {started}, end lines {len(ended)} "
                f"(away for {', '.join(ended) or '-'} s), tracebacks {text.count('Traceback')}, "
                f"ERROR lines {text.count(' ERROR ')}"
            )
        print(f"  logs: {scratch}")


if __name__ == "__main__":
    main()
