"""uvicorn's HTTP/1.1 protocol (h11) with the limits a server facing clients needs (docs/http.md).

uvicorn on its own accepts request heads of any size (httptools) or answers
an oversized one with a bare 400 (h11), and never times out a connection
that is opening, or sending its head or its body, slowly: a few hundred such
connections hold the process's sockets for good. This protocol, which
uvicorn loads with ``--http lmsp_project.http_server:LmspH11Protocol``, adds:

- a limit on the request head (request line and headers,
  ``LMSP_HTTP_MAX_HEADER_BYTES``), answered ``431 request_header_too_large``;
- a deadline for the head: ``LMSP_HTTP_HEAD_TIMEOUT_SECONDS`` from the
  connection's start, or on a kept-alive connection from the head's first
  byte; then the connection is closed;
- a deadline for the body: ``LMSP_HTTP_BODY_TIMEOUT_SECONDS`` from the end of
  its head; then the connection is closed;
- the keep-alive timeout (``LMSP_HTTP_KEEPALIVE_SECONDS``, uvicorn's own
  timer) and a connection limit (``LMSP_HTTP_MAX_CONNECTIONS``): a connection
  beyond it is answered ``503 service_unavailable`` at once and closed.

Only reading a request is timed: once its head and body are in, a response
(an event stream of hours) runs as long as it needs. The refusals are
RFC 9457 problems like every other error. Written against uvicorn 0.54 and
h11 0.16 (pinned in requirements.txt): it hooks ``connection_made``,
``data_received``, ``on_response_complete`` and ``connection_lost`` and
reads h11's ``their_state`` and ``trailing_data``.
"""

from __future__ import annotations

import asyncio
import http
import json
import logging
import re
from dataclasses import dataclass
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from tasks_app.exceptions import LmspError, RequestHeaderTooLarge, TooManyConnections

logger = logging.getLogger("lmsp.http")

# A head ends with an empty line; h11 takes a bare LF as a line end too.
_HEAD_END = re.compile(rb"\n\r?\n")
# After a refusal the connection reads (and drops) what the client still
# sends for this long before it closes: closing with unread data would send
# a reset, and the client could lose the answer before reading it.
LINGER_SECONDS = 2.0
PROBLEM_CONTENT_TYPE = b"application/problem+json"


@dataclass(frozen=True)
class HttpLimits:
    """The ``LMSP_HTTP_*`` settings (docs/http.md)."""

    max_header_bytes: int
    head_timeout: float
    body_timeout: float
    keepalive: float
    max_connections: int

    @classmethod
    def from_settings(cls) -> HttpLimits:
        from django.conf import settings  # the app (and so Django) is loaded before the first connection

        return cls(
            max_header_bytes=settings.LMSP_HTTP_MAX_HEADER_BYTES,
            head_timeout=settings.LMSP_HTTP_HEAD_TIMEOUT_SECONDS,
            body_timeout=settings.LMSP_HTTP_BODY_TIMEOUT_SECONDS,
            keepalive=settings.LMSP_HTTP_KEEPALIVE_SECONDS,
            max_connections=settings.LMSP_HTTP_MAX_CONNECTIONS,
        )


class RefusalLog:
    """Logs refused connections at most once per ``every`` seconds, with how many there were meanwhile."""

    def __init__(self, every: float = 10.0) -> None:
        self.every = every
        self.last = float("-inf")
        self.unlogged = 0

    def refused(self, now: float, open_connections: int) -> None:
        self.unlogged += 1
        if now - self.last >= self.every:
            logger.warning(
                "refused %d connection(s) since the last report: %d open, the most LMSP_HTTP_MAX_CONNECTIONS allows",
                self.unlogged,
                open_connections,
            )
            self.last, self.unlogged = now, 0


_refusals = RefusalLog()
_limits: HttpLimits | None = None


def http_limits() -> HttpLimits:
    """The limits of this process, read once."""
    global _limits
    if _limits is None:
        _limits = HttpLimits.from_settings()
    return _limits


def problem_answer(error: LmspError, default_headers: list[tuple[bytes, bytes]]) -> bytes:
    """A complete HTTP/1.1 answer carrying ``error`` as a problem, for a connection about to close."""
    body = json.dumps(error.to_http_problem(), separators=(",", ":")).encode()
    lines = [f"HTTP/1.1 {error.status} {http.HTTPStatus(error.status).phrase}".encode()]
    headers = [
        *default_headers,
        (b"content-type", PROBLEM_CONTENT_TYPE),
        (b"content-length", str(len(body)).encode()),
        (b"connection", b"close"),
        *((name.encode(), value.encode()) for name, value in error.headers.items()),
    ]
    lines += [name + b": " + value for name, value in headers]
    return b"\r\n".join(lines) + b"\r\n\r\n" + body


