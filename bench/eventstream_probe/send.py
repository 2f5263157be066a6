"""The probe's other process: writes through django-eventstream as an application would.

Usage (run.py calls it with the probe's environment set):
    python send.py send CHANNEL TYPE [COUNT [PAD]]
                                               send_event() COUNT times (PAD bytes of filler each)
    python send.py send-txn CHANNEL TYPE COUNT commit|rollback
                                               send_event() COUNT times inside one transaction
    python send.py trim CHANNEL UPTO_EID       age events <= UPTO_EID by 25 h, then run the library's trim
    python send.py bench                       time DjangoModelStorage.append_event
Prints one JSON object on stdout.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from datetime import timedelta
from typing import Any

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "probe_settings")

import django

django.setup()

from django.db import connection, transaction  # noqa: E402
from django.test.utils import CaptureQueriesContext  # noqa: E402
from django.utils import timezone  # noqa: E402
from django_eventstream import models as es_models  # noqa: E402
from django_eventstream import send_event  # noqa: E402
from django_eventstream.storage import DjangoModelStorage  # noqa: E402


def current_id(channel: str) -> int:
    return DjangoModelStorage().get_current_id(channel)


def cmd_send(channel: str, event_type: str, count: int, pad: int = 0) -> dict[str, Any]:
    before = current_id(channel)
    error = None
    sent = 0
    try:
        for n in range(count):
            # async_publish=False: no GRIP proxy is configured, and a blocking
            # publish leaves no background thread behind in this short process.
            data: dict[str, Any] = {"n": n, "type": event_type}
            if pad:
                data["pad"] = "x" * pad
            send_event(channel, event_type, data, async_publish=False)
            sent += 1
    except Exception as exc:  # the probe reports whatever the library raises
        error = f"{type(exc).__module__}.{type(exc).__name__}: {exc}"
    return {"sent": sent, "error": error, "eid_before": before, "eid_after": current_id(channel)}


class RolledBack(Exception):
    pass


def cmd_send_txn(channel: str, event_type: str, count: int, outcome: str) -> dict[str, Any]:
    # What using send_event from our worker would look like: the events are
    # appended inside the lifecycle transaction, which commits (or rolls back)
    # after the rest of its work.
    before = current_id(channel)
    try:
        with transaction.atomic():
            for n in range(count):
                send_event(channel, event_type, {"n": n, "type": event_type}, async_publish=False)
            time.sleep(1.0)  # the rest of the transaction (snapshot, status compare-and-set)
            if outcome == "rollback":
                raise RolledBack
    except RolledBack:
        pass
    stored = es_models.Event.objects.filter(channel=channel, type=event_type).count()
    return {"outcome": outcome, "eid_before": before, "eid_after": current_id(channel), "rows_stored": stored}


def cmd_trim(channel: str, upto: int) -> dict[str, Any]:
    # Simulates the passage of EVENT_TIMEOUT (24 h) for the oldest events, then
    # runs the library's own trim (the one append_event runs on every append).
    old = timezone.now() - timedelta(hours=25)
    aged = es_models.Event.objects.filter(channel=channel, eid__lte=upto).update(created=old)
    DjangoModelStorage().trim_event_log()
    left = list(es_models.Event.objects.filter(channel=channel).order_by("eid").values_list("eid", flat=True))
    return {"aged": aged, "eids_left": left, "counter": current_id(channel)}


def _median_ms(samples: list[float]) -> float:
    return round(1000 * statistics.median(samples), 3)


def cmd_bench() -> dict[str, Any]:
    storage = DjangoModelStorage()
    storage.append_event("bench", "warmup", {"n": -1})  # creates the counter and the eid-0 placeholder

    with CaptureQueriesContext(connection) as ctx:
        storage.append_event("bench", "probe", {"n": 0})
    statements = [q["sql"].split()[0].upper() for q in ctx.captured_queries]

    singles = []
    for n in range(200):
        t0 = time.perf_counter()
        storage.append_event("bench", "single", {"n": n})
        singles.append(time.perf_counter() - t0)

    # 16 events in one outer transaction: what our worker commits per delta batch.
    batches = []
    for b in range(50):
        t0 = time.perf_counter()
        with CaptureQueriesContext(connection) as batch_ctx, transaction.atomic():
            for n in range(16):
                storage.append_event("bench", "batch", {"b": b, "n": n})
        batches.append(time.perf_counter() - t0)

    # The same 16 rows as one multi-row INSERT, sequence numbers known in advance
    # (how a log written by the worker's own transaction can do it).
    bulk = []
    next_eid = 1
    for b in range(50):
        rows = [
            es_models.Event(channel="bench-bulk", type="batch", data=json.dumps({"b": b, "n": n}), eid=next_eid + n)
            for n in range(16)
        ]
        next_eid += 16
        t0 = time.perf_counter()
        with CaptureQueriesContext(connection) as bulk_ctx, transaction.atomic():
            es_models.Event.objects.bulk_create(rows)
        bulk.append(time.perf_counter() - t0)

    return {
        "queries_per_append": len(statements),
        "statements": statements,
        "append_event_autocommit_ms": _median_ms(singles),
        "append_event_x16_in_one_txn_ms": _median_ms(batches),
        "append_event_x16_in_one_txn_queries": len(batch_ctx.captured_queries),
        "bulk_insert_16_rows_one_txn_ms": _median_ms(bulk),
        "bulk_insert_16_rows_one_txn_queries": len(bulk_ctx.captured_queries),
        "database": connection.vendor,
    }


def main(argv: list[str]) -> None:
    command = argv[1]
    if command == "send":
        count = int(argv[4]) if len(argv) > 4 else 1
        result = cmd_send(argv[2], argv[3], count, int(argv[5]) if len(argv) > 5 else 0)
    elif command == "send-txn":
        result = cmd_send_txn(argv[2], argv[3], int(argv[4]), argv[5])
    elif command == "trim":
        result = cmd_trim(argv[2], int(argv[3]))
    elif command == "bench":
        result = cmd_bench()
    else:
        raise SystemExit(f"unknown command {command!r}")
    print(json.dumps(result))


if __name__ == "__main__":
    main(sys.argv)
