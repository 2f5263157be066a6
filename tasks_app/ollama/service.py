"""Ollama's generations as tasks: accepted through ``response_start`` (the same durable task, workers
and engine as every protocol), abandoned when a streaming client leaves, and timed from the task's log."""

from __future__ import annotations

from collections.abc import Mapping
from datetime import datetime
from typing import Any

from tasks_app.events import EventType
from tasks_app.generation.spec import GenerationSpec
from tasks_app.models import Client, Task, TaskEvent
from tasks_app.services.responses import ResponseStarted, response_start
from tasks_app.states import Protocol

# What marks the first output in a task's log: its first token was committed then.
_FIRST_OUTPUT = (EventType.OUTPUT_ITEM_ADDED, EventType.OUTPUT_TEXT_DELTA, EventType.FUNCTION_CALL_ARGUMENTS_DELTA)


def ollama_generation_start(
    *, client: Client, request: Mapping[str, Any], spec: GenerationSpec, stream: bool, endpoint: str
) -> ResponseStarted:
    """Accept a translated chat or generate request as a task, durable once this returns."""
    return response_start(
        client=client,
        request=request,
        spec=spec,
        idempotency_key=None,
        request_hash=None,
        stream=stream,
        protocol=Protocol.OLLAMA,
        endpoint=f"ollama.{endpoint}",
    )


def _ns(start: datetime | None, end: datetime | None) -> int:
    if start is None or end is None:
        return 0
    return max(0, round((end - start).total_seconds() * 1e9))


def ollama_timings(*, task_id: str) -> dict[str, int]:
    """Ollama's durations (ns) of an ended task, measured on its log's commit times.

    ``load_duration`` is from the accept to the run's start (the wait in line
    and the model's load, which a worker does not tell apart);
    ``prompt_eval_duration`` from the start to the first output committed;
    ``eval_duration`` from there to the end. The log's times are commit
    times (deltas are committed in batches), so they are as fine as those.
    """
    task = Task.objects.filter(pk=task_id).values("created_at").first()
    if task is None:
        return {"total_duration": 0, "load_duration": 0, "prompt_eval_duration": 0, "eval_duration": 0}
    events = TaskEvent.objects.filter(task_id=task_id)
    started = (
        events.filter(type=EventType.IN_PROGRESS)
        .order_by("-sequence_number")
        .values("sequence_number", "created_at")
        .first()
    )
    after = started["sequence_number"] if started else 0
    first = (
        events.filter(sequence_number__gt=after, type__in=_FIRST_OUTPUT)
        .order_by("sequence_number")
        .values_list("created_at", flat=True)
        .first()
    )
    last = events.order_by("-sequence_number").values_list("created_at", flat=True).first()
    start_at = started["created_at"] if started else None
    first = first or last
    return {
        "total_duration": _ns(task["created_at"], last),
        "load_duration": _ns(task["created_at"], start_at),
        "prompt_eval_duration": _ns(start_at, first),
        "eval_duration": _ns(first, last),
    }
