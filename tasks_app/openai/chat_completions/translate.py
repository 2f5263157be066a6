"""Chat Completions (PROFILE.md 10.3): the one place that translates between its shapes and ours.

A chat completion is a response like any other: the request is translated
into a response request (``chat_request_to_response``) and runs as a task on
the same workers and engine; its answer is the response object translated
back (``chat_completion_object``), its stream the task's events translated
(``ChatChunks``), its errors the same problems. What a chat field asks for
that this service cannot do is refused here, by the chat field's own name.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from tasks_app.core.output_items import FUNCTION_CALL, has_function_calls
from tasks_app.core.wire import usage_shown
from tasks_app.events import EventType
from tasks_app.exceptions import (
    InvalidRequest,
    LmspError,
    ResponseCancelled,
    StoredProblem,
    UnsupportedParameter,
    with_sdk_error,
)
from tasks_app.openai import surface
from tasks_app.openai import text_format as text_formats
from tasks_app.openai import tools as offered_tools
from tasks_app.states import ResponseStatus

CHAT_ID_PREFIX = "chatcmpl-"
DONE = b"data: [DONE]\n\n"
# Response request fields a chat request carries over under the same name.
_SAME_NAMES = (
    "model",
    "temperature",
    "top_p",
    "seed",
    "stop",
    "frequency_penalty",
    "presence_penalty",
    "top_k",
    "min_p",
    "repetition_penalty",
    "user",
    "safety_identifier",
    "prompt_cache_key",
    "prompt_cache_retention",
    "prompt_cache_options",
    "metadata",
    "service_tier",
    "parallel_tool_calls",
)


@dataclass(frozen=True)
class ChatRequest:
    """A chat request translated: the response request to run, and what only the chat answer needs."""

    response_request: dict[str, Any]
    stream: bool
    include_usage: bool


def chat_request_to_response(data: Mapping[str, Any]) -> ChatRequest:
    """The response request a validated chat request asks for; refuses what it cannot honour by name."""
    _refuse_what_is_missing(data)
    request: dict[str, Any] = {key: data[key] for key in _SAME_NAMES if data.get(key) is not None}
    request["input"] = chat_messages_to_items(data["messages"])
    limits = {name: data[name] for name in ("max_completion_tokens", "max_tokens") if data.get(name) is not None}
    if len(set(limits.values())) > 1:
        raise InvalidRequest(
            "max_tokens and max_completion_tokens differ; send one",
            errors=[{"field": "max_tokens", "message": "differs from max_completion_tokens"}],
        )
    if limits:
        request["max_output_tokens"] = next(iter(limits.values()))
    if data.get("tools"):
        request["tools"] = [{"type": "function", **tool["function"]} for tool in data["tools"]]
    if data.get("tool_choice") is not None:
        request["tool_choice"] = _tool_choice(data["tool_choice"])
    offered_tools.tools_check(request, chat=True)
    text_format = text_formats.chat_response_format_as_text_format(data.get("response_format"))
    if text_format is not None:
        request["text"] = {"format": text_format}
        text_formats.format_check(request, param="response_format")
    # Not stored for previous_response_id: a chat completion is not a stored response (store: false).
    request["store"] = False
    stream = bool(data.get("stream"))
    request["stream"] = stream
    options = data.get("stream_options") or {}
    return ChatRequest(request, stream, bool(options.get("include_usage")))


def _tool_choice(choice: Any) -> Any:
    """A chat ``tool_choice`` in the Responses shape the task stores."""
    if isinstance(choice, str):
        return choice
    if choice.get("type") == "function":
        return {"type": "function", "name": choice["function"]["name"]}
    allowed = choice.get("allowed_tools")
    if (
        not isinstance(allowed, Mapping)
        or allowed.get("mode") not in (offered_tools.AUTO, offered_tools.REQUIRED)
        or not isinstance(allowed.get("tools"), list)
        or not all(isinstance(tool, Mapping) and isinstance(tool.get("function"), Mapping) for tool in allowed["tools"])
    ):
        raise InvalidRequest(
            "tool_choice allowed_tools must be {'type': 'allowed_tools', 'allowed_tools': {'mode': 'auto' or "
            "'required', 'tools': [{'type': 'function', 'function': {'name': ...}}, ...]}}",
            errors=[{"field": "tool_choice.allowed_tools", "message": "malformed"}],
        )
    names = [{"type": "function", "name": tool["function"].get("name")} for tool in allowed["tools"]]
    return {"type": "allowed_tools", "mode": allowed["mode"], "tools": names}


def _refuse_what_is_missing(data: Mapping[str, Any]) -> None:
    checks = (
        ("n", (data.get("n") or 1) != 1, "only one choice is generated per request (n=1)"),
        ("store", data.get("store") is True, "stored chat completions are not built"),
        ("logprobs", data.get("logprobs") is True, "log probabilities are not returned"),
        ("top_logprobs", bool(data.get("top_logprobs")), "log probabilities are not returned"),
        ("logit_bias", bool(data.get("logit_bias")), "logit biases are not applied"),
        ("modalities", any(m != "text" for m in data.get("modalities") or ()), "only text output"),
        ("verbosity", data.get("verbosity") not in (None, "medium"), "no verbosity control; use 'medium'"),
        (
            "service_tier",
            data.get("service_tier") not in (None, *surface.ACCEPTED_SERVICE_TIERS),
            "one queue serves every request; use 'auto' or 'default'",
        ),
    )
    for param, refused, why in checks:
        if refused:
            raise UnsupportedParameter(f"{param}: {why}", param=param)


def chat_messages_to_items(messages: Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Chat messages as response input items: assistant ``tool_calls`` become ``function_call`` items
    and ``tool`` messages ``function_call_output`` items."""
    items: list[dict[str, Any]] = []
    for index, message in enumerate(messages):
        role = message["role"]
        _check_keys(index, message)
        content = _text_of(index, message.get("content"))
        if role == "tool":
            items.append({"type": "function_call_output", "call_id": message["tool_call_id"], "output": content})
            continue
        if role != "assistant" or content or not message.get("tool_calls"):
            items.append({"type": "message", "role": role, "content": content or message.get("refusal") or ""})
        for call in message.get("tool_calls") or ():
            function = call["function"]
            items.append(
                {
                    "type": "function_call",
                    "call_id": call["id"],
                    "name": function["name"],
                    "arguments": function["arguments"],
                }
            )
    return items


