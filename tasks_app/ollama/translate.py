"""Ollama's native API (PROFILE.md 11.2): the one place that translates between its shapes and ours.

A chat or generate request becomes one :class:`GenerationSpec` (the same
task, workers and engine as every other protocol); the task's events come
back as Ollama's NDJSON lines (:class:`OllamaLines`) and its response object
as Ollama's one answer (:func:`final_object`). What a field asks for that this
service cannot do is refused here, by the field's own name.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime
from typing import Any

from tasks_app.core.output_items import FUNCTION_CALL
from tasks_app.events import EventType
from tasks_app.exceptions import InvalidRequest, UnsupportedParameter
from tasks_app.generation.spec import (
    ANY_JSON_OBJECT,
    ASSISTANT,
    CHOICE_AUTO,
    CHOICE_NONE,
    JSON_SCHEMA,
    SYSTEM,
    TOOL,
    USER,
    Constraint,
    GenerationSpec,
    Sampling,
    Tool,
    ToolChoice,
    Turn,
)
from tasks_app.generation.structured_output import schema_problem
from tasks_app.generation.tool_calls import NAME_RE
from tasks_app.ollama.serializers import RANDOM_SEED
from tasks_app.states import ResponseStatus

CHAT = "chat"
GENERATE = "generate"
# Ollama's ``num_predict``: -1 generates until the end (or the context), -2 until the context is full.
_UNLIMITED = (-1, -2)
_OPTION_SAMPLING = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repeat_penalty": "repetition_penalty",
    "presence_penalty": "presence_penalty",
    "frequency_penalty": "frequency_penalty",
    "seed": "seed",
}


def _refuse(param: str, why: str) -> UnsupportedParameter:
    return UnsupportedParameter(f"{param}: {why}", param=param)


# --------------------------------------------------------------------------- requests


def chat_spec(data: Mapping[str, Any], *, context_length: int | None) -> GenerationSpec:
    """The spec a validated ``/api/chat`` request asks for; refuses what it cannot honour by name."""
    _common_check(data)
    tools = _tools(data.get("tools") or ())
    stops, max_tokens, sampling = _options(data.get("options") or {}, context_length)
    constraint = _format(data.get("format"), stops)
    return GenerationSpec(
        model=data["model"],
        turns=tuple(_turns(data.get("messages") or ())),
        sampling=sampling,
        stops=stops,
        max_output_tokens=max_tokens,
        tools=tools,
        tool_choice=ToolChoice(CHOICE_AUTO, tuple(t.name for t in tools)) if tools else ToolChoice(CHOICE_NONE),
        constraint=constraint,
    )


def generate_spec(data: Mapping[str, Any], *, context_length: int | None) -> GenerationSpec:
    """The spec a validated ``/api/generate`` request asks for: its prompt is one user turn."""
    _common_check(data)
    refusals = (
        ("raw", data.get("raw") is True, "a raw prompt bypasses the chat template; send a templated prompt"),
        ("template", bool(data.get("template")), "the model's own chat template is always used"),
        ("context", bool(data.get("context")), "no token context is kept; send the conversation to /api/chat"),
        ("suffix", bool(data.get("suffix")), "fill-in-the-middle is not supported"),
        ("images", bool(data.get("images")), "images are not supported (text models only)"),
        *((name, data.get(name) is not None, "image generation is not supported") for name in ("width", "height")),
        ("steps", data.get("steps") is not None, "image generation is not supported"),
    )
    for param, refused, why in refusals:
        if refused:
            raise _refuse(param, why)
    stops, max_tokens, sampling = _options(data.get("options") or {}, context_length)
    return GenerationSpec(
        model=data["model"],
        system=data.get("system") or None,
        turns=(Turn(USER, text=data.get("prompt") or ""),),
        sampling=sampling,
        stops=stops,
        max_output_tokens=max_tokens,
        tool_choice=ToolChoice(CHOICE_NONE),
        constraint=_format(data.get("format"), stops),
    )


def is_load_only(data: Mapping[str, Any], kind: str) -> bool:
    """A request with nothing to generate: Ollama's way to load (or, with ``keep_alive: 0``, unload) a model."""
    if kind == CHAT:
        return not data.get("messages")
    return not data.get("prompt") and not data.get("images")


