"""``POST /messages`` and ``POST /messages/count_tokens`` (PROFILE.md 11.1): thin views over the adapter.

As for chat completions, the synchronous half (``MessageCreateView``)
validates, translates and accepts the request as a response task; the async
``messages_create`` then waits and answers the Message, or streams the
task's events as Messages events. Every error on these routes is answered in
Anthropic's shape (``tasks_app.anthropic.errors``, through
``tasks_app.edge.error_shapes``).

A client that leaves a stream before its end cancels the generation, unless
it sent an ``Idempotency-Key``: then the task runs on, and a retry with the
key and ``Last-Event-ID`` gets the rest of the same stream (never a second
run). Claude Code sends no key: its Esc frees the model's row at once.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, AsyncIterator

from asgiref.sync import sync_to_async
from django.db import connection
from django.http import HttpRequest, HttpResponse
from django.views.decorators.csrf import csrf_exempt
from drf_spectacular.utils import OpenApiResponse
from rest_framework.authentication import BaseAuthentication
from rest_framework.renderers import JSONRenderer
from rest_framework.request import Request
from rest_framework.response import Response

from tasks_app import exceptions as exc
from tasks_app.anthropic import schema
from tasks_app.anthropic.messages import MessageEvents, message_failure, message_object, message_stream
from tasks_app.anthropic.serializers import CountTokensRequestSerializer, MessageRequestSerializer
from tasks_app.anthropic.service import MessageStarted, message_start, message_tokens_count
from tasks_app.anthropic.translate import message_spec
from tasks_app.api.schema_annotations import (
    EVENT_STREAM_MEDIA_TYPE,
    IDEMPOTENCY_KEY,
    LAST_EVENT_ID,
    STREAM_FINISHED,
    idempotent_replayed,
    operation,
)
from tasks_app.api.stream_views import asks_to_stream
from tasks_app.api.task_waits import task_end_wait, task_response_read
from tasks_app.edge.auth import BearerTokenAuthentication, token_client
from tasks_app.edge.problems import problem_json_response
from tasks_app.edge.scoped_views import WRITE, ScopedAPIView, validated
from tasks_app.edge.sse import StreamSlot, event_stream, stream_slot_take
from tasks_app.edge.stream_cursor import stream_cursor
from tasks_app.exceptions import InvalidRequest, LmspError
from tasks_app.models import Client
from tasks_app.plumbing.dbpool import run_db, run_db_through_outages
from tasks_app.selectors import tasks as selectors
from tasks_app.selectors.tasks import StreamStart
from tasks_app.services.idempotency import idempotency_key_validate, request_digest
from tasks_app.services.tasks import task_abandon
from tasks_app.states import RestartPolicy


class ApiKeyAuthentication(BaseAuthentication):
    """``x-api-key: <token>`` (what ``ANTHROPIC_API_KEY`` sends): the same client tokens as a bearer."""

    def authenticate(self, request: Request | HttpRequest) -> tuple[Client, str] | None:
        token = request.META.get("HTTP_X_API_KEY", "").strip()
        return (token_client(token), token) if token else None

    def authenticate_header(self, request: Request) -> str:
        return 'Bearer realm="lmsp"'


class _MessagesView(ScopedAPIView):
    authentication_classes = [BearerTokenAuthentication, ApiKeyAuthentication]
    scopes_by_method = {"POST": WRITE}
    # The schema (tasks_app/api/schema_generator.py): Anthropic's components, and its error shape for every problem.
    schema_components = schema.SCHEMA_COMPONENTS
    schema_error_content = staticmethod(schema.error_content)


class MessageCreateView(_MessagesView):
    """Validate, translate, count and accept; the async ``messages_create`` serves what was started.

    The schema documents ``messages_create`` through this view (``tasks_app/api/schema_stand_ins.py``).
    """

    @operation(
        operation_id="messages_create",
        summary="Create a message (Anthropic's Messages API)",
        description="Extension (PROFILE.md 11.1, for Anthropic's SDKs and Claude Code with "
        "`ANTHROPIC_BASE_URL=<host>/lmsp`): the request runs as a response task on the same workers (listed by "
        "`GET /tasks`; `msg_X` is `resp_X`). `stream: false` waits and answers the Message; `stream: true` "
        "answers Anthropic's events. A client that leaves before the end cancels the generation, unless it sent "
        "an `Idempotency-Key` (streams only): then a retry with the key and `Last-Event-ID` resumes the same "
        "stream. `tool_choice`, `stop_sequences` and `output_config.format` are enforced; what asks for what "
        "this service lacks (images, documents, a prefill, containers, MCP servers, a choice of a server tool) "
        "is `400 invalid_request_error` naming the field. A prompt over the model's context is refused before "
        "anything is queued (`prompt is too long: N tokens > M maximum`). Every error is Anthropic's "
        '`{"type": "error", "error": {"type", "message"}}` as `application/json`.',
        parameters=[IDEMPOTENCY_KEY, LAST_EVENT_ID, idempotent_replayed(200, 204)],
        request={"application/json": schema.MESSAGE_REQUEST},
        responses={
            (200, "application/json"): OpenApiResponse(
                {"$ref": "#/components/schemas/AnthropicMessage"},
                description="`stream: false`: the Message.",
            ),
            (200, EVENT_STREAM_MEDIA_TYPE): OpenApiResponse(
                schema.MESSAGE_STREAM_SCHEMA, description=schema.MESSAGE_STREAM_DESCRIPTION
            ),
            204: STREAM_FINISHED,
        },
        problems=[
            exc.InvalidRequest,
            exc.UnsupportedParameter,
            exc.UnsupportedCapability,
            exc.ModelNotFound,
            exc.ContextLengthExceeded,
            exc.ResponseCancelled,
            exc.IdempotencyKeyInUse,
            exc.EventHistoryExpired,
            exc.IdempotencyKeyReused,
            exc.QueueFull,
            exc.TooManyStreams,
            exc.DatabaseBusy,
            exc.BackendError,
            exc.ModelLoadFailed,
            exc.ServerRestarted,
        ],
    )
    def post(self, request: Request) -> Response:
        key = idempotency_key_validate(request.headers.get("Idempotency-Key"))
        stream_cursor(request)
        data = validated(MessageRequestSerializer, request.data)
        if key is not None and not data["stream"]:
            # Refused, not ignored: only a stream can be taken up again (its events, from Last-Event-ID).
            raise InvalidRequest(
                "Idempotency-Key is supported on streamed messages only (a retry resumes the stream)",
                errors=[{"field": "Idempotency-Key", "message": "send it with stream: true"}],
            )
        started = message_start(
            client=request.user,
            request=request.data,
            spec=message_spec(data),
            stream=data["stream"],
            on_restart=RestartPolicy(data["on_restart"]),
            idempotency_key=key,
            request_hash=request_digest(request.data) if key is not None else None,
        )
        answer = Response(status=202)
        answer.lmsp_message = (started, key is not None)
        return answer


class CountTokensView(_MessagesView):
    """``POST /messages/count_tokens``: the prompt's tokens as the model reads them (nothing is queued)."""

    @operation(
        operation_id="messages_count_tokens",
        summary="Count a message's prompt tokens (Anthropic's count_tokens)",
        description="The tokens of the prompt a Messages request would give the model (its template, system "
        "prompt and tools included), counted with the model's own tokenizer on the web host; nothing is queued. "
        "A host without the model's files answers `400`.",
        request={"application/json": schema.COUNT_TOKENS_REQUEST},
        responses={200: schema.COUNT_TOKENS_ANSWER},
        problems=[exc.InvalidRequest, exc.UnsupportedParameter, exc.UnsupportedCapability, exc.ModelNotFound],
    )
    def post(self, request: Request) -> Response:
        data = validated(CountTokensRequestSerializer, request.data)
        return Response({"input_tokens": message_tokens_count(spec=message_spec(data))})