def _text_of(index: int, content: str | list[Mapping[str, str]] | None) -> str:
    if not isinstance(content, list):
        return content or ""
    for number, part in enumerate(content):
        if "text" not in part:
            param = f"messages[{index}].content[{number}].type"
            raise UnsupportedParameter(f"{param}: {part['type']} parts are not supported (text only)", param=param)
    return "".join(part["text"] for part in content)


def _check_keys(index: int, message: Mapping[str, Any]) -> None:
    """Which keys each role may carry (the chat API's own rules)."""
    role = message["role"]
    allowed = {"role", "content", "name"}
    if role == "assistant":
        allowed |= {"tool_calls", "refusal"}
    if role == "tool":
        allowed = {"role", "content", "tool_call_id"}
        if "tool_call_id" not in message:
            raise InvalidRequest(
                "a tool message needs the tool_call_id of the call it answers",
                errors=[{"field": f"messages[{index}].tool_call_id", "message": "required for role 'tool'"}],
            )
    extra = sorted(set(message) - allowed)
    if extra:
        raise InvalidRequest(
            f"messages[{index}]: a {role} message has no field {extra[0]!r}",
            errors=[
                {"field": f"messages[{index}].{name}", "message": f"not a field of a {role} message"} for name in extra
            ],
        )
    if role != "assistant" and message.get("content") is None:
        raise InvalidRequest(
            f"messages[{index}]: a {role} message needs content",
            errors=[{"field": f"messages[{index}].content", "message": "required"}],
        )


def chat_id(response_id: str) -> str:
    """The chat completion's id: the response's own, so that ``GET /responses/resp_...`` finds it."""
    return CHAT_ID_PREFIX + response_id.removeprefix("resp_")


def _finish_reason(response: Mapping[str, Any]) -> str:
    if response["status"] == ResponseStatus.INCOMPLETE:
        return "length"
    return "tool_calls" if has_function_calls(response.get("output")) else "stop"


def chat_usage(usage: Mapping[str, Any] | None) -> dict[str, Any] | None:
    if usage is None:
        return None
    usage = usage_shown(dict(usage))
    return {
        "prompt_tokens": usage["input_tokens"],
        "completion_tokens": usage["output_tokens"],
        "total_tokens": usage["total_tokens"],
        "prompt_tokens_details": {"cached_tokens": usage["input_tokens_details"]["cached_tokens"]},
        "completion_tokens_details": {"reasoning_tokens": usage["output_tokens_details"]["reasoning_tokens"]},
    }


def chat_failure(response: Mapping[str, Any]) -> LmspError | None:
    """The problem a chat client gets for a response that did not finish with text, or None."""
    if response["status"] == ResponseStatus.FAILED:
        return StoredProblem(response["error"])
    if response["status"] == ResponseStatus.CANCELLED:
        return ResponseCancelled(f"the generation of {chat_id(response['id'])} was cancelled before it ended")
    return None


