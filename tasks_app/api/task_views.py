"""The views of ``/tasks`` (chapter 7): create, list, read, cancel, mint a stream token.

Thin: parse, call one service or selector, render. The task's event stream is
``stream_views.task_events``.
"""

from __future__ import annotations

from drf_spectacular.utils import OpenApiParameter, OpenApiResponse
from rest_framework.request import Request
from rest_framework.response import Response

from tasks_app import exceptions as exc
from tasks_app.api.pagination import list_body
from tasks_app.api.schema_annotations import IDEMPOTENCY_KEY, LOCATION, TASK_ID, idempotent_replayed, operation
from tasks_app.api.schema_components import StreamTokenSchema, TaskListSchema, TaskSchema
from tasks_app.api.task_serializers import (
    TASK_AFTER_SCHEMA,
    TASK_STATUS_SCHEMA,
    StreamTokenOutputSerializer,
    TaskCreateInputSerializer,
    TaskListQuerySerializer,
    TaskOutputSerializer,
)
from tasks_app.edge.scoped_views import READ, WRITE, ScopedAPIView, validated
from tasks_app.openai.conversations.translate import conversation_use
from tasks_app.openai.responses.translate import accepted_spec
from tasks_app.selectors import tasks as selectors
from tasks_app.services.idempotency import idempotency_key_validate, request_digest
from tasks_app.services.stream_tokens import stream_token_mint
from tasks_app.services.tasks import in_envelope, task_cancel, task_create
from tasks_app.states import TaskStatus


def _queue_positions(tasks) -> dict[str, int]:
    return selectors.task_queue_positions(task_ids=[task.id for task in tasks if task.status == TaskStatus.QUEUED])


class TaskCollectionView(ScopedAPIView):
    scopes_by_method = {"GET": READ, "POST": WRITE}

    @operation(
        operation_id="tasks_create",
        summary="Create a task",
        description="The task, its response and its `response.created` event (and the idempotency key) are "
        "committed in one transaction before the `202`. `on_restart: retry` requires an `Idempotency-Key`; "
        "`resume` is accepted only for a model with resumable snapshots. Unknown fields are refused by name.",
        parameters=[IDEMPOTENCY_KEY, LOCATION, idempotent_replayed(202)],
        request=TaskCreateInputSerializer,
        responses={202: OpenApiResponse(TaskSchema, description="Accepted and durable; also a key's replay.")},
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
            exc.IdempotencyKeyReused,
            exc.QueueFull,
            exc.DatabaseBusy,
        ],
    )
    def post(self, request: Request) -> Response:
        key = idempotency_key_validate(request.headers.get("Idempotency-Key"))
        with in_envelope("input", only=exc.UnsupportedParameter):
            # What the request inside refuses by name is named by its path in this body.
            data = validated(TaskCreateInputSerializer, request.data)
        with in_envelope("input"):
            spec = accepted_spec(data["input"])
        reply = task_create(
            conversation=conversation_use(data["input"]),
            client=request.user,
            request=data["input"],
            spec=spec,
            on_restart=data["on_restart"],
            idempotency_key=key,
            request_hash=request_digest(request.data) if key is not None else None,
        )
        headers = dict(reply.headers)
        if reply.replayed:
            headers["Idempotent-Replayed"] = "true"
        return Response(reply.body, status=reply.status, headers=headers)

    @operation(
        operation_id="tasks_list",
        summary="List tasks, newest first",
        description="The client's own tasks (`admin`: every client's). Unknown query parameters are refused.",
        parameters=[
            TaskListQuerySerializer,
            OpenApiParameter(
                "status",
                TASK_STATUS_SCHEMA,
                description=f"Only tasks in these states, comma-separated: {', '.join(TaskStatus.values)}.",
            ),
            OpenApiParameter(
                "after", TASK_AFTER_SCHEMA, description="A task id: the page after it (the last page's `last_id`)."
            ),
        ],
        request=None,
        responses={200: TaskListSchema},
        problems=[exc.InvalidRequest],
    )
    def get(self, request: Request) -> Response:
        query = validated(TaskListQuerySerializer, request.query_params.dict())
        page = selectors.task_list_visible(
            client=request.user, statuses=query.get("status"), after=query.get("after"), limit=query["limit"]
        )
        context = {"queue_positions": _queue_positions(page.items)}
        items = TaskOutputSerializer(page.items, many=True, context=context).data
        return Response(list_body(items, page.has_more))


class TaskDetailView(ScopedAPIView):
    scopes_by_method = {"GET": READ}

    @operation(
        operation_id="tasks_retrieve",
        summary="Read a task",
        parameters=[TASK_ID],
        request=None,
        responses={200: TaskSchema},
        problems=[exc.TaskNotFound],
    )
    def get(self, request: Request, task_id: str) -> Response:
        task = selectors.task_get_visible(client=request.user, task_id=task_id)
        return Response(TaskOutputSerializer(task, context={"queue_positions": _queue_positions([task])}).data)


class TaskStreamTokenView(ScopedAPIView):
    """Mints a read-only token for one task's event stream, for ``EventSource``'s URL."""

    scopes_by_method = {"POST": READ}

    @operation(
        operation_id="tasks_stream_token_create",
        summary="Mint a stream token for a task's events",
        description="A read-only token for this task's event stream, for `EventSource`, which cannot send "
        "an `Authorization` header. It expires after a few minutes and dies with the client's `read` scope.",
        parameters=[TASK_ID],
        request=None,
        responses={201: StreamTokenSchema},
        problems=[exc.TaskNotFound],
    )
    def post(self, request: Request, task_id: str) -> Response:
        task = selectors.task_get_visible(client=request.user, task_id=task_id)
        minted = stream_token_mint(client=request.user, task=task)
        return Response(StreamTokenOutputSerializer(minted).data, status=201)


class TaskCancelView(ScopedAPIView):
    scopes_by_method = {"POST": WRITE}

    @operation(
        operation_id="tasks_cancel",
        summary="Cancel a task",
        description="`queued` becomes `cancelled` at once; `loading` or `running` becomes `cancelling` until "
        "the backend stopped, then `cancelled`. Cancelling a `cancelling` or `cancelled` task answers it "
        "unchanged; a `succeeded` or `failed` one is `409`.",
        parameters=[TASK_ID],
        request=None,
        responses={200: TaskSchema},
        problems=[exc.TaskNotFound, exc.TaskNotCancelable, exc.DatabaseBusy],
    )
    def post(self, request: Request, task_id: str) -> Response:
        task = selectors.task_get_visible(client=request.user, task_id=task_id)
        task = task_cancel(task=task)
        return Response(TaskOutputSerializer(task, context={"queue_positions": _queue_positions([task])}).data)