_message_create = MessageCreateView.as_view()


def _accepted(request: HttpRequest) -> HttpResponse:
    response = _message_create(request)
    response.render()
    if getattr(response, "lmsp_message", None) is not None and not connection.in_atomic_block:
        # The wait or stream reads through the pool: the request's own connection goes back now.
        connection.close()
    return response


def _stream_holder(request: HttpRequest) -> str | None:
    """Whose stream limit a streaming request counts against; None without a valid token (the view says 401)."""
    header = request.META.get("HTTP_AUTHORIZATION") or ""
    token = header.partition(" ")[2].strip() if header.lower().startswith("bearer ") else ""
    token = token or request.META.get("HTTP_X_API_KEY", "").strip()
    if not token:
        return None
    try:
        return f"client:{token_client(token).pk}"
    except LmspError:
        return None


@csrf_exempt
async def messages_create(request: HttpRequest) -> HttpResponse:
    """``POST /messages``: wait and answer the Message, or stream its events."""
    slot = None
    try:
        if asks_to_stream(request):
            holder = await run_db(_stream_holder, request)
            slot = stream_slot_take(request, holder) if holder is not None else None
    except LmspError as error:
        return problem_json_response(error, request)
    response = await sync_to_async(_accepted)(request)
    accepted = getattr(response, "lmsp_message", None)
    if accepted is None:
        if slot is not None:
            slot.release()
        return response
    started, resumable = accepted
    if started.started.stream:
        return await _stream(request, started, resumable, slot)
    if slot is not None:
        slot.release()
    return await _wait(request, started)