def chat_completion_object(response: Mapping[str, Any]) -> dict[str, Any]:
    """A finished response as a ``chat.completion`` (call only when ``chat_failure`` is None)."""
    text = "".join(
        part["text"]
        for item in response["output"]
        if item.get("type") == "message"
        for part in item.get("content", ())
        if part.get("type") == "output_text"
    )
    calls = [_chat_tool_call(item) for item in response["output"] if item.get("type") == FUNCTION_CALL]
    return {
        "id": chat_id(response["id"]),
        "object": "chat.completion",
        "created": response["created_at"],
        "model": response["model"],
        "choices": [
            {
                "index": 0,
                "message": {
                    "role": "assistant",
                    # OpenAI's: no text beside calls is null content.
                    "content": text if text or not calls else None,
                    "refusal": None,
                    "tool_calls": calls or None,
                },
                "logprobs": None,
                "finish_reason": _finish_reason(response),
            }
        ],
        "usage": chat_usage(response["usage"]),
        "service_tier": response.get("service_tier", "default"),
        "system_fingerprint": None,
    }


def _chat_tool_call(item: Mapping[str, Any]) -> dict[str, Any]:
    """A ``function_call`` output item as a chat message's tool call."""
    return {
        "id": item["call_id"],
        "type": "function",
        "function": {"name": item["name"], "arguments": item["arguments"]},
    }


def _data(body: Mapping[str, Any]) -> bytes:
    return b"data: " + json.dumps(body, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


class ChatChunks:
    """A task's event stream, frame by frame, as ``chat.completion.chunk`` lines.

    The first chunk carries the role; each text delta one content chunk; the
    end one chunk with ``finish_reason`` (then, with ``include_usage``, one
    with ``usage`` and no choices), or for a failure one ``error`` line; then
    ``[DONE]``. ``finished`` says whether the end was reached (a stream left
    before it is a client gone away).
    """

    def __init__(self, *, include_usage: bool) -> None:
        self.include_usage = include_usage
        self.finished = False
        self._head: dict[str, Any] = {}
        # A function call item's place among the chat message's tool calls.
        self._call_index: dict[str, int] = {}

    def feed(self, sse: bytes) -> bytes:
        """What to send for one chunk of the task's SSE body (frames, or a keepalive comment)."""
        out = []
        for frame in sse.split(b"\n\n"):
            if frame.startswith(b":"):
                out.append(frame + b"\n\n")
                continue
            for line in frame.split(b"\n"):
                if line.startswith(b"data: "):
                    out.append(self._event(json.loads(line[6:])))
        return b"".join(out)

    def _chunk(self, delta: Mapping[str, Any] | None, finish_reason: str | None = None, **extra: Any) -> bytes:
        choices = (
            [] if delta is None else [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}]
        )
        body = {**self._head, "choices": choices}
        if self.include_usage:
            body["usage"] = None
        body.update(extra)
        return _data(body)

    def _event(self, event: Mapping[str, Any]) -> bytes:
        kind = event["type"]
        if kind == EventType.CREATED:
            response = event["response"]
            self._head = {
                "id": chat_id(response["id"]),
                "object": "chat.completion.chunk",
                "created": response["created_at"],
                "model": response["model"],
                "system_fingerprint": None,
            }
            return self._chunk({"role": "assistant", "content": ""})
        if kind == EventType.OUTPUT_TEXT_DELTA:
            return self._chunk({"content": event["delta"]})
        if kind == EventType.OUTPUT_ITEM_ADDED and event["item"]["type"] == FUNCTION_CALL:
            item = event["item"]
            index = self._call_index.setdefault(item["id"], len(self._call_index))
            call = {"index": index, **_chat_tool_call(item)}
            return self._chunk({"tool_calls": [call]})
        if kind == EventType.FUNCTION_CALL_ARGUMENTS_DELTA and event["item_id"] in self._call_index:
            fragment = {"index": self._call_index[event["item_id"]], "function": {"arguments": event["delta"]}}
            return self._chunk({"tool_calls": [fragment]})
        if kind in (EventType.COMPLETED, EventType.INCOMPLETE, EventType.FAILED, EventType.CANCELLED):
            self.finished = True
            return self._end(event["response"])
        return b""

    def _end(self, response: Mapping[str, Any]) -> bytes:
        failure = chat_failure(response)
        if failure is not None:
            # Mid-stream, a failure is one error line (OpenAI's shape), then the end.
            return _data({"error": with_sdk_error(failure.to_problem())["error"]}) + DONE
        out = self._chunk({}, _finish_reason(response))
        if self.include_usage:
            out += self._chunk(None, usage=chat_usage(response["usage"]))
        return out + DONE


async def chat_chunk_stream(body: AsyncIterator[bytes], chunks: ChatChunks) -> AsyncIterator[bytes]:
    """A task's SSE body (``event_feeds.follow``) as a chat completion's stream."""
    async for data in body:
        out = chunks.feed(data)
        if out:
            yield out
    if not chunks.finished:
        # The log ended early (its events were deleted under it): the stream still ends as chat streams do.
        yield DONE
