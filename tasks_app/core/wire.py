"""Wire shapes of the response and task objects.

Both the API and the event log need them (``response.created`` carries the
response object), so they live here rather than in an API serializer.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING, Any

from tasks_app.core.response_echo import response_echo, spec_request
from tasks_app.generation.sampling_in_force import sampling_in_force
from tasks_app.states import Protocol, ResponseStatus, TaskStatus

if TYPE_CHECKING:
    # Only types: the shapes are built from rows the caller read.
    from tasks_app.models import Response, Task


_FINISHED = frozenset(
    {ResponseStatus.COMPLETED, ResponseStatus.INCOMPLETE, ResponseStatus.FAILED, ResponseStatus.CANCELLED}
)


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
    Every member OpenAI's and the Open Responses schema require is there with
    the value in force (PROFILE.md 10.1; tests/test_response_schema.py).
    """
    # Another protocol's request is not in LMSP's shape: its spec is what the object echoes.
    request = response.request if response.protocol == Protocol.LMSP else spec_request(response.generation)
    output = live.output if live is not None and live.output is not None else response.output
    in_force = sampling_in_force(response.model, request)
    finished = response.status in _FINISHED
    return {
        "id": response.id,
        "object": "response",
        "created_at": unix_seconds(response.created_at),
        # A finished row is written for the last time as it finishes: its update time is its end.
        "completed_at": unix_seconds(response.updated_at) if finished else None,
        "status": response.status,
        "model": response.model,
        "output": output,
        "usage": usage_shown(response.usage),
        "error": error_shown(response.error),
        "incomplete_details": response.incomplete_details,
        "instructions": request.get("instructions"),
        "max_output_tokens": request.get("max_output_tokens"),
        "temperature": in_force["temperature"],
        "top_p": in_force["top_p"],
        # Extensions (PROFILE.md section 9): the sampling knobs transformers' generation configs set.
        "top_k": request.get("top_k"),
        "min_p": request.get("min_p"),
        "repetition_penalty": request.get("repetition_penalty"),
        **response_echo(request),
        "presence_penalty": in_force["presence_penalty"],
        "frequency_penalty": in_force["frequency_penalty"],
        "metadata": response.metadata,
        # Extension (PROFILE.md section 9): OpenAI's background mode.
        "background": bool(request.get("background", False)),
        # Extension: the place in the line; only a read knows it, so an event's copy says null.
        "queue_position": live.queue_position if live is not None else None,
        # Extension: the request's stop string that ended the output, if one did (``stop`` says only
        # that one of them may; Anthropic's ``stop_sequence`` names it).
        "stop_sequence": response.stop_sequence,
    }


def usage_object(input_tokens: int, output_tokens: int, *, cached_tokens: int = 0) -> dict[str, Any]:
    """The response's ``usage``: tokens in, out, and both, with the details OpenAI's ``ResponseUsage`` requires.

    ``cached_tokens``: input tokens the worker's prefix cache held (their
    model calls skipped). Nothing is reasoned apart, and the cache writes
    cost nothing extra, so those details say 0 (the SDKs' types reject a
    usage without them).
    """
    return {
        "input_tokens": input_tokens,
        "input_tokens_details": {"cached_tokens": cached_tokens, "cache_write_tokens": 0},
        "output_tokens": output_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": input_tokens + output_tokens,
    }


def error_shown(error: dict[str, Any] | None) -> dict[str, Any] | None:
    """A stored problem as a task or response shows it: with ``message``, which OpenAI's ``ResponseError`` requires.

    The problem's own members stay as PROFILE.md section 2 has them; its
    ``code`` is LMSP's, which OpenAI's closed list of codes does not hold
    (the SDKs read it as a string).
    """
    if error is None or "message" in error:
        return error
    return {**error, "message": f"{error.get('code')}: {error.get('detail')}"}


def usage_shown(usage: dict[str, Any] | None) -> dict[str, Any]:
    """A stored ``usage`` as the wire shows it: rows stored before the details existed gain them.

    A response not yet finished has used nothing that is counted yet: zeros,
    as OpenAI's schema wants an object where Open Responses allows null.
    """
    if usage is None:
        return usage_object(0, 0)
    if "input_tokens_details" in usage:
        return usage
    return usage_object(usage["input_tokens"], usage["output_tokens"])


def output_text_part(text: str) -> dict[str, Any]:
    # OpenAI's schema requires `logprobs`; none are returned here (`top_logprobs` above 0 is refused): empty.
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def message_item(item_id: str, text: str | None, status: str) -> dict[str, Any]:
    """An output message item; ``text`` None gives the empty item of ``output_item.added``."""
    content = [] if text is None else [output_text_part(text)]
    return {"id": item_id, "type": "message", "status": status, "role": "assistant", "content": content}


def function_call_item(item_id: str, call_id: str, name: str, arguments: str, status: str) -> dict[str, Any]:
    """A function call output item (PROFILE.md 10.4); ``arguments`` is the JSON text the model wrote."""
    return {
        "id": item_id,
        "type": "function_call",
        "status": status,
        "call_id": call_id,
        "name": name,
        "arguments": arguments,
    }


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
        "error": error_shown(task.error) if task.status == TaskStatus.FAILED else None,
        "queue_position": queue_position if task.status == TaskStatus.QUEUED else None,
    }