async def _stream(
    request: HttpRequest, started: MessageStarted, resumable: bool, slot: StreamSlot | None
) -> HttpResponse:
    task_id = started.started.task_id
    if slot is None:
        slot = stream_slot_take(request, f"task:{task_id}")
    after = -1
    if started.started.replayed:
        # A retry of a streamed request: the first request's events, after its Last-Event-ID.
        try:
            start = await run_db(_replay_start, request, task_id=task_id)
        except LmspError as error:
            slot.release()
            return problem_json_response(error, request)
        if start.finished:
            # The client has the end already: 204, as every task stream answers it.
            slot.release()
            return HttpResponse(status=204, headers={"Idempotent-Replayed": "true"})
        after = start.after
    stream_format = MessageStreamFormat(input_tokens=started.input_tokens, resumable=resumable)
    response = event_stream(request, task_id, after, slot, stream_format=stream_format)
    if started.started.replayed:
        response["Idempotent-Replayed"] = "true"
    return response


def _replay_start(request: HttpRequest, *, task_id: str) -> StreamStart:
    after, field = stream_cursor(request)
    task = selectors.task_stream_task(task_id=task_id)
    return selectors.task_stream_start(task=task, after=after, cursor_field=field)


class MessageStreamFormat:
    """A Messages stream, for the SSE transport (``sse.StreamFormat``): the task's events as Anthropic's."""

    def __init__(self, *, input_tokens: int | None, resumable: bool) -> None:
        self.events = MessageEvents(input_tokens=input_tokens)
        self.resumable = resumable

    @property
    def finished(self) -> bool:
        return self.events.finished

    def encode(self, events: AsyncIterator[bytes]) -> AsyncGenerator[bytes, None]:
        return message_stream(events, self.events)

    def abandon(self, task_id: str) -> None:
        if not self.resumable:
            task_abandon(task_id=task_id)


async def _wait(request: HttpRequest, started: MessageStarted) -> HttpResponse:
    await task_end_wait(started.started.task_id)
    body = await run_db_through_outages(task_response_read, started.started.task_id)
    failure = message_failure(body)
    if failure is not None:
        return problem_json_response(failure, request)
    return HttpResponse(JSONRenderer().render(message_object(body)), status=200, content_type="application/json")
