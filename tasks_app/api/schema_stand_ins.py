"""Stand-in ``APIView``s for the plain async views (the ``stream_views`` modules, the chat and messages views).

The event streams, ``POST /responses`` and ``GET /responses/{id}`` are not
DRF views, so spectacular cannot read them: the generator documents each
through its stand-in here (``documented_view``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from drf_spectacular.utils import OpenApiParameter, OpenApiResponse
from rest_framework.views import APIView

from tasks_app import exceptions as exc
from tasks_app.anthropic import views as anthropic_views
from tasks_app.api import stream_views as task_stream_views
from tasks_app.api.schema_annotations import (
    CHAT_STREAM,
    EVENT_STREAM,
    EVENT_STREAM_MEDIA_TYPE,
    IDEMPOTENCY_KEY,
    LAST_EVENT_ID,
    RESPONSE_ID,
    STARTING_AFTER,
    STREAM_FINISHED,
    TASK_ID,
    idempotent_replayed,
    operation,
)
from tasks_app.api.schema_components import ChatCompletionSchema, DeletedResponseSchema, ResponseSchema
from tasks_app.ollama import pull as ollama_pull
from tasks_app.ollama import views as ollama_views
from tasks_app.openai.chat_completions import views as chat_completions_views
from tasks_app.openai.chat_completions.serializers import ChatCompletionRequestSerializer
from tasks_app.openai.responses import stream_views as response_stream_views
from tasks_app.openai.responses.serializers import ResponseCreateInputSerializer


class TaskEventsOperations(APIView):
    """``tasks_app.api.stream_views.task_events`` as the schema shows it."""

    scopes_by_method = {"GET": ("read",)}
    # Besides a bearer token: a stream token (``?token=``) or a staff session.
    stream_readers = True

    @operation(
        operation_id="tasks_events",
        summary="Stream a task's events (SSE)",
        description="Every event from `response.created` on, then live ones until the terminal event. "
        "A client that connects late gets what it missed first. Resume with `Last-Event-ID` or "
        "`starting_after`. Browsers, whose `EventSource` cannot send a header, use a stream token "
        "(`?token=`, see `POST /tasks/{task_id}/stream_token`) or a staff session of the admin.",
        parameters=[TASK_ID, LAST_EVENT_ID, STARTING_AFTER],
        request=None,
        responses={(200, EVENT_STREAM_MEDIA_TYPE): EVENT_STREAM, 204: STREAM_FINISHED},
        problems=[exc.InvalidRequest, exc.TaskNotFound, exc.EventHistoryExpired, exc.TooManyStreams],
    )
    def get(self, request: Any, task_id: str) -> None:
        """Schema only."""


class ResponsesOperations(APIView):
    """``tasks_app.openai.responses.stream_views.responses_create`` (with ``views.ResponseCreateView``) as the
    schema shows it."""

    scopes_by_method = {"POST": ("responses",)}

    @operation(
        operation_id="responses_create",
        summary="Create a response: wait for it, stream its events, or (background) follow it later",
        description="The request becomes a task (policy `on_restart`, default `fail`; listed by `GET /tasks`). "
        "With `stream: false` the call waits until the task ends and answers the response object, whatever "
        "its status (`completed`, `incomplete`, `failed`, `cancelled`). With `stream: true` it answers the "
        "task's events as `GET /tasks/{task_id}/events` does. With `background: true` (extension, OpenAI's "
        "background mode) and `stream: false` it answers at once with the response `queued` (and its "
        "`queue_position`); `GET /responses/{id}` follows it, `POST /responses/{id}/cancel` cancels it, "
        "and its end reaches the client's webhooks. A retry with the same `Idempotency-Key` never runs "
        "a second generation: it answers the stored response again, or streams the same task's events "
        "again, from `Last-Event-ID` / `starting_after` when given.",
        parameters=[IDEMPOTENCY_KEY, LAST_EVENT_ID, STARTING_AFTER, idempotent_replayed(200, 204)],
        request=ResponseCreateInputSerializer,
        responses={
            (200, "application/json"): OpenApiResponse(
                ResponseSchema,
                description="`stream: false`: the finished response, or (`background: true`) the response `queued`.",
            ),
            (200, EVENT_STREAM_MEDIA_TYPE): EVENT_STREAM,
            204: OpenApiResponse(
                description="`stream: true`, retried with its key and a cursor at the terminal event: "
                "nothing is left to send."
            ),
        },
        problems=[
            exc.InvalidRequest,
            exc.UnsupportedCapability,
            exc.UnsupportedParameter,
            exc.ResponseNotFound,
            exc.ResponseNotFinished,
            exc.ConversationNotFound,
            exc.ConversationBusy,
            exc.ModelNotFound,
            exc.IdempotencyKeyInUse,
            exc.EventHistoryExpired,
            exc.IdempotencyKeyReused,
            exc.QueueFull,
            exc.DatabaseBusy,
            exc.TooManyStreams,
        ],
    )
    def post(self, request: Any) -> None:
        """Schema only."""


class ResponseDetailOperations(APIView):
    """``tasks_app.openai.responses.stream_views.response_detail`` (with ``views.ResponseDetailView``) as the
    schema shows it."""

    scopes_by_method = {"GET": ("read",), "DELETE": ("responses",)}
    stream_readers = True

    @operation(
        operation_id="responses_retrieve",
        summary="Read a response, or (stream=true) stream its task's events",
        description="The response object, live: while it runs, its `status` and the output committed so far; "
        "while queued, its `queue_position`. With `stream=true` the events of the task that produces "
        "it, resumable like `GET /tasks/{task_id}/events`. A stream token or a staff session is accepted "
        "only with `stream=true`.",
        parameters=[
            RESPONSE_ID,
            OpenApiParameter(
                "stream",
                {"type": "string", "enum": ["true", "false"]},
                default="false",
                description="`true`: the events instead of the object (anything but `true`/`false` is `400`).",
            ),
            LAST_EVENT_ID,
            STARTING_AFTER,
        ],
        request=None,
        responses={
            (200, "application/json"): OpenApiResponse(ResponseSchema, description="`stream=false`."),
            (200, EVENT_STREAM_MEDIA_TYPE): EVENT_STREAM,
            204: STREAM_FINISHED,
        },
        problems=[exc.InvalidRequest, exc.ResponseNotFound, exc.EventHistoryExpired, exc.TooManyStreams],
    )
    def get(self, request: Any, response_id: str) -> None:
        """Schema only."""

    @operation(
        operation_id="responses_delete",
        summary="Delete a finished response",
        description="Extension: removes the response with its task and events (what the openai package's "
        "`responses.delete` calls). A response that has not ended is `409`: cancel it first.",
        parameters=[RESPONSE_ID],
        request=None,
        responses={200: DeletedResponseSchema},
        problems=[exc.ResponseNotFound, exc.ResponseNotFinished, exc.DatabaseBusy],
    )
    def delete(self, request: Any, response_id: str) -> None:
        """Schema only."""


class ResponseCancelOperations(APIView):
    """``tasks_app.openai.responses.stream_views.response_cancel`` (with ``views.ResponseCancelView``) as the
    schema shows it."""

    scopes_by_method = {"POST": ("responses",)}

    @operation(
        operation_id="responses_cancel",
        summary="Cancel a response",
        description="Extension (OpenAI's `responses.cancel`): cancels the response's task through the "
        "lifecycle. A queued one is `cancelled` at once; a running one stops within a decode step, and the "
        "answer waits for that a few seconds (`LMSP_RESPONSE_CANCEL_WAIT_SECONDS`), so it usually shows "
        "`cancelled`. A second cancel answers the cancelled response again; one that ended otherwise is `409`.",
        parameters=[RESPONSE_ID],
        request=None,
        responses={200: ResponseSchema},
        problems=[exc.ResponseNotFound, exc.TaskNotCancelable, exc.DatabaseBusy],
    )
    def post(self, request: Any, response_id: str) -> None:
        """Schema only."""


class ChatCompletionsOperations(APIView):
    """``chat_completions_views.chat_completions_create`` as the schema shows it."""

    scopes_by_method = {"POST": ("responses",)}

    @operation(
        operation_id="chat_completions_create",
        summary="Create a chat completion (OpenAI's Chat Completions)",
        description="Extension (PROFILE.md 10.3): the request runs as a response task on the same workers "
        "(listed by `GET /tasks`; `chatcmpl-X` is `resp_X`), not stored for `previous_response_id`. "
        "`stream: false` waits and answers the `chat.completion`; `stream: true` answers "
        "`data: {chat.completion.chunk}` lines (the first carries the role, then content deltas, one with "
        "`finish_reason`, with `stream_options.include_usage` one with `usage` and no choices, or a "
        '`data: {"error": ...}` line for a failure), then `data: [DONE]`. A client that disconnects '
        "cancels the generation. What a field asks for that this service cannot do is "
        "`400 unsupported_parameter` naming the field (`n` > 1, `store: true`, `logprobs`, "
        "image or audio parts, ...). Function tools come back as `message.tool_calls` "
        "(streamed as `delta.tool_calls` fragments) with `finish_reason: tool_calls`. "
        "`Idempotency-Key` is refused: retries that must not run twice use `POST /responses`.",
        request=ChatCompletionRequestSerializer,
        responses={
            (200, "application/json"): OpenApiResponse(ChatCompletionSchema, description="`stream: false`."),
            (200, EVENT_STREAM_MEDIA_TYPE): CHAT_STREAM,
        },
        problems=[
            exc.InvalidRequest,
            exc.UnsupportedParameter,
            exc.ModelNotFound,
            exc.ContextLengthExceeded,
            exc.ResponseCancelled,
            exc.QueueFull,
            exc.DatabaseBusy,
            exc.TooManyStreams,
            exc.BackendError,
            exc.ModelLoadFailed,
            exc.ServerRestarted,
        ],
    )
    def post(self, request: Any) -> None:
        """Schema only."""


_STAND_INS: dict[Callable[..., Any], Callable[..., Any]] = {
    task_stream_views.task_events: TaskEventsOperations.as_view(),
    response_stream_views.responses_create: ResponsesOperations.as_view(),
    response_stream_views.response_detail: ResponseDetailOperations.as_view(),
    response_stream_views.response_cancel: ResponseCancelOperations.as_view(),
    chat_completions_views.chat_completions_create: ChatCompletionsOperations.as_view(),
    # The async view's synchronous half, which carries the schema annotation.
    anthropic_views.messages_create: anthropic_views.MessageCreateView.as_view(),
    ollama_views.chat: ollama_views.ChatView.as_view(),
    ollama_views.generate: ollama_views.GenerateView.as_view(),
    ollama_pull.pull: ollama_pull.PullView.as_view(),
}


def documented_view(callback: Callable[..., Any]) -> Callable[..., Any]:
    """The DRF view the schema documents for a URL pattern's callback."""
    return _STAND_INS.get(callback, callback)
