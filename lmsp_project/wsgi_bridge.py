"""An ASGI app that serves a WSGI app on a fixed pool of long-lived threads.

Why not Django's ASGI handler for the plain REST views: it runs every sync
view in a per-request ``ThreadSensitiveContext``, so each request gets its
own database connection objects (asgiref's ``Local`` is context-local) and on
SQLite opens a new connection and registers its SQL functions every time.
``run_in_executor`` copies no context: each pool thread keeps the connections
it opened, reused across requests like a WSGI worker thread's (see
``tasks_app.plumbing.dbpool``, which does the same for the streams' reads).

PEP 3333 on one side, ASGI HTTP on the other. The request body is read in
full (up to ``max_body`` bytes, or what ``body_limit`` allows the request's
route: what lies beyond is not read, the app sees a body one byte over its
limit and refuses it) before the app runs; a client that leaves before that
costs no thread and leaves nothing behind. A body over ``SPOOL_BYTES`` is
spooled to a temporary file, not held in memory (a file upload, docs/batches.md). A response's first 64 KiB come back
from the thread with its status, so an ordinary response costs one thread
hop; a longer one (a static file) is pulled from the thread in 64 KiB steps
and stops when the client goes.
"""

from __future__ import annotations

import asyncio
import io
import sys
import tempfile
from collections.abc import Awaitable, Callable, Iterable, Iterator, MutableMapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
WSGIApp = Callable[[dict[str, Any], Callable[..., Any]], Iterable[bytes]]

CHUNK_BYTES = 64 * 1024
# A request body longer than this goes to a temporary file as it arrives.
SPOOL_BYTES = 1024 * 1024


class _Disconnected(Exception):
    """Raised when the client went away before its request body was complete."""


class WsgiBridge:
    """Serves ``app`` (WSGI) over ASGI HTTP on ``threads`` named threads."""

    def __init__(
        self,
        app: WSGIApp,
        *,
        threads: int,
        max_body: int,
        thread_name_prefix: str = "wsgi",
        body_limit: Callable[[str, str], int] | None = None,
    ) -> None:
        self.app = app
        self.max_body = max_body
        # (method, path) -> the limit of that request's body, where a route takes more than max_body.
        self.body_limit = body_limit
        self.executor = ThreadPoolExecutor(max_workers=threads, thread_name_prefix=thread_name_prefix)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            raise ValueError(f"the WSGI bridge serves only HTTP, not {scope['type']!r}")
        limit = self.max_body if self.body_limit is None else self.body_limit(scope["method"], scope["path"])
        with tempfile.SpooledTemporaryFile(max_size=SPOOL_BYTES) as body:
            try:
                await self._read_body(receive, body, limit)
            except _Disconnected:
                return
            body.seek(0)
            await self._serve(scope, receive, send, body)

    async def _serve(self, scope: Scope, receive: Receive, send: Send, body: Any) -> None:
        environ = wsgi_environ(scope, body)
        loop = asyncio.get_running_loop()
        status, headers, first, rest = await loop.run_in_executor(self.executor, self._start, environ)
        start = {"type": "http.response.start", "status": status, "headers": headers}
        if rest is None:
            await send(start)
            await send({"type": "http.response.body", "body": first, "more_body": False})
            return
        try:
            await send(start)
            await self._stream(first, rest, receive, send)
        finally:
            # close() ends the request for Django (request_finished, open files).
            await loop.run_in_executor(self.executor, rest.close)

    async def _read_body(self, receive: Receive, body: Any, limit: int) -> None:
        size = 0
        while size <= limit:
            message = await receive()
            if message["type"] == "http.disconnect":
                raise _Disconnected
            chunk = message.get("body", b"")[: limit + 1 - size]
            body.write(chunk)
            size += len(chunk)
            if not message.get("more_body", False):
                break

    def _start(self, environ: dict[str, Any]) -> tuple[int, list[tuple[bytes, bytes]], bytes, _Body | None]:
        """On a pool thread: run the app up to its first ``CHUNK_BYTES`` of body."""
        started: list[Any] = []

        def start_response(status: str, headers: list[tuple[str, str]], exc_info: Any = None) -> Callable:
            # Nothing is sent before this thread returns, so a later call
            # (with exc_info, after an error) may always replace the first.
            started[:] = [status, headers]
            return _no_write

        result = self.app(environ, start_response)
        body = _Body(result)
        try:
            first = body.read()
        except BaseException:
            body.close()
            raise
        status, headers = started
        # Lowercase names, as ASGI asks; Django writes Set-Cookie as " name=value".
        encoded = [(name.lower().encode("latin-1"), value.strip().encode("latin-1")) for name, value in headers]
        if body.done:
            body.close()
            return int(status.split(" ", 1)[0]), encoded, first, None
        return int(status.split(" ", 1)[0]), encoded, first, body

    async def _stream(self, first: bytes, rest: _Body, receive: Receive, send: Send) -> None:
        loop = asyncio.get_running_loop()
        gone = asyncio.ensure_future(_until_disconnect(receive))
        try:
            chunk = first
            while not rest.done and not gone.done():
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
                chunk = await loop.run_in_executor(self.executor, rest.read)
            if not gone.done():
                await send({"type": "http.response.body", "body": chunk, "more_body": False})
        finally:
            gone.cancel()


