"""Webhooks: what the outbox adds to a task's end, and how fast the deliverer gets an end to a receiver.

On a fresh database (a new SQLite file, or ``--database-url``: an empty one):

1. the terminal move (``lifecycle.task_succeed``) of ``--tasks`` running
   tasks, timed per call, for tasks that notify no endpoint and for tasks
   whose client has one subscribed endpoint (one SELECT and one INSERT more
   in the same transaction, and a wake-up published after it): first with
   no deliverer running, then while the deliverer (in this process: it
   shares the GIL, and on SQLite the write lock) sends each end's delivery;
2. those ends delivered (``--gap`` apart, so that the time is the
   deliverer's and not a queue behind a burst): a local receiver (``http.server``, 127.0.0.1)
   answers 200 to each signed POST and notes when it came; the deliverer
   (``webhook_deliveries_run``, as ``manage.py lmsp_webhooks`` runs it, polling
   every ``--poll`` s) runs in a thread of this process. Printed: the time from
   each end's commit to its arrival (p50, p99, max) and deliveries per second.

    .venv/bin/python bench/webhooks.py
    .venv/bin/python bench/webhooks.py --database-url postgres://postgres@127.0.0.1:5432/benchhooks
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from scratch import django_in_scratch

from tests.support.specs import spec_json


def percentile(values: list[float], share: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(share * len(ordered)))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", type=int, default=500)
    parser.add_argument("--poll", type=float, default=1.0, help="LMSP_WEBHOOK_POLL_SECONDS (default as shipped)")
    parser.add_argument(
        "--gap", type=float, default=0.02, help="seconds between two ends while delivering (0: one burst)"
    )
    parser.add_argument("--database-url", default=None, help="default: a new SQLite file in a temp dir")
    args = parser.parse_args()

    django_in_scratch(
        "hooks",
        database_url=args.database_url,
        env={"LMSP_WEBHOOK_ALLOW_PRIVATE_TARGETS": "true", "LMSP_WEBHOOK_POLL_SECONDS": str(args.poll)},
    )
    from django.db import connection

    from tasks_app.core import lifecycle
    from tasks_app.models import WebhookDelivery
    from tasks_app.services.clients import client_create
    from tasks_app.services.webhook_delivery import webhook_deliveries_run
    from tasks_app.services.webhooks import EVENT_TYPES, webhook_endpoint_create

    arrived: dict[str, float] = {}

    class Receiver(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            self.rfile.read(int(self.headers["content-length"]))
            arrived.setdefault(self.headers["webhook-id"], time.time())
            self.send_response(200)
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Receiver)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}/hook"

    quiet, _ = client_create(name="quiet", scopes="responses,read")
    subscribed, _ = client_create(name="subscribed", scopes="responses,read")
    webhook_endpoint_create(client=subscribed, name="bench", url=url, event_types=list(EVENT_TYPES))

    def running(client) -> list[str]:
        ids = []
        for _ in range(args.tasks):
            task = lifecycle.task_insert(
                client=client,
                request={"model": "demo", "input": "x"},
                generation=spec_json({"model": "demo", "input": "x"}),
                model="demo",
                notify_webhooks=True,
            )
            lifecycle.task_claim(task_id=task.id, worker="bench/1")
            lifecycle.task_start(task_id=task.id, worker="bench/1", item_id="msg_1")
            ids.append(task.id)
        return ids

    def end_all(ids: list[str], gap: float = 0.0) -> tuple[list[float], dict[str, float]]:
        times, ended = [], {}
        for task_id in ids:
            time.sleep(gap)
            started = time.perf_counter()
            lifecycle.task_succeed(
                task_id=task_id, worker="bench/1", item_id="msg_1", text="hi", usage=None, output_tokens=1
            )
            times.append((time.perf_counter() - started) * 1000)
            ended[task_id] = time.time()
        return times, ended

    quiet_times, _ = end_all(running(quiet))
    # The outbox alone: its rows (and the wake-up after the commit), no deliverer to contend with.
    idle_times, _ = end_all(running(subscribed))
    WebhookDelivery.objects.all().delete()
    subscribed_ids = running(subscribed)
    stop = threading.Event()
    deliverer = threading.Thread(target=webhook_deliveries_run, kwargs={"stop": stop}, daemon=True)
    deliverer.start()
    time.sleep(args.poll * 1.5)  # the deliverer idles on an empty outbox first, as it does between ends
    hook_times, ended = end_all(subscribed_ids, args.gap)
    last_end = time.time()
    deadline = time.monotonic() + 120
    while len(arrived) < args.tasks and time.monotonic() < deadline:
        time.sleep(0.01)
    stop.set()
    deliverer.join(timeout=10)
    task_of = dict(WebhookDelivery.objects.values_list("id", "task_id"))
    latency = [(at - ended[task_of[hook_id]]) * 1000 for hook_id, at in arrived.items()]

    print(
        f"{connection.vendor}: {args.tasks} tasks per case, deliverer polling every {args.poll} s, "
        f"ends {args.gap * 1000:.0f} ms apart while delivering"
    )
    print(f"{'task_succeed':<40}{'p50 ms':>10}{'p99 ms':>10}")
    cases = (
        ("no endpoint (no outbox query)", quiet_times),
        ("one endpoint, no deliverer running", idle_times),
        ("one endpoint, the deliverer sending", hook_times),
    )
    for label, times in cases:
        print(f"{label:<40}{statistics.median(times):>10.2f}{percentile(times, 0.99):>10.2f}")
    print(
        f"delivered {len(arrived)}/{args.tasks}; commit -> receiver: p50 {statistics.median(latency):.0f} ms, "
        f"p99 {percentile(latency, 0.99):.0f} ms, max {max(latency):.0f} ms; "
        f"{len(arrived) / max(max(arrived.values()) - min(ended.values()), 1e-9):.0f} deliveries/s "
        f"(ends took {last_end - min(ended.values()):.2f} s)"
    )
    server.shutdown()


if __name__ == "__main__":
    main()
