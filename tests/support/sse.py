"""A small blocking SSE client over http.client, and JSON calls to a live server.

Tests read streams frame by frame through a real socket, the way a browser's
EventSource or the openai package does, so what they see is what a client sees.
"""

from __future__ import annotations

import http.client
import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

TERMINAL_TYPES = {"response.completed", "response.incomplete", "response.failed", "response.cancelled"}


@dataclass
class SseEvent:
    id: int | None
    event: str | None
    data: str

    @property
    def payload(self) -> dict[str, Any]:
        return json.loads(self.data)


@dataclass
class SseStream:
    """An open ``text/event-stream`` response; iterate for events, ``comments`` collects ``:`` lines."""

    status: int
    headers: dict[str, str]
    body: bytes
    _conn: http.client.HTTPConnection
    _response: http.client.HTTPResponse
    comments: list[str] = field(default_factory=list)
    ended: bool = False

    def __post_init__(self) -> None:
        self._id: int | None = None
        self._kind: str | None = None
        self._data: list[str] = []

    def _step(self) -> SseEvent | None:
        """Read one line; the event it completes, if any. Sets ``ended`` at the end of the body."""
        raw = self._response.readline()
        if not raw:
            self.ended = True
            return None
        line = raw.decode("utf-8").rstrip("\r\n")
        if line == "":
            event = SseEvent(self._id, self._kind, "\n".join(self._data)) if self._data else None
            self._id, self._kind, self._data = None, None, []
            return event
        if line.startswith(":"):
            self.comments.append(line[1:].strip())
            return None
        name, _, value = line.partition(":")
        value = value[1:] if value.startswith(" ") else value
        if name == "id":
            self._id = int(value)
        elif name == "event":
            self._kind = value
        elif name == "data":
            self._data.append(value)
        return None

    def __iter__(self) -> Iterator[SseEvent]:
        while not self.ended:
            event = self._step()
            if event is not None:
                yield event

    def read_comments(self, text: str, count: int) -> None:
        """Read until ``count`` comments ``text`` arrived; an event meanwhile is an error."""
        while self.comments.count(text) < count and not self.ended:
            event = self._step()
            assert event is None, f"expected only comments, got {event}"

    def take(self, count: int) -> list[SseEvent]:
        out: list[SseEvent] = []
        if count <= 0:
            return out
        for event in self:
            out.append(event)
            if len(out) == count:
                break
        return out

    def all(self) -> list[SseEvent]:
        return list(self)

    def close(self) -> None:
        self._conn.close()

    def __enter__(self) -> SseStream:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def open_stream(
    base: str,
    path: str,
    *,
    token: str | None = None,
    headers: dict[str, str] | None = None,
    method: str = "GET",
    body: Any = None,
    timeout: float = 60,
) -> SseStream:
    """Send the request; a non-stream answer is read whole into ``body``.

    ``timeout`` bounds every socket read, so a stream that stops sending
    fails the test instead of hanging it.
    """
    parts = urlsplit(base)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=timeout)
    sent = {"Accept": "text/event-stream", **(headers or {})}
    if token:
        sent["Authorization"] = f"Bearer {token}"
    payload = None
    if body is not None:
        payload = json.dumps(body).encode()
        sent["Content-Type"] = "application/json"
    conn.request(method, path, body=payload, headers=sent)
    response = conn.getresponse()
    received = {name.lower(): value for name, value in response.getheaders()}
    stream = SseStream(response.status, received, b"", conn, response)
    if not received.get("content-type", "").startswith("text/event-stream"):
        stream.body = response.read()
        conn.close()
        stream.ended = True
    return stream


def call(base: str, method: str, path: str, *, token: str | None = None, body: Any = None) -> tuple[int, Any]:
    """One JSON request to the live server: (status, parsed body or None)."""
    status, _, parsed = call_with_headers(base, method, path, token=token, body=body)
    return status, parsed


def call_with_headers(
    base: str, method: str, path: str, *, token: str | None = None, body: Any = None
) -> tuple[int, dict[str, str], Any]:
    """:func:`call`, with the answer's headers (names in lower case)."""
    parts = urlsplit(base)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=60)
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    payload = None
    if body is not None:
        payload = json.dumps(body).encode()
        headers["Content-Type"] = "application/json"
    try:
        conn.request(method, path, body=payload, headers=headers)
        response = conn.getresponse()
        raw = response.read()
        headers = {name.lower(): value for name, value in response.getheaders()}
        return response.status, headers, (json.loads(raw) if raw else None)
    finally:
        conn.close()