class _Body:
    """A WSGI response iterable, read in pieces of about ``CHUNK_BYTES``."""

    def __init__(self, result: Iterable[bytes]) -> None:
        self.result = result
        self.chunks: Iterator[bytes] = iter(result)
        self.done = False

    def read(self) -> bytes:
        parts: list[bytes] = []
        size = 0
        while size < CHUNK_BYTES:
            try:
                chunk = next(self.chunks)
            except StopIteration:
                self.done = True
                break
            parts.append(chunk)
            size += len(chunk)
        return b"".join(parts)

    def close(self) -> None:
        close = getattr(self.result, "close", None)
        if close is not None:
            close()


def _no_write(data: bytes) -> None:
    raise NotImplementedError("the WSGI write() callable is not supported; return the body instead")


async def _until_disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


def wsgi_environ(scope: Scope, body: bytes | Any) -> dict[str, Any]:
    """The PEP 3333 environ of an ASGI HTTP request whose whole body is ``body`` (bytes, or a file at its start)."""
    script_name = scope.get("root_path", "")
    path = scope["path"]
    if script_name and path.startswith(script_name):
        path = path[len(script_name) :]
    server = scope.get("server") or ("localhost", 80)
    environ: dict[str, Any] = {
        "REQUEST_METHOD": scope["method"],
        # WSGI strings are bytes as latin-1; ASGI's path is already decoded UTF-8.
        "SCRIPT_NAME": script_name.encode("utf-8").decode("latin-1"),
        "PATH_INFO": path.encode("utf-8").decode("latin-1"),
        "QUERY_STRING": scope.get("query_string", b"").decode("latin-1"),
        "SERVER_NAME": str(server[0]),
        "SERVER_PORT": str(server[1] if server[1] is not None else 80),
        "SERVER_PROTOCOL": f"HTTP/{scope.get('http_version', '1.1')}",
        "wsgi.version": (1, 0),
        "wsgi.url_scheme": scope.get("scheme", "http"),
        "wsgi.input": io.BytesIO(body) if isinstance(body, bytes) else body,
        "wsgi.errors": sys.stderr,
        "wsgi.multithread": True,
        "wsgi.multiprocess": True,
        "wsgi.run_once": False,
    }
    client = scope.get("client")
    if client:
        environ["REMOTE_ADDR"] = client[0]
        environ["REMOTE_PORT"] = str(client[1])
    for raw_name, raw_value in scope.get("headers", []):
        name = raw_name.decode("latin-1").lower()
        value = raw_value.decode("latin-1")
        if name == "content-type":
            environ["CONTENT_TYPE"] = value
            continue
        if name == "content-length":
            environ["CONTENT_LENGTH"] = value
            continue
        if "_" in name:
            # X_Forwarded_For would read as X-Forwarded-For (gunicorn and
            # Django's runserver drop these for the same reason).
            continue
        key = "HTTP_" + name.upper().replace("-", "_")
        if key in environ:
            value = environ[key] + ("; " if key == "HTTP_COOKIE" else ",") + value
        environ[key] = value
    size = len(body) if isinstance(body, bytes) else _remaining(body)
    if size and "CONTENT_LENGTH" not in environ:
        # A chunked body, already read in full: a WSGI app reads no further
        # than CONTENT_LENGTH (Django reads nothing without it).
        environ["CONTENT_LENGTH"] = str(size)
    return environ


def _remaining(body: Any) -> int:
    """The bytes of a spooled body from where it stands to its end (it is left where it stood)."""
    here = body.tell()
    end = body.seek(0, io.SEEK_END)
    body.seek(here)
    return end - here
