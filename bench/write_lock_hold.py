"""How long each commit a worker makes holds the database's write lock (SQLite) or its row locks (PostgreSQL).

On SQLite one write lock covers the file: every other writer of the node
waits while a transaction is open, and a process frozen inside one stops
them all (docs/recovery.md). This times, for each lifecycle verb as a worker
calls it, the stretch from the lock being granted (``BEGIN IMMEDIATE``
returned; on PostgreSQL the first statement) to ``COMMIT`` returning, over
``--tasks`` tasks, and a recovery page of ``--page`` tasks.

    .venv/bin/python bench/write_lock_hold.py --tasks 300
    .venv/bin/python bench/write_lock_hold.py --tasks 300 --database-url postgres://postgres@127.0.0.1:5432/bench_lock
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import defaultdict
from contextlib import contextmanager

from scratch import django_in_scratch

from tests.support.specs import spec_json

_held: dict[str, list[float]] = defaultdict(list)


@contextmanager
def timed_transactions(label: str):
    """Record the lock-holding time of every transaction opened inside the block under ``label``."""
    from django.db import connections

    wrapper = type(connections["default"])
    # SQLite: the lock is granted when BEGIN IMMEDIATE returns; PostgreSQL: the transaction starts when
    # autocommit goes off (its first statement follows at once).
    name = "_start_transaction_under_autocommit" if connections["default"].vendor == "sqlite" else "_set_autocommit"
    begin, commit = getattr(wrapper, name), wrapper._commit
    state: dict[str, float] = {}

    def timed_begin(self, *args):
        begin(self, *args)
        if name != "_set_autocommit" or args == (False,):
            state["start"] = time.perf_counter()

    def timed_commit(self):
        before = time.perf_counter()
        commit(self)
        if "start" in state:
            _held[label].append(time.perf_counter() - state.pop("start"))
            _held["  of which COMMIT"].append(time.perf_counter() - before)

    setattr(wrapper, name, timed_begin)
    wrapper._commit = timed_commit
    try:
        yield
    finally:
        setattr(wrapper, name, begin)
        wrapper._commit = commit


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", type=int, default=300)
    parser.add_argument("--batches", type=int, default=10, help="batches of 16 deltas per task")
    parser.add_argument("--page", type=int, default=500, help="tasks in the recovery page")
    parser.add_argument("--database-url", default=None)
    args = parser.parse_args()

    django_in_scratch("lockhold", database_url=args.database_url)
    from django.db import connection
    from django.utils import timezone

    from tasks_app.core import lifecycle
    from tasks_app.services.clients import client_create
    from tasks_app.services.recovery import LiveWorkers, leftover_tasks_recover

    if connection.vendor == "postgresql":
        # Django opens PostgreSQL transactions with the first statement, not a BEGIN of its own.
        print("note: on PostgreSQL the stretch starts at the transaction's first statement")
    client, _ = client_create(name="bench", scopes="responses")
    worker, item = "bench/1", "msg_bench"
    prompt_ids = list(range(300))
    for n in range(args.tasks):
        task = lifecycle.task_insert(
            client=client,
            request={"model": "demo", "input": "x"},
            generation=spec_json({"model": "demo", "input": "x"}),
            model="demo",
        )
        with timed_transactions("task_claim"):
            lifecycle.task_claim(task_id=task.id, worker=worker)
        with timed_transactions("task_start"):
            lifecycle.task_start(
                task_id=task.id,
                worker=worker,
                item_id=item,
                snapshot={"token_ids": [], "state": {"item_id": item, "backend": {"prompt_ids": prompt_ids}}},
            )
        text = []
        for batch in range(args.batches):
            deltas = [f" tok{batch}-{k}" for k in range(16)]
            text += deltas
            snapshot = {"token_ids": list(range(16)), "state": {"item_id": item, "backend": {"rng": [batch] * 8}}}
            with timed_transactions("task_progress (16 deltas)"):
                lifecycle.task_progress(
                    task_id=task.id,
                    worker=worker,
                    item_id=item,
                    deltas=deltas,
                    output_tokens=16 * (batch + 1),
                    snapshot=snapshot,
                )
        with timed_transactions("task_heartbeat"):
            lifecycle.task_heartbeat(task_id=task.id, worker=worker)
        if n % 2:
            with timed_transactions("task_succeed"):
                lifecycle.task_succeed(
                    task_id=task.id,
                    worker=worker,
                    item_id=item,
                    text="".join(text),
                    usage=None,
                    output_tokens=16 * args.batches,
                )
    # A page of leftover running tasks (the ones left running above), as lmsp_recover moves them.
    with timed_transactions(f"recovery page (up to {args.page} tasks)"):
        leftover_tasks_recover(live=LiveWorkers(frozenset(), frozenset(), timezone.now()), batch_size=args.page)

    print(f"{connection.vendor}: lock held per transaction (ms)")
    print(f"{'verb':32} {'n':>6} {'p50':>8} {'p90':>8} {'p99':>8} {'max':>8}")
    for label, times in _held.items():
        ms = sorted(t * 1000 for t in times)
        p90, p99 = (ms[min(len(ms) - 1, int(q * len(ms)))] for q in (0.9, 0.99))
        print(f"{label:32} {len(ms):>6} {statistics.median(ms):>8.2f} {p90:>8.2f} {p99:>8.2f} {ms[-1]:>8.2f}")


if __name__ == "__main__":
    main()
