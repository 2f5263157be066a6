"""What one batch commit of a running task costs in the lifecycle: 16 deltas and a snapshot row.

Creates one running task in a fresh SQLite file (or ``--database-url``) and
commits ``--batches`` batches through the lifecycle, as the worker's decode
loop does between steps, then prints the median and p90 per commit. Works on
commits before the named verbs (``task_append_events``) and after
(``task_progress``), so the two can be compared from two worktrees.

    .venv/bin/python bench/batch_commit.py --batches 2000
"""

from __future__ import annotations

import argparse
import statistics
import time

from scratch import django_in_scratch

from tests.support.specs import spec_json


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, default=2000)
    parser.add_argument("--deltas", type=int, default=16)
    parser.add_argument("--database-url", default=None)
    args = parser.parse_args()

    django_in_scratch("batch", database_url=args.database_url)
    from tasks_app.core import lifecycle
    from tasks_app.services.clients import client_create

    client, _ = client_create(name="bench", scopes="responses")
    task = lifecycle.task_insert(
        client=client,
        request={"model": "demo", "input": "x"},
        generation=spec_json({"model": "demo", "input": "x"}),
        model="demo",
    )
    worker, item = "bench/1", "msg_bench"
    if hasattr(lifecycle, "task_progress"):
        lifecycle.task_claim(task_id=task.id, worker=worker)
        lifecycle.task_start(task_id=task.id, worker=worker, item_id=item)

        def commit(n: int) -> None:
            snapshot = {"token_ids": list(range(args.deltas)), "state": {"item_id": item, "n": n}}
            texts = [f"t{n}"] * args.deltas
            lifecycle.task_progress(
                task_id=task.id, worker=worker, item_id=item, deltas=texts, output_tokens=n, snapshot=snapshot
            )
    else:  # the generic commit the verbs replaced
        from django.utils import timezone

        lifecycle.task_transition(task_id=task.id, to="loading", task_changes={"worker": worker})
        lifecycle.task_transition(task_id=task.id, to="running", holder=worker)

        def commit(n: int) -> None:
            head = {"item_id": item, "output_index": 0, "content_index": 0}
            lifecycle.task_append_events(
                task_id=task.id,
                expected=["running"],
                events=[("response.output_text.delta", {**head, "delta": f"t{n}"})] * args.deltas,
                task_changes={"heartbeat_at": timezone.now(), "output_tokens": n},
                snapshot={"token_ids": list(range(args.deltas)), "state": {"item_id": item, "n": n}},
                holder=worker,
            )

    for n in range(50):  # warm the connection and statement caches
        commit(n)
    times = []
    for n in range(args.batches):
        started = time.perf_counter()
        commit(n)
        times.append((time.perf_counter() - started) * 1000)
    times.sort()
    p90 = times[int(len(times) * 0.9)]
    print(f"{args.batches} commits of {args.deltas} deltas: median {statistics.median(times):.3f} ms, p90 {p90:.3f} ms")


if __name__ == "__main__":
    main()