def _common_check(data: Mapping[str, Any]) -> None:
    think = data.get("think")
    if think is not None and think is not False:
        # As Ollama's own server answers for a model without a thinking mode.
        raise _refuse("think", f"model {data['model']!r} does not support thinking")
    if data.get("logprobs") is True or data.get("top_logprobs"):
        param = "logprobs" if data.get("logprobs") is True else "top_logprobs"
        raise _refuse(param, "log probabilities are not returned")
    keep_alive = data.get("keep_alive")
    if keep_alive is not None and (isinstance(keep_alive, bool) or not isinstance(keep_alive, (str, int, float))):
        raise InvalidRequest(
            "keep_alive must be a duration (a string such as '5m', or seconds)",
            errors=[{"field": "keep_alive", "message": "a duration"}],
        )


def _options(options: Mapping[str, Any], context_length: int | None) -> tuple[tuple[str, ...], int | None, Sampling]:
    """``options`` as (stops, output limit, sampling); a runner option that asks for nothing is accepted."""
    num_ctx = options.get("num_ctx")
    if num_ctx is not None and context_length is not None and num_ctx > context_length:
        raise InvalidRequest(
            f"options.num_ctx: {num_ctx} is more than the model's context of {context_length} tokens",
            errors=[{"field": "options.num_ctx", "message": f"at most {context_length}"}],
        )
    checks = (
        ("mirostat", options.get("mirostat") not in (None, 0), "Mirostat sampling is not implemented; use 0"),
        ("typical_p", options.get("typical_p") not in (None, 1, 1.0), "typical sampling is not implemented; use 1"),
        ("tfs_z", options.get("tfs_z") not in (None, 1, 1.0), "tail-free sampling is not implemented; use 1"),
        ("penalize_newline", options.get("penalize_newline") is True, "newlines are not penalized apart"),
        ("logits_all", options.get("logits_all") is True, "logits are not returned"),
        ("embedding_only", options.get("embedding_only") is True, "embeddings are not served"),
        ("vocab_only", options.get("vocab_only") is True, "a model is always loaded whole"),
        (
            "repeat_last_n",
            options.get("repeat_last_n") not in (None, -1) and options.get("repeat_penalty") not in (None, 1, 1.0),
            "the repetition penalty reads the whole context; use -1",
        ),
    )
    for name, refused, why in checks:
        if refused:
            raise _refuse(f"options.{name}", why)
    limit = options.get("num_predict")
    if limit is not None and limit not in _UNLIMITED and limit < 1:
        raise InvalidRequest(
            "num_predict must be at least 1 (or -1: until the end)",
            errors=[{"field": "options.num_predict", "message": "at least 1, or -1"}],
        )
    given = {theirs: value for theirs, value in options.items() if not (theirs == "seed" and value == RANDOM_SEED)}
    sampling = Sampling(**{ours: given[theirs] for theirs, ours in _OPTION_SAMPLING.items() if theirs in given})
    stops = tuple(stop for stop in options.get("stop") or () if stop)
    return stops, None if limit in (None, *_UNLIMITED) else limit, sampling


def _format(given: Any, stops: Sequence[str]) -> Constraint | None:
    """``format``: ``"json"`` is any JSON object, an object a JSON Schema; both enforced by the grammar."""
    if given in (None, ""):
        return None
    if given == "json":
        constraint = Constraint(ANY_JSON_OBJECT)
        schema: Any = {"type": "object"}
    elif isinstance(given, Mapping):
        constraint = Constraint(JSON_SCHEMA, schema=dict(given), name="format")
        schema = given
    else:
        raise InvalidRequest(
            "format must be 'json' or a JSON Schema object",
            errors=[{"field": "format", "message": "'json' or a schema"}],
        )
    if stops:
        raise _refuse("options.stop", "a stop string would cut the JSON that format asks for; send no stop with format")
    problem = schema_problem(schema)
    if problem:
        raise InvalidRequest(
            f"the format's schema cannot be enforced: {problem}", errors=[{"field": "format", "message": problem}]
        )
    return constraint


