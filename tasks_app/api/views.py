"""Thin API views: parse, call one service or selector, render."""

from __future__ import annotations

from drf_spectacular.utils import OpenApiParameter, OpenApiResponse
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from tasks_app import exceptions as exc
from tasks_app.api.schema_annotations import (
    IDEMPOTENCY_KEY,
    LOCATION,
    MODEL_ID,
    TASK_ID,
    idempotent_replayed,
    operation,
)
from tasks_app.api.schema_components import (
    CapabilitiesSchema,
    ModelListSchema,
    ModelSchema,
    PairedClientSchema,
    StreamTokenSchema,
    TaskListSchema,
    TaskSchema,
)
from tasks_app.api.serializers import (
    MODEL_AFTER_SCHEMA,
    TASK_AFTER_SCHEMA,
    TASK_STATUS_SCHEMA,
    ClientOutputSerializer,
    ListQuerySerializer,
    ModelOutputSerializer,
    PairInputSerializer,
    ResponseCreateInputSerializer,
    ResponseOutputSerializer,
    StreamTokenOutputSerializer,
    TaskCreateInputSerializer,
    TaskListQuerySerializer,
    TaskOutputSerializer,
    list_body,
    stream_cursor,
)
from tasks_app.edge.throttles import PairThrottle
from tasks_app.openai.responses.translate import accepted_spec
from tasks_app.selectors import tasks as selectors
from tasks_app.services.capabilities import capabilities_describe
from tasks_app.services.clients import pairing_code_redeem
from tasks_app.services.idempotency import idempotency_key_validate, request_digest
from tasks_app.services.responses import response_cancel, response_delete, response_start
from tasks_app.services.stream_tokens import stream_token_mint
from tasks_app.services.tasks import in_envelope, task_cancel, task_create
from tasks_app.states import TaskStatus

READ = ("read",)
WRITE = ("responses",)


class ScopedAPIView(APIView):
    """``required_scopes`` per HTTP method; ``None`` marks a public method."""

    scopes_by_method: dict[str, tuple[str, ...] | None] = {}

    @property
    def allowed_methods(self) -> list[str]:
        # DRF offers OPTIONS on every view, but without a metadata class it
        # answers 405: the ``Allow`` of every answer must not list it.
        return [method for method in super().allowed_methods if method != "OPTIONS"]

    @property
    def required_scopes(self) -> tuple[str, ...] | None:
        method = "GET" if self.request.method == "HEAD" else self.request.method
        if method in self.scopes_by_method:
            return self.scopes_by_method[method]
        # A method the view does not serve gets its 405 without a token; a
        # handler someone forgot to list still needs one.
        if method == "OPTIONS" or not hasattr(self, method.lower()):
            return None
        return ()


def _queue_positions(tasks) -> dict[str, int]:
    return selectors.task_queue_positions(task_ids=[task.id for task in tasks if task.status == TaskStatus.QUEUED])


def _validated(serializer_class, data):
    serializer = serializer_class(data=data)
    serializer.is_valid(raise_exception=True)
    return serializer.validated_data


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
            data = _validated(TaskCreateInputSerializer, request.data)
        with in_envelope("input"):
            spec = accepted_spec(data["input"])
        reply = task_create(
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
        query = _validated(TaskListQuerySerializer, request.query_params.dict())
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
        data = _validated(ResponseCreateInputSerializer, request.data)
        started = response_start(
            client=request.user,
            request=data,
            spec=accepted_spec(data),
            idempotency_key=key,
            request_hash=request_digest(request.data) if key is not None else None,
            stream=bool(data.get("stream")),
            background=data["background"],
            on_restart=data["on_restart"],
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


class CapabilitiesView(ScopedAPIView):
    scopes_by_method = {"GET": None}
    authentication_classes: list = []

    @operation(
        operation_id="capabilities_retrieve",
        summary="What this service can do",
        request=None,
        responses={200: CapabilitiesSchema},
    )
    def get(self, request: Request) -> Response:
        return Response(capabilities_describe())


class ModelListView(ScopedAPIView):
    scopes_by_method = {"GET": READ}

    @operation(
        operation_id="models_list",
        summary="List the registered models",
        description="Unknown query parameters are refused.",
        parameters=[
            ListQuerySerializer,
            OpenApiParameter(
                "after", MODEL_AFTER_SCHEMA, description="A model id: the page after it (the last page's `last_id`)."
            ),
        ],
        request=None,
        responses={200: ModelListSchema},
        problems=[exc.InvalidRequest],
    )
    def get(self, request: Request) -> Response:
        query = _validated(ListQuerySerializer, request.query_params.dict())
        page = selectors.model_list(after=query.get("after"), limit=query["limit"])
        return Response(list_body(ModelOutputSerializer(page.items, many=True).data, page.has_more))


class ModelDetailView(ScopedAPIView):
    scopes_by_method = {"GET": READ}

    @operation(
        operation_id="models_retrieve",
        summary="Read a registered model",
        description="One model object, as `GET /models` lists it (what the `openai` package's "
        "`models.retrieve` calls). An extension of LMSP 1.0.",
        parameters=[MODEL_ID],
        request=None,
        responses={200: ModelSchema},
        problems=[exc.ModelNotRegistered],
    )
    def get(self, request: Request, model_id: str) -> Response:
        return Response(ModelOutputSerializer(selectors.model_get(model_id=model_id)).data)


class PairView(ScopedAPIView):
    scopes_by_method = {"POST": None}
    authentication_classes: list = []
    throttle_classes = [PairThrottle]

    @operation(
        operation_id="pair_create",
        summary="Redeem a pairing code for a token",
        description="Trades a one-time code from `lmsp_pair` for a new client's token, shown this once. "
        "A used, expired, unknown or locked code, or a taken name, is `400`. Every wrong code counts "
        "against each pending code, which locks after a few; and requests are rate-limited per address.",
        request=PairInputSerializer,
        responses={201: PairedClientSchema},
        problems=[exc.InvalidRequest, exc.RateLimited, exc.RateLimitUnavailable],
    )
    def post(self, request: Request) -> Response:
        data = _validated(PairInputSerializer, request.data)
        client, token = pairing_code_redeem(code=data["code"], client_name=data["client_name"])
        return Response(ClientOutputSerializer((client, token)).data, status=201)
