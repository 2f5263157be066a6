"""The synchronous halves of ``/responses`` (PROFILE.md section 3): parse, call one service or selector, render.

The routes lead to the async views of ``stream_views``, which call these and
then serve what was started (a stream, or a wait for the task's end).
"""

from __future__ import annotations

from rest_framework.request import Request
from rest_framework.response import Response

from tasks_app.edge.scoped_views import READ, WRITE, ScopedAPIView, validated
from tasks_app.edge.stream_cursor import stream_cursor
from tasks_app.openai.conversations.translate import conversation_use
from tasks_app.openai.responses.serializers import ResponseCreateInputSerializer, ResponseOutputSerializer
from tasks_app.openai.responses.translate import accepted_spec
from tasks_app.selectors import tasks as selectors
from tasks_app.services.idempotency import idempotency_key_validate, request_digest
from tasks_app.services.responses import response_cancel, response_delete, response_start


class ResponseCreateView(ScopedAPIView):
    """The synchronous half of ``POST /responses``: validate and accept.

    Answers a replay or an error itself; for a task to wait on or stream it
    answers a bare 202 carrying ``lmsp_started``, which the async
    ``responses_create`` then serves.
    """

    scopes_by_method = {"POST": WRITE}

    def post(self, request: Request) -> Response:
        key = idempotency_key_validate(request.headers.get("Idempotency-Key"))
        # Only a streamed retry reads the cursor, but a malformed one is refused on every request,
        # before anything is written, rather than silently ignored.
        stream_cursor(request)
        data = validated(ResponseCreateInputSerializer, request.data)
        started = response_start(
            client=request.user,
            request=data,
            spec=accepted_spec(data),
            idempotency_key=key,
            request_hash=request_digest(request.data) if key is not None else None,
            stream=bool(data.get("stream")),
            background=data["background"],
            on_restart=data["on_restart"],
            conversation=conversation_use(data),
        )
        if started.replay is not None:
            reply = started.replay
            return Response(reply.body, status=reply.status, headers={**reply.headers, "Idempotent-Replayed": "true"})
        if started.answer is not None:
            return Response(started.answer.body, status=started.answer.status)
        response = Response(status=202)
        response.lmsp_started = started
        return response


class ResponseDetailView(ScopedAPIView):
    """The plain half of ``/responses/{id}`` (documented by ``schema_stand_ins``): read, delete."""

    scopes_by_method = {"GET": READ, "DELETE": WRITE}

    def get(self, request: Request, response_id: str) -> Response:
        # The object ignores a cursor, but a malformed one is refused here as on the stream.
        stream_cursor(request)
        read = selectors.response_read_visible(client=request.user, response_id=response_id)
        return Response(ResponseOutputSerializer(read).data)

    def delete(self, request: Request, response_id: str) -> Response:
        response = selectors.response_get_visible(client=request.user, response_id=response_id)
        response_delete(response=response)
        return Response({"id": response_id, "object": "response", "deleted": True})


class ResponseCancelView(ScopedAPIView):
    """The synchronous half of ``POST /responses/{id}/cancel``: the move.

    A task left ``cancelling`` carries ``lmsp_cancelling``: the async
    ``stream_views.response_cancel`` waits a moment for the worker to finish
    the move, so the answer is usually the cancelled response.
    """

    scopes_by_method = {"POST": WRITE}

    def post(self, request: Request, response_id: str) -> Response:
        response = selectors.response_get_visible(client=request.user, response_id=response_id)
        task = response_cancel(response=response)
        answer = Response(status=200)
        answer.lmsp_cancelled = (response.pk, task.id, task.status)
        return answer
