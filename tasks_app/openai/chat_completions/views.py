"""``POST /chat/completions`` (PROFILE.md 10.3): a thin adapter over ``POST /responses``.

The synchronous half (``ChatCompletionCreateView``) validates the chat
request, translates it (``tasks_app.openai.chat_completions.translate``) and accepts it as a
response task; the async half waits for the task and answers the
``chat.completion``, or streams its events as chunks. A client that goes
away before the end cancels the generation, waiting or streaming: a chat
completion has no id to come back for.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, AsyncIterator

from asgiref.sync import sync_to_async
from django.db import connection
from django.http import HttpRequest, HttpResponse
from django.views.decorators.csrf import csrf_exempt
from rest_framework.renderers import JSONRenderer
from rest_framework.request import Request
from rest_framework.response import Response

from tasks_app.api.stream_views import create_stream_slot
from tasks_app.api.task_waits import task_end_wait, task_response_read
from tasks_app.edge.problems import problem_json_response
from tasks_app.edge.scoped_views import WRITE, ScopedAPIView, validated
from tasks_app.edge.sse import StreamSlot, event_stream, stream_slot_take
from tasks_app.exceptions import InvalidRequest, LmspError
from tasks_app.openai.chat_completions.serializers import ChatCompletionRequestSerializer
from tasks_app.openai.chat_completions.service import chat_completion_start
from tasks_app.openai.chat_completions.translate import (
    ChatChunks,
    chat_chunk_stream,
    chat_completion_object,
    chat_failure,
    chat_request_to_response,
)
from tasks_app.plumbing.dbpool import run_db_through_outages
from tasks_app.services.responses import ResponseStarted
from tasks_app.services.tasks import task_abandon


class ChatCompletionCreateView(ScopedAPIView):
    """Validate, translate, accept; the async ``chat_completions_create`` serves what was started."""

    scopes_by_method = {"POST": WRITE}

    def post(self, request: Request) -> Response:
        if request.headers.get("Idempotency-Key") is not None:
            # Refused, not ignored: a client that sends one expects a retry not to run twice.
            raise InvalidRequest(
                "Idempotency-Key is not supported on chat completions; use POST /responses for idempotent retries",
                errors=[{"field": "Idempotency-Key", "message": "not supported on this endpoint"}],
            )
        chat = chat_request_to_response(validated(ChatCompletionRequestSerializer, request.data))
        started = chat_completion_start(client=request.user, chat=chat)
        answer = Response(status=202)
        answer.lmsp_chat = (started, chat.include_usage)
        return answer


_chat_create = ChatCompletionCreateView.as_view()


def _accepted(request: HttpRequest) -> HttpResponse:
    response = _chat_create(request)
    response.render()
    if getattr(response, "lmsp_chat", None) is not None and not connection.in_atomic_block:
        # The wait or stream reads through the pool: the request's own connection goes back now.
        connection.close()
    return response


@csrf_exempt
async def chat_completions_create(request: HttpRequest) -> HttpResponse:
    """``POST /chat/completions``: wait and answer the ``chat.completion``, or stream its chunks."""
    try:
        slot = await create_stream_slot(request)
    except LmspError as error:
        return problem_json_response(error, request)
    response = await sync_to_async(_accepted)(request)
    accepted = getattr(response, "lmsp_chat", None)
    if accepted is None:
        if slot is not None:
            slot.release()
        return response
    started, include_usage = accepted
    if started.stream:
        return _stream(request, started, include_usage, slot)
    if slot is not None:
        slot.release()
    return await _wait(request, started)


def _stream(
    request: HttpRequest, started: ResponseStarted, include_usage: bool, slot: StreamSlot | None
) -> HttpResponse:
    if slot is None:
        # Not reached while the look at the body reads it as the view does; count it all the same.
        slot = stream_slot_take(request, f"task:{started.task_id}")
    return event_stream(request, started.task_id, -1, slot, stream_format=ChatStreamFormat(include_usage=include_usage))


class ChatStreamFormat:
    """A chat completion's stream, for the SSE transport (``sse.StreamFormat``): the task's events as chunks.

    A client that leaves before the end cancels the generation: nobody can
    come back for it (a chat stream has no cursor).
    """

    def __init__(self, *, include_usage: bool) -> None:
        self.chunks = ChatChunks(include_usage=include_usage)

    @property
    def finished(self) -> bool:
        return self.chunks.finished

    def encode(self, events: AsyncIterator[bytes]) -> AsyncGenerator[bytes, None]:
        return chat_chunk_stream(events, self.chunks)

    def abandon(self, task_id: str) -> None:
        task_abandon(task_id=task_id)


async def _wait(request: HttpRequest, started: ResponseStarted) -> HttpResponse:
    await task_end_wait(started.task_id)
    body = await run_db_through_outages(task_response_read, started.task_id)
    failure = chat_failure(body)
    if failure is not None:
        return problem_json_response(failure, request)
    return HttpResponse(
        JSONRenderer().render(chat_completion_object(body)), status=200, content_type="application/json"
    )
