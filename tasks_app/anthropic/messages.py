"""A response as Anthropic's Message, and a task's events as its stream (PROFILE.md 11.1): the way back.

The task's event log is the service's own (LMSP's events); a Messages client
reads it translated here, event by event: ``response.created`` is
``message_start``, an output item is a content block (text, or ``tool_use``
for a function call) with its deltas, the terminal event is
``message_delta`` (the stop reason and the usage) and ``message_stop``, or an
``error`` event. Each frame carries the task event's ``id:`` (on the last
frame made from it), so a stream that drops resumes from ``Last-Event-ID``
like any task stream (a retry with the request's ``Idempotency-Key``).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Mapping
from typing import Any

from tasks_app.anthropic.errors import anthropic_error
from tasks_app.core.output_items import FUNCTION_CALL, has_function_calls
from tasks_app.core.wire import usage_shown
from tasks_app.events import EventType
from tasks_app.exceptions import LmspError, ResponseCancelled, StoredProblem
from tasks_app.states import ResponseStatus

MESSAGE_ID_PREFIX = "msg_"
RESPONSE_ID_PREFIX = "resp_"
TERMINAL = (EventType.COMPLETED, EventType.INCOMPLETE, EventType.FAILED, EventType.CANCELLED)


def message_id(response_id: str) -> str:
    """The message's id: the response's own, so that ``GET /responses/resp_...`` and the task find it."""
    return MESSAGE_ID_PREFIX + response_id.removeprefix(RESPONSE_ID_PREFIX)


def stop_reason(response: Mapping[str, Any]) -> str | None:
    """Why the answer ended, in Anthropic's words; None while it runs."""
    if response["status"] == ResponseStatus.INCOMPLETE:
        return "max_tokens"
    if response["status"] != ResponseStatus.COMPLETED:
        return None
    if has_function_calls(response.get("output")):
        return "tool_use"
    return "stop_sequence" if response.get("stop_sequence") else "end_turn"


def message_usage(usage: Mapping[str, Any] | None, *, input_tokens: int | None = None) -> dict[str, Any]:
    """``usage`` as Anthropic counts it: the input the prefix cache held is read from the cache, not input.

    ``input_tokens``: the prompt's count before the run reported one (``message_start``).
    """
    shown = usage_shown(dict(usage) if usage is not None else None)
    cached = shown["input_tokens_details"]["cached_tokens"]
    total = shown["input_tokens"] if usage is not None or input_tokens is None else input_tokens
    return {
        "input_tokens": total - cached,
        "output_tokens": shown["output_tokens"],
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": cached,
        "service_tier": "standard",
    }


def _tool_input(arguments: str) -> Any:
    try:
        value = json.loads(arguments) if arguments else {}
    except ValueError:
        # Cut by the token limit: the call's input is what could be read, as Anthropic shows a cut call.
        return {}
    return value if isinstance(value, dict) else {}


def content_blocks(output: list[Mapping[str, Any]]) -> list[dict[str, Any]]:
    blocks: list[dict[str, Any]] = []
    for item in output:
        if item.get("type") == "message":
            parts = item.get("content", ())
            text = "".join(part.get("text", "") for part in parts if part.get("type") == "output_text")
            if text:
                blocks.append({"type": "text", "text": text})
        elif item.get("type") == FUNCTION_CALL:
            call = {"id": item["call_id"], "name": item["name"], "input": _tool_input(item["arguments"])}
            blocks.append({"type": "tool_use", **call})
    return blocks


def message_object(response: Mapping[str, Any]) -> dict[str, Any]:
    """A finished response (the LMSP object) as the Message (call only when ``message_failure`` is None)."""
    return {
        "id": message_id(response["id"]),
        "type": "message",
        "role": "assistant",
        "model": response["model"],
        "content": content_blocks(response["output"]),
        "stop_reason": stop_reason(response),
        "stop_sequence": response.get("stop_sequence"),
        "usage": message_usage(response.get("usage")),
    }


def message_failure(response: Mapping[str, Any]) -> LmspError | None:
    """The error a Messages client gets for a response that did not finish with an answer, or None."""
    if response["status"] == ResponseStatus.FAILED:
        return StoredProblem(response["error"] or {})
    if response["status"] == ResponseStatus.CANCELLED:
        return ResponseCancelled(f"the generation of {message_id(response['id'])} was cancelled before it ended")
    return None


