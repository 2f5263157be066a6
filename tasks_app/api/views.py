"""Thin API views: parse, call one service or selector, render."""

from __future__ import annotations

from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.throttling import AnonRateThrottle
from rest_framework.views import APIView

from tasks_app import selectors
from tasks_app.api.serializers import (
    ClientOutputSerializer,
    ListQuerySerializer,
    ModelOutputSerializer,
    PairInputSerializer,
    ResponseOutputSerializer,
    ResponseRequestSerializer,
    StreamTokenOutputSerializer,
    TaskCreateInputSerializer,
    TaskListQuerySerializer,
    TaskOutputSerializer,
    list_body,
)
from tasks_app.services.capabilities import capabilities_describe
from tasks_app.services.clients import pairing_code_redeem
from tasks_app.services.idempotency import idempotency_key_validate, request_digest
from tasks_app.services.responses import response_start
from tasks_app.services.stream_tokens import stream_token_mint
from tasks_app.services.tasks import task_cancel, task_create

READ = ("read",)
WRITE = ("responses",)


class ScopedAPIView(APIView):
    """``required_scopes`` per HTTP method; ``None`` marks a public method."""

    scopes_by_method: dict[str, tuple[str, ...] | None] = {}

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


def _validated(serializer_class, data):
    serializer = serializer_class(data=data)
    serializer.is_valid(raise_exception=True)
    return serializer.validated_data


class TaskCollectionView(ScopedAPIView):
    scopes_by_method = {"GET": READ, "POST": WRITE}

    def post(self, request: Request) -> Response:
        key = idempotency_key_validate(request.headers.get("Idempotency-Key"))
        data = _validated(TaskCreateInputSerializer, request.data)
        reply = task_create(
            client=request.user,
            request=data["input"],
            on_restart=data["on_restart"],
            idempotency_key=key,
            request_hash=request_digest(request.data) if key is not None else None,
        )
        headers = dict(reply.headers)
        if reply.replayed:
            headers["Idempotent-Replayed"] = "true"
        return Response(reply.body, status=reply.status, headers=headers)

    def get(self, request: Request) -> Response:
        query = _validated(TaskListQuerySerializer, request.query_params.dict())
        page = selectors.task_list_visible(
            client=request.user, statuses=query.get("status"), after=query.get("after"), limit=query["limit"]
        )
        items = TaskOutputSerializer(page.items, many=True).data
        return Response(list_body(items, page.has_more))


class TaskDetailView(ScopedAPIView):
    scopes_by_method = {"GET": READ}

    def get(self, request: Request, task_id: str) -> Response:
        task = selectors.task_get_visible(client=request.user, task_id=task_id)
        return Response(TaskOutputSerializer(task).data)


class TaskStreamTokenView(ScopedAPIView):
    """Mints a read-only token for one task's event stream, for ``EventSource``'s URL."""

    scopes_by_method = {"POST": READ}

    def post(self, request: Request, task_id: str) -> Response:
        task = selectors.task_get_visible(client=request.user, task_id=task_id)
        minted = stream_token_mint(client=request.user, task=task)
        return Response(StreamTokenOutputSerializer(minted).data, status=201)


class TaskCancelView(ScopedAPIView):
    scopes_by_method = {"POST": WRITE}

    def post(self, request: Request, task_id: str) -> Response:
        task = selectors.task_get_visible(client=request.user, task_id=task_id)
        task = task_cancel(task=task)
        return Response(TaskOutputSerializer(task).data)


class ResponseCreateView(ScopedAPIView):
    """The synchronous half of ``POST /responses``: validate and accept.

    Answers a replay or an error itself; for a task to wait on or stream it
    answers a bare 202 carrying ``lmsp_started``, which the async
    ``responses_create`` then serves.
    """

    scopes_by_method = {"POST": WRITE}

    def post(self, request: Request) -> Response:
        key = idempotency_key_validate(request.headers.get("Idempotency-Key"))
        data = _validated(ResponseRequestSerializer, request.data)
        started = response_start(
            client=request.user,
            request=data,
            idempotency_key=key,
            request_hash=request_digest(request.data) if key is not None else None,
            stream=bool(data.get("stream")),
        )
        if started.replay is not None:
            reply = started.replay
            return Response(reply.body, status=reply.status, headers={**reply.headers, "Idempotent-Replayed": "true"})
        response = Response(status=202)
        response.lmsp_started = started
        return response


class ResponseDetailView(ScopedAPIView):
    scopes_by_method = {"GET": READ}

    def get(self, request: Request, response_id: str) -> Response:
        response = selectors.response_get_visible(client=request.user, response_id=response_id)
        return Response(ResponseOutputSerializer(response).data)


class CapabilitiesView(ScopedAPIView):
    scopes_by_method = {"GET": None}
    authentication_classes: list = []

    def get(self, request: Request) -> Response:
        return Response(capabilities_describe())


class ModelListView(ScopedAPIView):
    scopes_by_method = {"GET": READ}

    def get(self, request: Request) -> Response:
        query = _validated(ListQuerySerializer, request.query_params.dict())
        page = selectors.model_list(after=query.get("after"), limit=query["limit"])
        return Response(list_body(ModelOutputSerializer(page.items, many=True).data, page.has_more))


class PairThrottle(AnonRateThrottle):
    scope = "pair"


class PairView(ScopedAPIView):
    scopes_by_method = {"POST": None}
    authentication_classes: list = []
    throttle_classes = [PairThrottle]

    def post(self, request: Request) -> Response:
        data = _validated(PairInputSerializer, request.data)
        client, token = pairing_code_redeem(code=data["code"], client_name=data["client_name"])
        return Response(ClientOutputSerializer((client, token)).data, status=201)
