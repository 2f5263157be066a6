"""A batch's input file read and translated line by line (docs/batches.md): the adapter's half of validation.

Each line is ``{"custom_id", "method": "POST", "url", "body"}``. A line that
is not that (not JSON, no ``custom_id``, a ``custom_id`` twice, another
method, a URL that is not the batch's endpoint, a body that is not an
object) fails the whole file, as OpenAI's validation does: the batch is
``failed`` with ``errors`` naming the lines. A line of the right shape whose
request is refused (by its serializer, by a refusal by name, an unknown
model) is a failed line of the batch, answered in the error file with the
problem ``POST`` to its endpoint would have answered. The rest are
translated as their endpoint translates them: a Responses request through
its serializer and ``accepted_spec``; a chat completion into the response
request ``/chat/completions`` runs (a response with ``store: false``).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rest_framework import exceptions as drf

from tasks_app.edge.parsers import check_strings
from tasks_app.edge.problems import drf_error_as_lmsp
from tasks_app.edge.scoped_views import validated
from tasks_app.exceptions import InvalidRequest, LmspError
from tasks_app.openai.chat_completions.serializers import ChatCompletionRequestSerializer
from tasks_app.openai.chat_completions.translate import chat_request_to_response
from tasks_app.openai.responses.serializers import ResponseRequestSerializer
from tasks_app.openai.responses.translate import accepted_spec
from tasks_app.selectors.tasks import model_get_by_name
from tasks_app.services.batches import LineIn

RESPONSES = "responses"
CHAT = "chat"
# The endpoints a batch may name (OpenAI's spelling, and LMSP's), and what each runs.
ENDPOINTS: dict[str, str] = {
    "/v1/responses": RESPONSES,
    "/lmsp/v1/responses": RESPONSES,
    "/v1/chat/completions": CHAT,
    "/lmsp/v1/chat/completions": CHAT,
}
# A file's errors list the first of its bad lines, as OpenAI's do.
MAX_ERRORS = 100
# What a line's request may not ask for: a batch line runs on its own, once, by the batch's policy.
_REFUSED_IN_A_LINE = {
    "stream": "a batch line's result is written to the output file; it is not streamed",
    "background": "every batch line runs in the background",
    "on_restart": "a batch line is resumed (or started over) after a restart, never failed by one",
    "previous_response_id": "batch lines run independently of each other and of stored responses",
    "conversation": "batch lines run independently of each other and of conversations",
}


@dataclass
class FileRead:
    """An input file read: its lines, or (``errors``) why it fails validation."""

    lines: list[LineIn] = field(default_factory=list)
    errors: list[dict[str, Any]] = field(default_factory=list)


def batch_file_read(*, path: Path, endpoint: str, max_lines: int) -> FileRead:
    """Read and translate every line of the file at ``path`` for a batch of ``endpoint`` (one of ``ENDPOINTS``)."""
    read = FileRead()
    seen: set[str] = set()
    translate = _TRANSLATORS[ENDPOINTS[endpoint]]
    # A file names few models: each is looked up once.
    models: dict[str, LmspError | None] = {}
    number = 0
    with path.open("rb") as handle:
        for number, raw in enumerate(handle, start=1):
            if not raw.strip():
                continue
            if number > max_lines:
                read.errors.append(_error("too_many_lines", f"the file has more than {max_lines} lines", number))
                break
            line = _shape_checked(raw, number, endpoint, seen, read.errors)
            if line is None or read.errors:
                # Once the file fails, its other lines are only checked, not translated.
                continue
            read.lines.append(_translated(number, line, translate, models))
            if len(read.errors) >= MAX_ERRORS:
                break
    if not read.errors and not read.lines:
        read.errors.append(_error("empty_file", "the file has no lines", None))
    if read.errors:
        read.lines = []
    return read


def _error(code: str, message: str, line: int | None, param: str | None = None) -> dict[str, Any]:
    return {"code": code, "message": message, "param": param, "line": line}


def _shape_checked(
    raw: bytes, number: int, endpoint: str, seen: set[str], errors: list[dict[str, Any]]
) -> dict[str, Any] | None:
    try:
        value = json.loads(raw.decode("utf-8"), parse_constant=_no_constant)
    except (UnicodeDecodeError, ValueError, RecursionError):
        errors.append(_error("invalid_json_line", "the line is not a JSON object", number))
        return None
    if not isinstance(value, dict):
        errors.append(_error("invalid_json_line", "the line is not a JSON object", number))
        return None
    custom_id = value.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id or len(custom_id) > 512:
        errors.append(
            _error("invalid_custom_id", "custom_id must be a string of 1 to 512 characters", number, "custom_id")
        )
        return None
    if custom_id in seen:
        errors.append(
            _error("duplicate_custom_id", f"custom_id {custom_id!r} is on an earlier line", number, "custom_id")
        )
        return None
    seen.add(custom_id)
    if value.get("method") != "POST":
        errors.append(_error("invalid_method", "method must be POST", number, "method"))
        return None
    if value.get("url") not in ENDPOINTS or ENDPOINTS[value["url"]] != ENDPOINTS[endpoint]:
        errors.append(_error("mismatched_endpoint", f"url must be the batch's endpoint {endpoint}", number, "url"))
        return None
    if not isinstance(value.get("body"), dict):
        errors.append(_error("invalid_body", "body must be a JSON object", number, "body"))
        return None
    unknown = sorted(set(value) - {"custom_id", "method", "url", "body"})
    if unknown:
        errors.append(_error("invalid_line", f"unknown member {unknown[0]!r}", number, unknown[0]))
        return None
    return value


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def _translated(
    number: int, line: Mapping[str, Any], translate: Callable[[dict], dict], models: dict[str, LmspError | None]
) -> LineIn:
    body = line["body"]
    try:
        _check_body(body)
        request = translate(body)
        spec = accepted_spec(request)
        if spec.model not in models:
            try:
                model_get_by_name(spec.model)
                models[spec.model] = None
            except LmspError as error:
                models[spec.model] = error
        if (refusal := models[spec.model]) is not None:
            raise refusal
    except drf.APIException as error:
        return LineIn(number, line["custom_id"], body, error=drf_error_as_lmsp(error).to_problem())
    except LmspError as error:
        return LineIn(number, line["custom_id"], body, error=error.to_problem())
    return LineIn(number, line["custom_id"], request, generation=spec.to_json())


def _check_body(body: Mapping[str, Any]) -> None:
    # The strings every request body must hold (U+0000, lone surrogates), as the JSON parser checks them.
    check_strings(body)
    for name, why in _REFUSED_IN_A_LINE.items():
        if body.get(name) not in (None, False):
            raise InvalidRequest(f"{name}: {why}", errors=[{"field": name, "message": why}])


def _responses(body: dict[str, Any]) -> dict[str, Any]:
    return dict(validated(ResponseRequestSerializer, body))


def _chat(body: dict[str, Any]) -> dict[str, Any]:
    return chat_request_to_response(validated(ChatCompletionRequestSerializer, body)).response_request


_TRANSLATORS: dict[str, Callable[[dict[str, Any]], dict[str, Any]]] = {RESPONSES: _responses, CHAT: _chat}