def _frame(kind: str, body: Mapping[str, Any], event_id: str | None = None) -> bytes:
    head = f"id: {event_id}\n".encode() if event_id is not None else b""
    data = json.dumps({"type": kind, **body}, ensure_ascii=False, separators=(",", ":")).encode()
    return head + b"event: " + kind.encode() + b"\ndata: " + data + b"\n\n"


class MessageEvents:
    """A task's SSE body, frame by frame, as a Messages stream; ``finished`` once its end went out.

    ``input_tokens``: the prompt's count at accept, which ``message_start``
    reports (the run's own count, with what the cache held, comes with
    ``message_delta``).
    """

    def __init__(self, *, input_tokens: int | None = None) -> None:
        self.input_tokens = input_tokens
        self.finished = False

    def feed(self, sse: bytes) -> bytes:
        """What to send for one chunk of the task's SSE body (its frames, or a keepalive comment)."""
        out = []
        for frame in sse.split(b"\n\n"):
            if not frame:
                continue
            if frame.startswith(b":"):
                out.append(frame + b"\n\n")
                continue
            event_id, data = None, None
            for line in frame.split(b"\n"):
                if line.startswith(b"id: "):
                    event_id = line[4:].decode()
                elif line.startswith(b"data: "):
                    data = json.loads(line[6:])
            if data is not None:
                out.append(self._event(data, event_id))
        return b"".join(out)

    def _event(self, event: Mapping[str, Any], event_id: str | None) -> bytes:
        frames = self._frames(event)
        if not frames:
            return b""
        # The id goes on the last frame made from the event: a stream cut between two of them repeats the first.
        *head, (kind, body) = frames
        return b"".join(_frame(k, b) for k, b in head) + _frame(kind, body, event_id)

    def _frames(self, event: Mapping[str, Any]) -> list[tuple[str, dict[str, Any]]]:
        kind = event["type"]
        if kind == EventType.CREATED:
            return [("message_start", {"message": self._started(event["response"])})]
        if kind == EventType.IN_PROGRESS:
            return [("ping", {})]
        if kind == EventType.OUTPUT_ITEM_ADDED:
            item = event["item"]
            if item["type"] == FUNCTION_CALL:
                block = {"type": "tool_use", "id": item["call_id"], "name": item["name"], "input": {}}
            else:
                block = {"type": "text", "text": ""}
            return [("content_block_start", {"index": event["output_index"], "content_block": block})]
        if kind == EventType.OUTPUT_TEXT_DELTA:
            delta = {"type": "text_delta", "text": event["delta"]}
            return [("content_block_delta", {"index": event["output_index"], "delta": delta})]
        if kind == EventType.FUNCTION_CALL_ARGUMENTS_DELTA:
            delta = {"type": "input_json_delta", "partial_json": event["delta"]}
            return [("content_block_delta", {"index": event["output_index"], "delta": delta})]
        if kind == EventType.OUTPUT_ITEM_DONE:
            return [("content_block_stop", {"index": event["output_index"]})]
        if kind in TERMINAL:
            self.finished = True
            return self._end(event["response"])
        return []

    def _started(self, response: Mapping[str, Any]) -> dict[str, Any]:
        return {
            "id": message_id(response["id"]),
            "type": "message",
            "role": "assistant",
            "model": response["model"],
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": message_usage(None, input_tokens=self.input_tokens),
        }

    def _end(self, response: Mapping[str, Any]) -> list[tuple[str, dict[str, Any]]]:
        failure = message_failure(response)
        if failure is not None:
            _, body = anthropic_error(failure.to_problem())
            return [("error", {"error": body["error"]})]
        delta = {"stop_reason": stop_reason(response), "stop_sequence": response.get("stop_sequence")}
        return [
            ("message_delta", {"delta": delta, "usage": message_usage(response.get("usage"))}),
            ("message_stop", {}),
        ]


async def message_stream(body: AsyncIterator[bytes], events: MessageEvents) -> AsyncIterator[bytes]:
    """A task's SSE body (``event_feeds.follow``) as a Messages stream."""
    async for data in body:
        out = events.feed(data)
        if out:
            yield out
    if not events.finished:
        # The log ended early (its events were deleted under it): the stream ends with an error, as
        # Anthropic's does when it cannot finish.
        yield _frame("error", {"error": {"type": "api_error", "message": "the message's events are gone"}})
