"""Thin API views: parse, call one service or selector, render."""

from __future__ import annotations

import asyncio

from asgiref.sync import sync_to_async
from django.conf import settings
from django.http import HttpRequest, HttpResponse
from django.views.decorators.csrf import csrf_exempt
from rest_framework.renderers import JSONRenderer
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
    TaskCreateInputSerializer,
    TaskListQuerySerializer,
    TaskOutputSerializer,
    list_body,
)
from tasks_app.exceptions import UnsupportedCapability
from tasks_app.services.capabilities import capabilities_describe
from tasks_app.services.clients import pairing_code_redeem
from tasks_app.services.idempotency import idempotency_key_validate, request_digest
from tasks_app.services.responses import response_finish, response_start, response_task_finished
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


class TaskCancelView(ScopedAPIView):
    scopes_by_method = {"POST": WRITE}

    def post(self, request: Request, task_id: str) -> Response:
        task = selectors.task_get_visible(client=request.user, task_id=task_id)
        task = task_cancel(task=task)
        return Response(TaskOutputSerializer(task).data)


class ResponseCreateView(ScopedAPIView):
    """The synchronous half of ``POST /responses``: validate and accept.

    Answers a replay or an error itself; for a new task it answers a bare 202
    carrying ``lmsp_started``, which ``responses_create`` then waits on.
    """

    scopes_by_method = {"POST": WRITE}

    def post(self, request: Request) -> Response:
        key = idempotency_key_validate(request.headers.get("Idempotency-Key"))
        data = _validated(ResponseRequestSerializer, request.data)
        if data.get("stream"):
            raise UnsupportedCapability(
                "stream: true is not served yet; create a task and poll it",
                errors=[{"field": "stream", "message": "streaming responses are not available"}],
            )
        started = response_start(
            client=request.user,
            request=data,
            idempotency_key=key,
            request_hash=request_digest(request.data) if key is not None else None,
        )
        if started.replay is not None:
            reply = started.replay
            return Response(reply.body, status=reply.status, headers={**reply.headers, "Idempotent-Replayed": "true"})
        response = Response(status=202)
        response.lmsp_started = started
        return response


_response_create = ResponseCreateView.as_view()


def _accept_response(request: HttpRequest) -> HttpResponse:
    response = _response_create(request)
    response.render()
    return response


@csrf_exempt
async def responses_create(request: HttpRequest) -> HttpResponse:
    """``POST /responses`` (stream=false): accept as a task, wait for it to end, answer its response.

    Async so that a long generation holds no thread while it waits: the
    database is polled with a growing interval (a wake-up from Redis can
    only shorten it, so nothing is lost if Redis is down).
    """
    response = await sync_to_async(_accept_response)(request)
    started = getattr(response, "lmsp_started", None)
    if started is None:
        return response
    delay, ceiling = 0.01, settings.LMSP_SYNC_POLL_MS / 1000
    while not await sync_to_async(response_task_finished)(task_id=started.task_id):
        await asyncio.sleep(delay)
        delay = min(delay * 2, ceiling)
    reply = await sync_to_async(response_finish)(
        task_id=started.task_id, idempotency_record_id=started.idempotency_record_id
    )
    return HttpResponse(JSONRenderer().render(reply.body), status=reply.status, content_type="application/json")


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
