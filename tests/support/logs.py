"""A task's event log: as stored, as streamed, and checks on its events."""

from __future__ import annotations

from typing import Any

from tasks_app.models import TaskEvent
from tests.support.sse import SseEvent


def events_path(task_id: str) -> str:
    return f"/lmsp/v1/tasks/{task_id}/events"


def stored(task_id: str) -> list[tuple[int, str, str]]:
    rows = TaskEvent.objects.filter(task_id=task_id).order_by("sequence_number")
    return [(row.sequence_number, row.type, row.payload) for row in rows]


def as_rows(events: list[SseEvent]) -> list[tuple[int | None, str | None, str]]:
    return [(event.id, event.event, event.data) for event in events]


def delta_text(events: list[dict[str, Any]]) -> str:
    return "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")


def assert_well_formed_log(events: list[dict[str, Any]]) -> None:
    """Contiguous from 0, response.created first, exactly one terminal event and it is last."""
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert events[0]["type"] == "response.created"
    terminal = [
        e
        for e in events
        if e["type"] in {"response.completed", "response.incomplete", "response.failed", "response.cancelled"}
    ]
    assert len(terminal) == 1
    assert terminal[0] is events[-1]
