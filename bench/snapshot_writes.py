"""What the resumable snapshot costs a generation: bytes written and wall time.

Runs real tasks in this process (``workers.execution.task_execute``, the
demo model, ONNX Runtime on the CPU) against a fresh SQLite file, and counts
every statement that touches ``task_snapshots`` with the size of its
parameters. Needs Redis on REDIS_URL (the worker clears its dispatch marker
and watches for cancels there).

    .venv/bin/python bench/snapshot_writes.py --tokens 1000 4000 8000

Prints one line per generation length: wall time, tokens per second, the
snapshot statements and the bytes they carried. Works on any commit that has
``task_execute(task_id=, worker=)``, so two versions can be compared.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

from scratch import demo_model_register, django_in_scratch

from tests.support.specs import spec_json


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[1000, 4000, 8000])
    args = parser.parse_args()

    scratch = django_in_scratch("snapshot")
    from django.db import connection
    from django.db.backends.signals import connection_created

    from tasks_app.core import lifecycle
    from tasks_app.models import Task
    from tasks_app.services.clients import client_create
    from workers.execution import task_execute

    demo_model_register(scratch)
    client, _ = client_create(name="bench", scopes="responses,read")

    counts = {"statements": 0, "bytes": 0, "on": 0}

    def count(execute: Any, sql: str, params: Any, many: bool, context: Any) -> Any:
        if counts["on"] and "task_snapshots" in sql and not sql.lstrip().upper().startswith("SELECT"):
            counts["statements"] += 1
            counts["bytes"] += sum(len(str(p)) for p in (params or ()))
        return execute(sql, params, many, context)

    # Every connection of the process, not only this thread's: a worker's progress commits run on its
    # run loop's thread (workers/run_loop.py), with a connection of its own.
    def watch(sender: Any, connection: Any, **kwargs: Any) -> None:
        connection.execute_wrappers.append(count)

    connection_created.connect(watch)
    connection.execute_wrappers.append(count)

    # Warm the model cache so the first row does not pay the load.
    warm = lifecycle.task_insert(
        client=client,
        request={"model": "demo", "input": "warm", "max_output_tokens": 4},
        generation=spec_json({"model": "demo", "input": "warm", "max_output_tokens": 4}),
        model="demo",
    )
    task_execute(task_id=warm.id, worker="bench/0")

    print(f"{'tokens':>7} {'wall s':>7} {'tok/s':>7} {'snapshot writes':>16} {'snapshot bytes':>15}")
    for tokens in args.tokens:
        request = {"model": "demo", "input": "Tell me a story", "max_output_tokens": tokens, "seed": 7}
        task = lifecycle.task_insert(client=client, request=request, generation=spec_json(request), model="demo")
        counts.update(statements=0, bytes=0, on=1)
        started = time.perf_counter()
        task_execute(task_id=task.id, worker="bench/1")
        wall = time.perf_counter() - started
        counts["on"] = 0
        produced = Task.objects.select_related("response").get(pk=task.id).response.usage["output_tokens"]
        print(f"{produced:>7} {wall:>7.2f} {produced / wall:>7.0f} {counts['statements']:>16} {counts['bytes']:>15,}")


if __name__ == "__main__":
    main()
