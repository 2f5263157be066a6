"""The event streams of tasks, and what every view that streams a task's events shares.

``GET /tasks/{id}/events`` is here; the Responses views
(``tasks_app.openai.responses.views``) and the Chat Completions views
(``tasks_app.openai.chat_completions.views``) serve their streams through the
same pieces: a response's stream is its task's.

They run on the event loop under uvicorn and hold no thread while a stream is
open or a generation runs; the database reads of streams and waits go to
``dbpool``. Everything decided before the first byte (auth, cursor, 404,
410) is an ordinary problem response; once the stream has started, it only
ever carries events. That includes the limit on open streams: a stream takes
its slot (``sse.stream_slot_take``) before it answers, and a create that asks
to stream (``create_stream_slot``) takes it before the task is created, so a
refused request has written nothing.
"""

from __future__ import annotations

import io

from django.http import HttpRequest, HttpResponse
from django.views.decorators.csrf import csrf_exempt
from rest_framework.exceptions import APIException

from tasks_app.edge.auth import BearerTokenAuthentication, StreamReader, stream_reader_authenticate
from tasks_app.edge.parsers import StrictJSONParser
from tasks_app.edge.problems import problem_json_response
from tasks_app.edge.sse import StreamSlot, event_stream, stream_slot_take
from tasks_app.edge.stream_cursor import stream_cursor
from tasks_app.exceptions import LmspError, MethodNotAllowed, Unauthorized
from tasks_app.models import Client
from tasks_app.plumbing.dbpool import run_db
from tasks_app.selectors import tasks as selectors
from tasks_app.selectors.tasks import StreamStart


def _client_holder(client: Client) -> str:
    return f"client:{client.pk}"


def _stream_holder(request: HttpRequest, reader: StreamReader) -> str:
    """Whose limit a stream counts against: its client (bearer or stream token), else the staff session."""
    if reader.client is not None:
        return _client_holder(reader.client)
    return f"session:{request.session.session_key}"


def _open_stream(
    request: HttpRequest, *, task_id: str | None = None, response_id: str | None = None
) -> tuple[str, StreamStart, str]:
    reader = stream_reader_authenticate(request)
    after, field = stream_cursor(request)
    task = selectors.task_get_streamable(reader=reader, task_id=task_id, response_id=response_id)
    start = selectors.task_stream_start(task=task, after=after, cursor_field=field)
    return task.pk, start, _stream_holder(request, reader)


def event_stream_response(
    request: HttpRequest, task_id: str, start: StreamStart, slot: StreamSlot, headers: dict[str, str] | None = None
) -> HttpResponse:
    """The stream after ``start``, which takes ``slot`` with it; or 204, which gives it back."""
    if start.finished:
        # The client has the terminal event: 204 tells an EventSource to stop.
        slot.release()
        response = HttpResponse(status=204)
    else:
        response = event_stream(request, task_id, start.after, slot)
    for name, value in (headers or {}).items():
        response[name] = value
    return response


async def serve_stream(
    request: HttpRequest, *, task_id: str | None = None, response_id: str | None = None
) -> HttpResponse:
    """A GET's event stream, or the problem that refuses it before it starts."""
    if request.method != "GET":
        error = MethodNotAllowed(f"Method {request.method} is not allowed here", headers={"Allow": "GET"})
        return problem_json_response(error, request)
    try:
        task_id, start, holder = await run_db(_open_stream, request, task_id=task_id, response_id=response_id)
        if start.finished:
            return HttpResponse(status=204)
        slot = stream_slot_take(request, holder)
    except LmspError as error:
        return problem_json_response(error, request)
    return event_stream_response(request, task_id, start, slot)


@csrf_exempt
async def task_events(request: HttpRequest, task_id: str) -> HttpResponse:
    """``GET /tasks/{id}/events``: the task's events as SSE (chapter 7.4)."""
    return await serve_stream(request, task_id=task_id)


def bearer_holder(request: HttpRequest) -> str:
    """The holder of the request's bearer token; ``Unauthorized`` without a valid one."""
    found = BearerTokenAuthentication().authenticate(request)
    if found is None:
        raise Unauthorized("An 'Authorization: Bearer <token>' header is required")
    return _client_holder(found[0])


def asks_to_stream(request: HttpRequest) -> bool:
    """Whether a ``POST /responses`` body asks to stream, read with the view's own parser.

    Read before the view runs, so that a stream over the limit is refused
    before its task exists. A body the parser refuses asks for nothing: the
    view refuses it too.
    """
    try:
        body = StrictJSONParser().parse(io.BytesIO(request.body))
    except (APIException, LmspError):
        return False
    return body.get("stream") is True


async def create_stream_slot(request: HttpRequest) -> StreamSlot | None:
    """The stream slot a streaming create (``POST /responses``, ``POST /chat/completions``) takes before its task
    exists; None when it does not stream or has no valid token (the view answers that). Over the limit:
    ``TooManyStreams``, before anything is written."""
    holder = await run_db(create_stream_holder, request) if asks_to_stream(request) else None
    return stream_slot_take(request, holder) if holder is not None else None


def create_stream_holder(request: HttpRequest) -> str | None:
    """Whose limit a streaming ``POST /responses`` counts against; None without a valid token (the view answers 401)."""
    try:
        return bearer_holder(request)
    except LmspError:
        return None
