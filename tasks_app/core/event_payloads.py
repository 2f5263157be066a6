"""The payloads of a task's events, one builder per event, in the order a run writes them.

The vocabulary (event types, ``Event``, the encoder) is ``tasks_app.events``;
the builders are apart because they build wire shapes (``tasks_app.core.wire``)
from the models' rows: ``tasks_app.models`` imports the vocabulary for its
constraints, and so must not import what builds response objects.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from tasks_app.core.wire import function_call_item, message_item, output_text_part, response_object
from tasks_app.events import E, Event, EventType
from tasks_app.states import ResponseStatus

if TYPE_CHECKING:
    from tasks_app.models import Response


_TERMINAL_OF: Mapping[str, EventType] = {
    ResponseStatus.COMPLETED: E.COMPLETED,
    ResponseStatus.INCOMPLETE: E.INCOMPLETE,
    ResponseStatus.FAILED: E.FAILED,
    ResponseStatus.CANCELLED: E.CANCELLED,
}


def created(response: Response) -> Event:
    return Event(E.CREATED, {"response": response_object(response)})


def requeued(response: Response) -> Event:
    """A rerun: the response is queued again, its output empty."""
    return Event(E.QUEUED, {"response": response_object(response)})


def in_progress(response: Response) -> Event:
    return Event(E.IN_PROGRESS, {"response": response_object(response)})


def finished(response: Response) -> Event:
    """The terminal event that the response's (final) status implies."""
    return Event(_TERMINAL_OF[response.status], {"response": response_object(response)})


def _head(item_id: str, output_index: int) -> dict[str, Any]:
    # A message item has one text part: always content 0.
    return {"item_id": item_id, "output_index": output_index, "content_index": 0}


# Output items: a message (the only one, at output 0, without tools), and with tools (PROFILE.md 10.4)
# messages and function calls in the order the model wrote them, each at its own output index.


def message_opened(item_id: str, output_index: int) -> list[Event]:
    return [
        Event(E.OUTPUT_ITEM_ADDED, {"output_index": output_index, "item": message_item(item_id, None, "in_progress")}),
        Event(E.CONTENT_PART_ADDED, {**_head(item_id, output_index), "part": output_text_part("")}),
    ]


# OpenAI's text events require `logprobs` (the openai package's types give it no default); none are
# returned here (`top_logprobs` above 0 is refused), so it is empty, as OpenAI's is without them.
def message_delta(item_id: str, output_index: int, text: str) -> Event:
    return Event(E.OUTPUT_TEXT_DELTA, {**_head(item_id, output_index), "delta": text, "logprobs": []})


def message_closed(item_id: str, output_index: int, text: str, item_status: str) -> list[Event]:
    return [
        Event(E.OUTPUT_TEXT_DONE, {**_head(item_id, output_index), "text": text, "logprobs": []}),
        Event(E.CONTENT_PART_DONE, {**_head(item_id, output_index), "part": output_text_part(text)}),
        Event(E.OUTPUT_ITEM_DONE, {"output_index": output_index, "item": message_item(item_id, text, item_status)}),
    ]


def call_opened(item_id: str, output_index: int, call_id: str, name: str, namespace: str = "") -> Event:
    item = _in_namespace(function_call_item(item_id, call_id, name, "", "in_progress"), namespace)
    return Event(E.OUTPUT_ITEM_ADDED, {"output_index": output_index, "item": item})


def _in_namespace(item: dict[str, Any], namespace: str) -> dict[str, Any]:
    """A call of a ``namespace`` tool's function names its namespace, as OpenAI's item does (Codex CLI
    dispatches by the pair); a top-level function's call has no such member."""
    return {**item, "namespace": namespace} if namespace else item


def call_arguments_delta(item_id: str, output_index: int, delta: str) -> Event:
    return Event(E.FUNCTION_CALL_ARGUMENTS_DELTA, {"item_id": item_id, "output_index": output_index, "delta": delta})


def call_closed(
    item_id: str, output_index: int, call_id: str, name: str, arguments: str, item_status: str, namespace: str = ""
) -> list[Event]:
    done = {"item_id": item_id, "output_index": output_index, "name": name, "arguments": arguments}
    item = _in_namespace(function_call_item(item_id, call_id, name, arguments, item_status), namespace)
    return [
        Event(E.FUNCTION_CALL_ARGUMENTS_DONE, done),
        Event(E.OUTPUT_ITEM_DONE, {"output_index": output_index, "item": item}),
    ]
