"""The rows of a task's log and of its snapshots, as the lifecycle's moves write them, inside their transaction.

A part of the lifecycle: only its modules write these tables (``tests/test_architecture.py``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

from django.db import connection

from tasks_app import events, states
from tasks_app.events import Event
from tasks_app.models import Task, TaskEvent, TaskSnapshot


def events_insert(task: Task, specs: Sequence[events.Encoded], now: datetime) -> list[TaskEvent]:
    """Insert the events numbered up to the task's ``last_sequence``: one multi-row INSERT per 100 events.

    Written out rather than ``bulk_create``: the ORM's per-field preparation
    of every row cost most of a batch commit's time, all of it under the
    write lock (bench/write_lock_hold.py).
    """
    first = task.last_sequence - len(specs) + 1
    rows = [
        TaskEvent(
            task_id=task.id,
            sequence_number=first + offset,
            type=spec.type,
            payload=spec.payload(first + offset),
            created_at=now,
        )
        for offset, spec in enumerate(specs)
    ]
    stamp = connection.ops.adapt_datetimefield_value(now)
    with connection.cursor() as cursor:
        for start in range(0, len(rows), _EVENTS_PER_INSERT):
            chunk = rows[start : start + _EVENTS_PER_INSERT]
            values = ", ".join(["(%s, %s, %s, %s, %s)"] * len(chunk))
            params = [v for row in chunk for v in (row.task_id, row.sequence_number, row.type, row.payload, stamp)]
            cursor.execute(f"{_EVENT_INSERT} {values}", params)
    return rows


_EVENT_INSERT = f"INSERT INTO {TaskEvent._meta.db_table} (task_id, sequence_number, type, payload, created_at) VALUES"
# Rows per statement: 5 parameters a row stays far below SQLite's oldest limit of 999.
_EVENTS_PER_INSERT = 100


def snapshot_encoded(snapshot: Mapping[str, Any] | None) -> tuple[str, str] | None:
    """A snapshot row's two JSON columns, ``token_ids`` and ``state``, as ``TaskSnapshot`` stores them."""
    if snapshot is None:
        return None
    field = TaskSnapshot._meta.get_field("state")
    return field.get_prep_value(list(snapshot.get("token_ids", ()))), field.get_prep_value(dict(snapshot["state"]))


def snapshots_keep(task: Task, snapshot: tuple[str, str] | None, now: datetime, *, drop: bool = False) -> None:
    """Append the snapshot row a move wrote, or drop the task's rows when it finished (or ``drop``: starts over)."""
    if task.status in states.TERMINAL or drop:
        # A finished task is never resumed; a rerun starts from nothing.
        TaskSnapshot.objects.filter(task_id=task.id).delete()
    elif snapshot is not None:
        # One INSERT per batch: ``token_ids`` are the ids generated since the
        # previous row, ``state`` the small rest (see TaskSnapshot).
        token_ids, state = snapshot
        stamp = connection.ops.adapt_datetimefield_value(now)
        with connection.cursor() as cursor:
            cursor.execute(_SNAPSHOT_INSERT, (task.id, task.last_sequence, token_ids, state, stamp))


_SNAPSHOT_INSERT = (
    f"INSERT INTO {TaskSnapshot._meta.db_table} (task_id, sequence_number, token_ids, state, created_at) "
    "VALUES (%s, %s, %s, %s, %s)"
)


def event_row(task_id: str, sequence: int, event: Event, now: datetime) -> TaskEvent:
    """One event numbered ``sequence``, as a row to insert (recovery's terminal events, one ``bulk_create``)."""
    return TaskEvent(
        task_id=task_id,
        sequence_number=sequence,
        type=event.type,
        payload=events.encode(event.type, sequence, event.fields),
        created_at=now,
    )
