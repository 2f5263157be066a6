"""A JSON parser that is strict about what it accepts.

It reads at most the configured body limit (a chunked body has no
Content-Length for the middleware to check), refuses NaN/Infinity and
duplicate keys (two readers could pick different values), and wants an object
at the top level.
"""

from __future__ import annotations

import json
from typing import Any

from django.conf import settings
from rest_framework.exceptions import ParseError
from rest_framework.parsers import BaseParser

from tasks_app.exceptions import InvalidRequest, PayloadTooLarge


def _no_constants(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    result: dict[str, Any] = {}
    for key, value in pairs:
        if key in result:
            raise ValueError(f"duplicate key {key!r}")
        result[key] = value
    return result


class StrictJSONParser(BaseParser):
    media_type = "application/json"

    def parse(self, stream, media_type=None, parser_context=None):
        limit = settings.LMSP_MAX_REQUEST_BYTES
        raw = stream.read(limit + 1) if stream is not None else b""
        if len(raw) > limit:
            raise PayloadTooLarge.over(limit)
        try:
            text = raw.decode("utf-8")
            data = json.loads(text, parse_constant=_no_constants, object_pairs_hook=_unique_keys)
        except UnicodeDecodeError:
            raise ParseError("The request body is not UTF-8") from None
        except ValueError as error:
            raise ParseError(f"The request body is not valid JSON: {error}") from None
        except RecursionError:
            raise ParseError("The request body nests too deeply") from None
        if not isinstance(data, dict):
            raise ParseError("The request body must be a JSON object")
        check_strings(data)
        return data


def check_strings(data: Any) -> None:
    """Refuse strings no database can store the same way, naming where they are.

    U+0000 cannot go into a PostgreSQL JSON column (SQLite would take it, so
    the two would disagree) and a lone surrogate escape is not Unicode at
    all; JSON escapes can produce both.
    """
    stack: list[tuple[Any, str]] = [(data, "")]
    while stack:
        item, path = stack.pop()
        if isinstance(item, dict):
            for key, value in item.items():
                child = f"{path}.{key}" if path else str(key)
                _check_string(key, path or "body")
                stack.append((value, child))
        elif isinstance(item, list):
            stack.extend((value, f"{path}[{index}]") for index, value in enumerate(item))
        elif isinstance(item, str):
            _check_string(item, path or "body")


def _check_string(value: str, path: str) -> None:
    if "\x00" in value:
        message = "must not contain U+0000"
    else:
        try:
            value.encode("utf-8")
            return
        except UnicodeEncodeError:
            message = "contains an unpaired surrogate escape"
    raise InvalidRequest(f"{path}: {message}", errors=[{"field": path, "message": message}])