class LmspH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with the limits of the module docstring."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.limits = http_limits()
        # h11's own guard against an endless head answers a bare 400; ours comes first.
        self.conn = h11.Connection(h11.SERVER, max_incomplete_event_size=self.limits.max_header_bytes + 1024)
        self.timeout_keep_alive = self.limits.keepalive
        # Connections are counted here, at accept, instead of uvicorn's count per request.
        self.limit_concurrency = None
        self._head_timer: asyncio.TimerHandle | None = None
        self._body_timer: asyncio.TimerHandle | None = None
        self._linger_timer: asyncio.TimerHandle | None = None
        self._refused = False
        # The head being received: bytes so far, and its last two (its end may span two reads).
        self._head_bytes = 0
        self._head_tail = b""

    # --- asyncio.Protocol ---------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if len(self.connections) > self.limits.max_connections:
            # Not counted while it lingers: it takes nothing from the connections being served.
            self.connections.discard(self)
            _refusals.refused(self.loop.time(), len(self.connections))
            self._refuse(TooManyConnections("Too many open connections; retry shortly", headers={"Retry-After": "1"}))
            return
        self._head_timer = self.loop.call_later(self.limits.head_timeout, self._head_timed_out)

    def data_received(self, data: bytes) -> None:
        if self._refused:
            return  # lingering: read and dropped
        if self.conn.their_state is h11.IDLE and not self._head_fits(data):
            logger.info("refused a request head over %d bytes", self.limits.max_header_bytes)
            self._refuse(RequestHeaderTooLarge(f"The request head exceeds {self.limits.max_header_bytes} bytes"))
            return
        super().data_received(data)
        self._follow_request()

    def connection_lost(self, exc: Exception | None) -> None:
        for timer in (self._head_timer, self._body_timer, self._linger_timer):
            if timer is not None:
                timer.cancel()
        self._head_timer = self._body_timer = self._linger_timer = None
        super().connection_lost(exc)

    # --- uvicorn hooks ------------------------------------------------------------------------------

    def on_response_complete(self) -> None:
        super().on_response_complete()
        # A pipelined request may have started from what was buffered, or part of its head be waiting there.
        if self.conn.their_state is h11.IDLE:
            buffered, _ = self.conn.trailing_data
            self._head_bytes, self._head_tail = len(buffered), buffered[-2:]
        self._follow_request()

    # --- the limits ---------------------------------------------------------------------------------

    def _head_fits(self, data: bytes) -> bool:
        """Count ``data`` into the head being received; False once the head is longer than allowed."""
        window = self._head_tail + data
        end = _HEAD_END.search(window)
        if end is None:
            self._head_bytes += len(data)
            self._head_tail = window[-2:]
            return self._head_bytes <= self.limits.max_header_bytes
        size = self._head_bytes + end.end() - len(self._head_tail)
        # The next head starts from zero (bytes of a pipelined one after this are not counted here).
        self._head_bytes, self._head_tail = 0, b""
        return size <= self.limits.max_header_bytes

    def _follow_request(self) -> None:
        """Arm or disarm the head and body deadlines for where the request now is."""
        state = self.conn.their_state
        if state is h11.IDLE:
            # Waiting for a head, and not idle under uvicorn's keep-alive timer (which the first byte of
            # the next request stops): the head's time runs from here.
            if self._head_timer is None and self.timeout_keep_alive_task is None:
                self._head_timer = self.loop.call_later(self.limits.head_timeout, self._head_timed_out)
        elif self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None
        if state is h11.SEND_BODY:
            if self._body_timer is None:
                self._body_timer = self.loop.call_later(self.limits.body_timeout, self._body_timed_out)
        elif self._body_timer is not None:
            self._body_timer.cancel()
            self._body_timer = None

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            logger.debug("closed a connection whose request head did not arrive in time")
            self.transport.close()

    def _body_timed_out(self) -> None:
        self._body_timer = None
        if self.conn.their_state is h11.SEND_BODY and not self.transport.is_closing():
            logger.debug("closed a connection whose request body did not arrive in time")
            # The application sees a disconnect, as if the client had gone.
            self.transport.close()

    def _refuse(self, error: LmspError) -> None:
        """Answer ``error`` and close, after reading what the client still sends for a moment."""
        self._refused = True
        for timer in (self._head_timer, self._body_timer):
            if timer is not None:
                timer.cancel()
        self._head_timer = self._body_timer = None
        self.transport.write(problem_answer(error, self.server_state.default_headers))
        if self.transport.can_write_eof():
            self.transport.write_eof()
        self._linger_timer = self.loop.call_later(LINGER_SECONDS, self.transport.close)