def _tools(tools: Sequence[Mapping[str, Any]]) -> tuple[Tool, ...]:
    seen: set[str] = set()
    out = []
    for index, tool in enumerate(tools):
        kind = tool.get("type") or "function"
        if kind != "function":
            raise _refuse(f"tools[{index}].type", f"{kind!r} tools are not supported (functions only)")
        function = tool["function"]
        name = function["name"]
        field = f"tools[{index}].function.name"
        if not NAME_RE.match(name) or name in seen:
            why = "tool names must be unique" if name in seen else "letters, digits, _ and -, at most 64"
            raise InvalidRequest(f"tool name {name!r}: {why}", errors=[{"field": field, "message": why}])
        seen.add(name)
        parameters = function.get("parameters")
        problem = schema_problem(parameters) if parameters is not None else None
        if problem:
            raise InvalidRequest(
                f"the parameters of tool {name!r} cannot be enforced: {problem}",
                errors=[{"field": f"tools[{index}].function.parameters", "message": problem}],
            )
        out.append(Tool(name=name, description=function.get("description") or None, parameters=parameters))
    return tuple(out)


def _turns(messages: Sequence[Mapping[str, Any]]) -> list[Turn]:
    """Ollama's messages as turns. Its calls have no ids: each call gets one from its place, and a ``tool``
    message answers the first open call of its ``tool_name`` (or the first open call), as templates pair them."""
    turns: list[Turn] = []
    open_calls: list[tuple[str, str]] = []
    for index, message in enumerate(messages):
        role = message["role"]
        if message.get("images"):
            raise _refuse(f"messages[{index}].images", "images are not supported (text models only)")
        content = message.get("content") or ""
        calls = message.get("tool_calls") or ()
        if role != ASSISTANT and calls:
            raise InvalidRequest(
                f"messages[{index}]: only an assistant message carries tool_calls",
                errors=[{"field": f"messages[{index}].tool_calls", "message": "assistant messages only"}],
            )
        if role == TOOL:
            name = message.get("tool_name") or None
            match = next((call for call in open_calls if name is None or call[1] == name), None)
            if match is not None:
                open_calls.remove(match)
            call_id = message.get("tool_call_id") or (match[0] if match else f"call_{index}")
            turns.append(Turn(TOOL, text=content, call_id=call_id))
            continue
        if content or not calls:
            turns.append(Turn(SYSTEM if role == SYSTEM else role, text=content))
        open_calls = []
        for number, call in enumerate(calls):
            function = call["function"]
            arguments = function.get("arguments")
            if not isinstance(arguments, (str, Mapping, type(None))):
                field = f"messages[{index}].tool_calls[{number}].function.arguments"
                raise InvalidRequest(
                    f"{field}: a call's arguments are an object (or its JSON text)",
                    errors=[{"field": field, "message": "an object"}],
                )
            call_id = call.get("id") or f"call_{index}_{number}"
            text = arguments if isinstance(arguments, str) else json.dumps(arguments or {}, ensure_ascii=False)
            turns.append(Turn(ASSISTANT, call_id=call_id, name=function["name"], arguments=text))
            open_calls.append((call_id, function["name"]))
    return turns


# --------------------------------------------------------------------------- answers


def now_iso() -> str:
    """Ollama's ``created_at``: RFC 3339 with nanoseconds' place, in UTC."""
    return datetime.now(UTC).isoformat().replace("+00:00", "Z")


def _tool_call(item: Mapping[str, Any]) -> dict[str, Any]:
    """A ``function_call`` output item as Ollama's tool call: its arguments an object, not JSON text."""
    try:
        arguments = json.loads(item.get("arguments") or "{}")
    except ValueError:
        # Cut by the token limit: the text as it is, under a key that says so, never a lost call.
        arguments = {"_unparsed": item.get("arguments")}
    return {"function": {"name": item["name"], "arguments": arguments}}


