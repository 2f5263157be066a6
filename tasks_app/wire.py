"""Wire shapes of the response and task objects.

Both the API and the event log need them (``response.created`` carries the
response object), so they live here rather than in an API serializer.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING, Any

from tasks_app.states import TaskStatus

if TYPE_CHECKING:
    # Only types: models imports the event vocabulary, which builds these shapes.
    from tasks_app.models import Response, Task


def unix_seconds(value: datetime) -> int:
    return int(value.timestamp())


@dataclass(frozen=True)
class Live:
    """What a read of a response adds to its stored row: its place in the line, and its output so far.

    Events never carry it (their ``queue_position`` is null): they record a
    moment, and a place in the line is only true when it is read.
    """

    queue_position: int | None = None
    """1 = next to start; None unless the task is queued."""
    output: list[dict[str, Any]] | None = None
    """The committed text of a response still running; None: the row's own output."""


def response_object(response: Response, live: Live | None = None) -> dict[str, Any]:
    """The response object of PROFILE.md section 3, keys in spec order, then the extensions.

    With ``live`` (an API read) it shows the output committed so far and
    ``queue_position``; without (an event's copy) the row as it is, and null.
    """
    request = response.request
    output = live.output if live is not None and live.output is not None else response.output
    return {
        "id": response.id,
        "object": "response",
        "created_at": unix_seconds(response.created_at),
        "status": response.status,
        "model": response.model,
        "output": output,
        "usage": response.usage,
        "error": response.error,
        "incomplete_details": response.incomplete_details,
        "instructions": request.get("instructions"),
        "max_output_tokens": request.get("max_output_tokens"),
        "temperature": request.get("temperature"),
        "top_p": request.get("top_p"),
        # Extensions (PROFILE.md section 9): the sampling knobs transformers' generation configs set.
        "top_k": request.get("top_k"),
        "min_p": request.get("min_p"),
        "repetition_penalty": request.get("repetition_penalty"),
        "metadata": response.metadata,
        # Extension (PROFILE.md section 9): OpenAI's background mode.
        "background": bool(request.get("background", False)),
        # Extension: the place in the line; only a read knows it, so an event's copy says null.
        "queue_position": live.queue_position if live is not None else None,
    }


def usage_object(input_tokens: int, output_tokens: int) -> dict[str, int]:
    """The response's ``usage``: tokens in, out, and both."""
    return {"input_tokens": input_tokens, "output_tokens": output_tokens, "total_tokens": input_tokens + output_tokens}


def output_text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": []}


def message_item(item_id: str, text: str | None, status: str) -> dict[str, Any]:
    """An output message item; ``text`` None gives the empty item of ``output_item.added``."""
    content = [] if text is None else [output_text_part(text)]
    return {"id": item_id, "type": "message", "status": status, "role": "assistant", "content": content}


def events_url(task_id: str) -> str:
    return f"/lmsp/v1/tasks/{task_id}/events"


def task_object(task: Task, queue_position: int | None = None) -> dict[str, Any]:
    """The task object of chapter 7.1, field for field, and ``queue_position`` (PROFILE.md section 9).

    ``task.response`` must be loaded (``select_related``) when the task
    succeeded, or this costs a query. ``queue_position`` is the caller's
    reading of the line (``selectors.task_queue_positions``), for a queued task.
    """
    return {
        "id": task.id,
        "object": "task",
        "type": task.type,
        "status": task.status,
        "created_at": unix_seconds(task.created_at),
        "updated_at": unix_seconds(task.updated_at),
        "response_id": task.response_id,
        "events_url": events_url(task.id),
        "on_restart": task.on_restart,
        "response": response_object(task.response, Live()) if task.status == TaskStatus.SUCCEEDED else None,
        "error": task.error if task.status == TaskStatus.FAILED else None,
        "queue_position": queue_position if task.status == TaskStatus.QUEUED else None,
    }
