"""Where a task's first token waits (issue 28, point 4): each step from ``POST`` to the client's first delta.

The services of ``bench/concurrency.py`` (the Procfile's web line, a worker of the threads pool, a SQLite
file, Redis) on the demo model. Rounds of N tasks created at once through ``POST /lmsp/v1/tasks`` and
followed through ``GET .../events``, N = 1 (one after the other) and more; for every task the times of:

* **sent**: the client sends ``POST /tasks`` (the client's clock, as every time here: one machine);
* **created**: the task's commit (``tasks.created_at``: the web process's clock reading in that transaction);
* **claimed**: the worker's claim committed (its log line ``task ... claimed by``, written right after);
* **started**: ``response.in_progress`` committed (its event's ``created_at``);
* **first delta committed**: the first ``response.output_text.delta``'s ``created_at``;
* **received**: the client reads that delta.

It prints the median (and p90) of each step and of the whole, beside the plain prefill of the prompt
(the issue's goal: client TTFT <= prefill + 10 ms). Nothing is asserted.

    .venv/bin/python bench/first_token.py [--concurrency 1,8] [--repeats 10] [--model demo]
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import re
import shutil
import sqlite3
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from concurrency import (
    MODEL_SIZES,
    PROMPT,
    Service,
    Stream,
    endless_folder,
    endless_name,
    log,
    parse_args,
    prompt_ids,
    run_task_stream,
    warm_up,
)
from plain_loop import PlainLoop as _PlainLoop

STEPS = (
    ("sent", "created", "web: the request to the task's commit"),
    ("created", "claimed", "dispatch: the message, a worker thread, the claim's commit"),
    ("claimed", "started", "the run's set-up and the start's commit"),
    ("started", "first_commit", "the prefill, the first token and its commit"),
    ("first_commit", "received", "the commit to the client's read"),
    ("sent", "received", "client TTFT"),
)
CLAIMED = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) INFO workers\.execution: task (\S+) claimed by", re.M)


def db_times(path: Path, task_ids: list[str]) -> dict[str, dict[str, float]]:
    """created, started and first-commit times (UTC epoch seconds) of each task, from the SQLite file."""
    marks = ",".join("?" * len(task_ids))
    times: dict[str, dict[str, float]] = {task_id: {} for task_id in task_ids}
    with sqlite3.connect(f"file:{path}?mode=ro", uri=True) as db:
        for task_id, created in db.execute(f"SELECT id, created_at FROM tasks WHERE id IN ({marks})", task_ids):
            times[task_id]["created"] = _epoch(created)
        query = (
            f"SELECT task_id, type, MIN(created_at) FROM task_events WHERE task_id IN ({marks}) AND type IN"
            " ('response.in_progress', 'response.output_text.delta') GROUP BY task_id, type"
        )
        for task_id, kind, at in db.execute(query, task_ids):
            times[task_id]["started" if kind == "response.in_progress" else "first_commit"] = _epoch(at)
    return times


def _epoch(stamp: str) -> float:
    return dt.datetime.fromisoformat(stamp).replace(tzinfo=dt.UTC).timestamp()


def claim_times(worker_log: Path) -> dict[str, float]:
    """The claim log line's time per task (the worker logs in local time, to the millisecond)."""
    found = {}
    for match in CLAIMED.finditer(worker_log.read_text(errors="replace")):
        local = dt.datetime.strptime(match.group(1), "%Y-%m-%d %H:%M:%S,%f")
        found[match.group(2)] = local.timestamp()
    return found


def summary(values: list[float]) -> str:
    if not values:
        return "-"
    ordered = sorted(values)
    p90 = ordered[min(len(ordered) - 1, int(len(ordered) * 0.9))]
    return f"{statistics.median(ordered) * 1000:8.1f} ({p90 * 1000:7.1f})"


async def rounds(svc: Service, model: str, n: int, repeats: int) -> list[Stream]:
    streams: list[Stream] = []
    for _ in range(repeats):
        batch = [Stream("tasks") for _ in range(n)]
        await asyncio.gather(*(run_task_stream(svc, s, model, PROMPT, 4, 120) for s in batch))
        for stream in batch:
            stream.analyse()
        streams += batch
        await asyncio.sleep(0.3)
    return streams


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--concurrency", default="1,8", help="tasks created at once, comma-separated")
    parser.add_argument("--repeats", type=int, default=10, help="rounds per N")
    parser.add_argument("--model", default="demo", choices=sorted(MODEL_SIZES))
    parser.add_argument("--keep", action="store_true", help="keep the temp dir")
    ours = parser.parse_args()
    args = parse_args(["--models", ours.model, "--pool", "threads"])
    svc = Service(args)
    size = MODEL_SIZES[ours.model]
    try:
        svc.prepare_models([size])
        loop = _PlainLoop(endless_folder(svc.models_dir, size), threads=args.threads, device=args.device)
        prompt = prompt_ids(endless_folder(svc.models_dir, size), PROMPT)
        prefill = statistics.median(loop.prefill_seconds(prompt, 10))
        svc.start_web("web")
        model = endless_name(size)
        for n in (int(value) for value in ours.concurrency.split(",")):
            svc.use_worker("threads", n, n)
            asyncio.run(warm_up(svc, model))
            streams = asyncio.run(rounds(svc, model, n, ours.repeats))
            ids = [s.task_id for s in streams if s.task_id]
            times = db_times(Path(svc.env["DATABASE_URL"].removeprefix("sqlite:///")), ids)
            claims = claim_times(svc.tmp / f"worker{svc.worker_starts}.log")
            for stream in streams:
                row = times.get(stream.task_id, {})
                row.update(sent=stream.sent_at, received=stream.first_delta_at or float("nan"))
                if stream.task_id in claims:
                    row["claimed"] = claims[stream.task_id]
            print(f"\n{ours.model}, {n} task(s) at once, {len(ids)} tasks; plain prefill {prefill * 1000:.2f} ms")
            print(f"{'step':<58}{'ms, median (p90)':>20}")
            for start, end, label in STEPS:
                values = [r[end] - r[start] for r in times.values() if start in r and end in r and r[end] == r[end]]
                print(f"{label:<58}{summary(values):>20}")
    finally:
        svc.stop_all()
        svc.cleanup_redis()
        if not ours.keep:
            shutil.rmtree(svc.tmp, ignore_errors=True)
        else:
            log(f"kept {svc.tmp}")


if __name__ == "__main__":
    started = time.time()
    main()
    log(f"done in {time.time() - started:.0f} s")