def _chunk(kind: str, model: str, text: str, calls: Sequence[Mapping[str, Any]] = ()) -> dict[str, Any]:
    body: dict[str, Any] = {"model": model, "created_at": now_iso()}
    if kind == CHAT:
        message: dict[str, Any] = {"role": "assistant", "content": text}
        if calls:
            message["tool_calls"] = list(calls)
        body["message"] = message
    else:
        body["response"] = text
    body["done"] = False
    return body


def done_reason(response: Mapping[str, Any]) -> str:
    return "length" if response["status"] == ResponseStatus.INCOMPLETE else "stop"


def failure_text(response: Mapping[str, Any]) -> str | None:
    """What an Ollama client reads for a response that did not end with an answer, or None."""
    if response["status"] == ResponseStatus.FAILED:
        error = response.get("error") or {}
        return f"{error.get('code', 'internal_error')}: {error.get('detail') or error.get('message') or 'failed'}"
    if response["status"] == ResponseStatus.CANCELLED:
        return "response_cancelled: the generation was cancelled before it ended"
    return None


def final_object(
    kind: str, response: Mapping[str, Any], timings: Mapping[str, int], *, model: str, text: str | None = None
) -> dict[str, Any]:
    """The last line of a stream (``text`` None: only the end), or with the whole text the one answer."""
    calls = [_tool_call(item) for item in response["output"] if item.get("type") == FUNCTION_CALL]
    # A stream sent the text and the calls as they came: its last line carries only the end.
    body = _chunk(kind, model, "") if text is None else _chunk(kind, model, text, calls)
    usage = response.get("usage") or {}
    body.update(
        done=True,
        done_reason=done_reason(response),
        **timings,
        prompt_eval_count=usage.get("input_tokens", 0),
        eval_count=usage.get("output_tokens", 0),
    )
    return body


def output_text(response: Mapping[str, Any]) -> str:
    return "".join(
        part["text"]
        for item in response["output"]
        if item.get("type") == "message"
        for part in item.get("content", ())
        if part.get("type") == "output_text"
    )


def line(body: Mapping[str, Any]) -> bytes:
    return json.dumps(body, ensure_ascii=False, separators=(",", ":")).encode() + b"\n"


class OllamaLines:
    """A task's event stream, frame by frame, as Ollama's NDJSON lines.

    One line per text delta; a finished call in one line with its
    ``tool_calls`` (Ollama sends a call whole); the end is the ``done`` line
    (its timings from :meth:`end`), or for a failure one ``error`` line. SSE
    keepalive comments are dropped: an NDJSON client reads every line as JSON.
    """

    def __init__(self, kind: str, model: str) -> None:
        self.kind = kind
        self.model = model
        self.ended: Mapping[str, Any] | None = None

    def feed(self, sse: bytes) -> bytes:
        out = []
        for frame in sse.split(b"\n\n"):
            for raw in frame.split(b"\n"):
                if raw.startswith(b"data: "):
                    out.append(self._event(json.loads(raw[6:])))
        return b"".join(out)

    def _event(self, event: Mapping[str, Any]) -> bytes:
        kind = event["type"]
        if kind == EventType.CREATED:
            self.model = event["response"]["model"]
        elif kind == EventType.OUTPUT_TEXT_DELTA and event["delta"]:
            return line(_chunk(self.kind, self.model, event["delta"]))
        elif kind == EventType.OUTPUT_ITEM_DONE and event["item"]["type"] == FUNCTION_CALL and self.kind == CHAT:
            return line(_chunk(self.kind, self.model, "", [_tool_call(event["item"])]))
        elif kind in (EventType.COMPLETED, EventType.INCOMPLETE, EventType.FAILED, EventType.CANCELLED):
            self.ended = event["response"]
        return b""

    def end(self, timings: Mapping[str, int]) -> bytes:
        """The last line, once the terminal event came (``ended``)."""
        assert self.ended is not None
        failure = failure_text(self.ended)
        if failure is not None:
            return line({"error": failure})
        return line(final_object(self.kind, self.ended, timings, model=self.model))
