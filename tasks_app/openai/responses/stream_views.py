"""Async views of ``/responses``: the endpoints that may stream or wait.

They run on the event loop under uvicorn and hold no thread while a stream is
open or a generation runs; the database reads of streams and waits go to
``dbpool``. The DRF parts (accepting a request, the plain response object)
run as ordinary request code (``views``). A response's stream is its task's
(``tasks_app.api.stream_views``): everything decided before the first byte
(auth, cursor, 404, 410) is an ordinary problem response, and
``POST /responses`` that asks to stream takes its stream slot before the task
is created, so a refused request has written nothing.
"""

from __future__ import annotations

import asyncio
import time

from asgiref.sync import sync_to_async
from django.conf import settings
from django.db import connection
from django.http import HttpRequest, HttpResponse
from django.views.decorators.csrf import csrf_exempt
from rest_framework.renderers import JSONRenderer

from tasks_app import states
from tasks_app.api.stream_views import bearer_holder, create_stream_slot, event_stream_response, serve_stream
from tasks_app.edge.problems import problem_json_response
from tasks_app.edge.sse import StreamSlot, stream_slot_take
from tasks_app.edge.stream_cursor import stream_cursor
from tasks_app.exceptions import InvalidRequest, LmspError
from tasks_app.openai.responses.serializers import ResponseOutputSerializer
from tasks_app.openai.responses.views import ResponseCancelView, ResponseCreateView, ResponseDetailView
from tasks_app.plumbing.dbpool import run_db, run_db_through_outages
from tasks_app.plumbing.wakeups import Watch
from tasks_app.selectors import tasks as selectors
from tasks_app.selectors.tasks import StreamStart
from tasks_app.services.responses import ResponseStarted, response_finish, response_task_finished


def _stream_flag(request: HttpRequest) -> bool:
    raw = request.GET.get("stream", "false").lower()
    if raw not in ("true", "false"):
        raise InvalidRequest(
            "stream must be true or false", errors=[{"field": "stream", "message": "must be true or false"}]
        )
    return raw == "true"


_response_detail = ResponseDetailView.as_view()
_response_create = ResponseCreateView.as_view()
_response_cancel = ResponseCancelView.as_view()
# How often a cancel that waits for its worker reads the task again.
_CANCEL_POLL_SECONDS = 0.02


def _rendered(view, request: HttpRequest, **kwargs) -> HttpResponse:
    response = view(request, **kwargs)
    response.render()
    return response


def _accepted(request: HttpRequest) -> HttpResponse:
    response = _rendered(_response_create, request)
    if getattr(response, "lmsp_started", None) is not None and not connection.in_atomic_block:
        # What follows (a stream, or a wait of minutes) reads through the
        # pool; the request's own connection is given back now, not when
        # the client goes away.
        connection.close()
    return response


@csrf_exempt
async def response_detail(request: HttpRequest, response_id: str) -> HttpResponse:
    """``GET /responses/{id}``: the stored response, or with ``stream=true`` its events (resumable)."""
    try:
        stream = _stream_flag(request)
    except LmspError as error:
        return problem_json_response(error, request)
    if not stream or request.method != "GET":
        return await sync_to_async(_rendered)(_response_detail, request, response_id=response_id)
    return await serve_stream(request, response_id=response_id)


def _response_read_json(response_id: str) -> bytes:
    read = selectors.response_read(response_id=response_id)
    return JSONRenderer().render(ResponseOutputSerializer(read).data)


@csrf_exempt
async def response_cancel(request: HttpRequest, response_id: str) -> HttpResponse:
    """``POST /responses/{id}/cancel``: cancel through the lifecycle, then answer the response.

    A running response becomes ``cancelling`` until its worker stopped (within
    a decode step); the answer waits for that, up to
    ``LMSP_RESPONSE_CANCEL_WAIT_SECONDS`` and holding no thread (it reads the
    task every 20 ms), so it usually shows ``cancelled``. Past the wait it
    shows the state it has.
    """
    answer = await sync_to_async(_rendered)(_response_cancel, request, response_id=response_id)
    cancelled = getattr(answer, "lmsp_cancelled", None)
    if cancelled is None:
        return answer
    response_id, task_id, status = cancelled
    if status == states.TaskStatus.CANCELLING:
        # Polled, not watched: the worker ends the move within a decode step, so a few short reads
        # suffice, and the view starts no subscription of its own (a test client's request runs
        # on an event loop that closes with it, and must leave no task behind on it).
        deadline = time.monotonic() + settings.LMSP_RESPONSE_CANCEL_WAIT_SECONDS
        while not await run_db(response_task_finished, task_id=task_id) and time.monotonic() < deadline:
            await asyncio.sleep(_CANCEL_POLL_SECONDS)
    body = await run_db(_response_read_json, response_id)
    return HttpResponse(body, status=200, content_type="application/json")


@csrf_exempt
async def responses_create(request: HttpRequest) -> HttpResponse:
    """``POST /responses``: accept as a task; stream its events, or wait for it and answer the response.

    Waiting holds no thread: wake-ups of the task's end (or, failing those,
    a periodic read) end the wait.
    """
    try:
        slot = await create_stream_slot(request)
    except LmspError as error:
        return problem_json_response(error, request)
    response = await sync_to_async(_accepted)(request)
    started: ResponseStarted | None = getattr(response, "lmsp_started", None)
    if started is not None and started.stream:
        return await _stream_started(request, started, slot)
    if slot is not None:
        slot.release()
    if started is None:
        return response
    with Watch(started.task_id, statuses=states.TERMINAL) as watch:
        while not await run_db_through_outages(response_task_finished, task_id=started.task_id):
            await watch.wait(watch.hub.poll_interval())
    reply = await run_db_through_outages(
        response_finish, task_id=started.task_id, idempotency_record_id=started.idempotency_record_id
    )
    return HttpResponse(JSONRenderer().render(reply.body), status=reply.status, content_type="application/json")


async def _stream_started(request: HttpRequest, started: ResponseStarted, slot: StreamSlot | None) -> HttpResponse:
    if slot is None:
        # Not reached while the look at the body reads it as the view does; if it ever is, count it all the same.
        try:
            slot = stream_slot_take(request, await run_db(bearer_holder, request))
        except LmspError as error:
            return problem_json_response(error, request)
    if not started.replayed:
        return event_stream_response(request, started.task_id, StreamStart(after=-1), slot)
    # A retry of a streamed request: the first request's events, from its cursor.
    try:
        start = await run_db(_replay_start, request, task_id=started.task_id)
    except LmspError as error:
        slot.release()
        return problem_json_response(error, request)
    return event_stream_response(request, started.task_id, start, slot, headers={"Idempotent-Replayed": "true"})


def _replay_start(request: HttpRequest, *, task_id: str) -> StreamStart:
    after, field = stream_cursor(request)
    task = selectors.task_stream_task(task_id=task_id)
    return selectors.task_stream_start(task=task, after=after, cursor_field=field)
