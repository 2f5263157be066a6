"""Event-stream bodies served next to Django, not through it.

Django's ASGI handler keeps a thread (its per-request ``ThreadSensitiveContext``)
and four generator layers per chunk for as long as a streaming response
runs. A stream here can last hours and there may be hundreds, so the views
decide everything (auth, cursor, problems) as usual and answer only the
headers, marked with where to follow; ``EventStreamMiddleware`` sends those
headers, lets Django finish the request (thread, connection and signals are
released), and then writes the events itself until the terminal event or the
client's disconnect.

Open streams are limited per client and per process (``StreamSlots``): a
view takes a slot before it answers a stream (``stream_slot_take``), and
the middleware gives it back when the request ends, however it ends (the
terminal event, the client's disconnect or reset, a failure, the server's
shutdown).

The transport knows no protocol: a task's events go out as stored, unless
the view hands it a ``StreamFormat`` (the Chat Completions adapter's chunks,
``tasks_app.openai.chat_completions.views``), which shapes the bytes and says
what a client that leaves before the end means.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, MutableMapping
from typing import Any, Protocol

from django.conf import settings
from django.http import HttpRequest, HttpResponse, StreamingHttpResponse

from tasks_app.exceptions import TooManyStreams
from tasks_app.plumbing.dbpool import run_db
from tasks_app.plumbing.event_feeds import follow

logger = logging.getLogger(__name__)

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

# A comment first, so that a client sees the stream open at once even when
# the next event is minutes away. (Not a ``retry:`` field: SDKs such as
# openai's parse a block holding only ``retry`` as an event with empty data.)
STREAM_OPENED = b": stream opened\n\n"
SCOPE_KEY = "lmsp.event_streams"
SLOTS_KEY = "lmsp.stream_slots"
# A stream's format cannot travel in a header: it goes from the view to the middleware in the scope, as slots do.
FORMAT_KEY = "lmsp.stream_format"
FOLLOW_HEADER = "x-lmsp-follow"


class StreamFormat(Protocol):
    """A protocol's shape of a task's event stream, for one stream (it may keep state as the stream goes)."""

    @property
    def finished(self) -> bool:
        """Whether the stream reached its end (one left before it is a client gone away)."""
        ...

    def encode(self, events: AsyncIterator[bytes]) -> AsyncGenerator[bytes, None]:
        """What goes out for the task's SSE body (``event_feeds.follow``); closed when the stream ends."""
        ...

    def abandon(self, task_id: str) -> None:
        """What a client that left before the end means for the task (run on the database pool)."""
        ...


class StreamSlot:
    """One open stream's place in the limits; giving it back twice is harmless."""

    __slots__ = ("_released", "_slots", "holder")

    def __init__(self, slots: StreamSlots, holder: str) -> None:
        self._slots = slots
        self.holder = holder
        self._released = False

    def release(self) -> None:
        if not self._released:
            self._released = True
            self._slots._release(self.holder)


class StreamSlots:
    """The open event streams of this web process, counted per holder (a client, a staff session).

    In memory: a process that dies takes its counts with it, so no slot can
    outlive its stream. With several web processes each counts its own.
    """

    def __init__(self) -> None:
        # The views take slots on the event loop; Django's test client gives them back from its threads.
        self._lock = threading.Lock()
        self._by_holder: dict[str, int] = {}
        self.total = 0

    def acquire(self, holder: str) -> StreamSlot:
        """A slot for one more stream of ``holder``, or ``TooManyStreams``."""
        per_client = settings.LMSP_MAX_STREAMS_PER_CLIENT
        per_process = settings.LMSP_MAX_STREAMS_PER_PROCESS
        with self._lock:
            held = self._by_holder.get(holder, 0)
            if held >= per_client:
                raise _too_many(f"this client has {held} open (at most {per_client})")
            if self.total >= per_process:
                raise _too_many(f"this server has {self.total} open (at most {per_process})")
            self._by_holder[holder] = held + 1
            self.total += 1
        return StreamSlot(self, holder)

    def _release(self, holder: str) -> None:
        with self._lock:
            left = self._by_holder[holder] - 1
            if left:
                self._by_holder[holder] = left
            else:
                del self._by_holder[holder]
            self.total -= 1


def _too_many(why: str) -> TooManyStreams:
    wait = settings.LMSP_STREAM_LIMIT_RETRY_AFTER_SECONDS
    return TooManyStreams(
        f"Too many open event streams: {why}; close one, or retry in {wait} s",
        headers={"Retry-After": str(wait)},
    )


stream_slots = StreamSlots()


