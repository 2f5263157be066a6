"""Event-stream bodies served next to Django, not through it.

Django's ASGI handler keeps a thread (its per-request ``ThreadSensitiveContext``)
and four generator layers per chunk for as long as a streaming response
runs. A stream here can last hours and there may be hundreds, so the views
decide everything (auth, cursor, problems) as usual and answer only the
headers, marked with where to follow; ``EventStreamMiddleware`` sends those
headers, lets Django finish the request (thread, connection and signals are
released), and then writes the events itself until the terminal event or the
client's disconnect.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from django.http import HttpRequest, HttpResponse, StreamingHttpResponse

from tasks_app.event_feeds import follow

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
FOLLOW_HEADER = "x-lmsp-follow"


def event_stream(request: HttpRequest, task_id: str, after: int) -> HttpResponse:
    """The response of a view that streams ``task_id``'s events after ``after``."""
    scope = getattr(request, "scope", None)
    if scope is not None and scope.get(SCOPE_KEY):
        response = HttpResponse(status=200)
        response[FOLLOW_HEADER] = f"{task_id} {after}"
    else:
        # Without the middleware (Django's test client): Django streams it.
        response = StreamingHttpResponse(follow(task_id, after, preamble=STREAM_OPENED))
    response["Content-Type"] = "text/event-stream; charset=utf-8"
    response["Cache-Control"] = "no-cache"
    # Tells nginx-style proxies not to buffer the stream.
    response["X-Accel-Buffering"] = "no"
    return response


class EventStreamMiddleware:
    """ASGI middleware around Django that writes the bodies of event streams."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        scope[SCOPE_KEY] = True
        target: tuple[str, int] | None = None

        async def send_headers_only(message: Message) -> None:
            nonlocal target
            if message["type"] == "http.response.start":
                kept = []
                for name, value in message.get("headers", []):
                    lowered = bytes(name).lower()
                    if lowered == FOLLOW_HEADER.encode():
                        task_id, after = bytes(value).decode().split(" ")
                        target = (task_id, int(after))
                    elif lowered != b"content-length":
                        kept.append((name, value))
                if target is not None:
                    message = {**message, "headers": kept}
            elif message["type"] == "http.response.body" and target is not None and not message.get("more_body"):
                return  # the body follows once Django is done with the request
            await send(message)

        await self.app(scope, receive, send_headers_only)
        if target is not None:
            await _serve(target[0], target[1], receive, send)


async def _serve(task_id: str, after: int, receive: Receive, send: Send) -> None:
    body = follow(task_id, after, preamble=STREAM_OPENED)

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
    if not pumping.cancelled() and pumping.exception() is not None:
        logger.error("event stream of %s failed", task_id, exc_info=pumping.exception())
        try:
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except Exception:  # the connection is gone as well
            pass
