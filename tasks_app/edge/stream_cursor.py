"""The resume cursor of an event stream (``Last-Event-ID`` / ``?starting_after=``), read from a request."""

from __future__ import annotations

import re

from django.http import HttpRequest

from tasks_app.exceptions import InvalidRequest

_CURSOR = re.compile(r"[0-9]{1,10}")
MAX_CURSOR = 2**31 - 1


def stream_cursor(request: HttpRequest) -> tuple[int | None, str]:
    """The resume cursor and where it came from; the header wins (a browser's reconnect sends it).

    Every cursor that is sent must be a sequence number, an empty one and
    the one the header outranks too: the schema says integer for both, and a
    value the server would not read is refused rather than ignored.
    """
    header = request.META.get("HTTP_LAST_EVENT_ID")
    sent = [
        (field, raw)
        for field, raw in (
            ("Last-Event-ID", header.strip() if header is not None else None),
            ("starting_after", request.GET.get("starting_after")),
        )
        if raw is not None
    ]
    cursors = [(_cursor_value(field, raw), field) for field, raw in sent]
    return cursors[0] if cursors else (None, "starting_after")


def _cursor_value(field: str, raw: str) -> int:
    if not _CURSOR.fullmatch(raw) or int(raw) > MAX_CURSOR:
        raise InvalidRequest(
            f"{field} must be the sequence_number of an event (a non-negative integer)",
            errors=[{"field": field, "message": "must be a non-negative integer"}],
        )
    return int(raw)