def _middleware_scope(request: HttpRequest) -> Scope | None:
    scope = getattr(request, "scope", None)
    return scope if scope is not None and scope.get(SCOPE_KEY) else None


def stream_slot_take(request: HttpRequest, holder: str) -> StreamSlot:
    """A slot for one more open stream of ``holder`` (or ``TooManyStreams``), given back when the request ends.

    Without the middleware (Django's test client) the view gives it back
    itself, or the stream's body does when it ends.
    """
    slot = stream_slots.acquire(holder)
    scope = _middleware_scope(request)
    if scope is not None:
        scope.setdefault(SLOTS_KEY, []).append(slot)
    return slot


def event_stream(
    request: HttpRequest, task_id: str, after: int, slot: StreamSlot, *, stream_format: StreamFormat | None = None
) -> HttpResponse:
    """The response of a view that streams ``task_id``'s events after ``after``; ``slot`` goes with the stream.

    With ``stream_format``, the events go out as it encodes them, and a
    client that leaves before the end has it ``abandon`` the task (under the
    middleware).
    """
    scope = _middleware_scope(request)
    if scope is not None:
        response = HttpResponse(status=200)
        response[FOLLOW_HEADER] = f"{task_id} {after}"
        if stream_format is not None:
            scope[FORMAT_KEY] = stream_format
    else:
        # Without the middleware (Django's test client): Django streams it.
        body = _body(task_id, after, stream_format)
        response = StreamingHttpResponse(_releasing(body, slot))
    response["Content-Type"] = "text/event-stream; charset=utf-8"
    response["Cache-Control"] = "no-cache"
    # Tells nginx-style proxies not to buffer the stream.
    response["X-Accel-Buffering"] = "no"
    return response


def _body(task_id: str, after: int, stream_format: StreamFormat | None) -> AsyncGenerator[bytes, None]:
    events = follow(task_id, after, preamble=STREAM_OPENED)
    return events if stream_format is None else stream_format.encode(events)


async def _releasing(body: AsyncGenerator[bytes, None], slot: StreamSlot) -> AsyncGenerator[bytes, None]:
    try:
        async for chunk in body:
            yield chunk
    finally:
        slot.release()
        await body.aclose()


class EventStreamMiddleware:
    """ASGI middleware around Django that writes the bodies of event streams."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        scope[SCOPE_KEY] = True
        try:
            await self._serve_http(scope, receive, send)
        finally:
            # However the request ended: the terminal event, a disconnect, a failure, or the task
            # cancelled by the server's shutdown.
            for slot in scope.pop(SLOTS_KEY, ()):
                slot.release()

    async def _serve_http(self, scope: Scope, receive: Receive, send: Send) -> None:
        target: tuple[str, int, StreamFormat | None] | None = None

        async def send_headers_only(message: Message) -> None:
            nonlocal target
            if message["type"] == "http.response.start":
                kept = []
                for name, value in message.get("headers", []):
                    lowered = bytes(name).lower()
                    if lowered == FOLLOW_HEADER.encode():
                        task_id, after = bytes(value).decode().split(" ")
                        target = (task_id, int(after), scope.pop(FORMAT_KEY, None))
                    elif lowered != b"content-length":
                        kept.append((name, value))
                if target is not None:
                    message = {**message, "headers": kept}
            elif message["type"] == "http.response.body" and target is not None and not message.get("more_body"):
                return  # the body follows once Django is done with the request
            await send(message)

        await self.app(scope, receive, send_headers_only)
        if target is not None:
            await _serve(*target, receive, send)


async def _serve(task_id: str, after: int, stream_format: StreamFormat | None, receive: Receive, send: Send) -> None:
    body = _body(task_id, after, stream_format)

    async def pump() -> None:
        async for chunk in body:
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def until_disconnect() -> None:
        while (await receive())["type"] != "http.disconnect":
            pass

    pumping = asyncio.ensure_future(pump())
    listening = asyncio.ensure_future(until_disconnect())
    try:
        await asyncio.wait({pumping, listening}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        # A disconnect ends the stream at once, even while it waits for events.
        for task in (pumping, listening):
            task.cancel()
        await asyncio.gather(pumping, listening, return_exceptions=True)
        await body.aclose()
    if stream_format is not None and not stream_format.finished:
        # The client went away before the end: its format says what that means for the task.
        try:
            await run_db(stream_format.abandon, task_id)
        except Exception:
            logger.exception("could not abandon task %s after its stream's client left", task_id)
    if not pumping.cancelled() and pumping.exception() is not None:
        logger.error("event stream of %s failed", task_id, exc_info=pumping.exception())
        try:
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except Exception:  # the connection is gone as well
            pass
