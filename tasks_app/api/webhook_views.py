"""Thin views of the webhook endpoints (docs/webhooks.md): the shapes of the openai package's ``webhooks``.

``client.webhooks.create/list/retrieve/update/delete/rotate_secret/test``
and ``client.webhooks.event_types.list`` with ``base_url=<server>/lmsp/v1``
call these. Endpoints are the client's own:
another client's id is ``404 webhook_endpoint_not_found``.
"""

from __future__ import annotations

from drf_spectacular.utils import OpenApiParameter, OpenApiResponse
from rest_framework.request import Request
from rest_framework.response import Response

from tasks_app import exceptions as exc
from tasks_app.api.pagination import list_body
from tasks_app.api.schema_annotations import operation
from tasks_app.api.webhook_serializers import (
    WEBHOOK_ENDPOINT_AFTER_SCHEMA,
    DeletedWebhookEndpointSchema,
    WebhookEndpointCreateInputSerializer,
    WebhookEndpointListQuerySerializer,
    WebhookEndpointListSchema,
    WebhookEndpointOutputSerializer,
    WebhookEndpointSchema,
    WebhookEndpointTestInputSerializer,
    WebhookEndpointTestResultSchema,
    WebhookEndpointUpdateInputSerializer,
    WebhookEndpointWithSecretOutputSerializer,
    WebhookEndpointWithSecretSchema,
    WebhookEventTypeListSchema,
    WebhookSecretRotateInputSerializer,
    webhook_endpoint_deleted,
    webhook_endpoint_test_result,
    webhook_event_type_list,
)
from tasks_app.edge.scoped_views import READ, WRITE, ScopedAPIView, validated
from tasks_app.selectors.webhooks import webhook_endpoint_get_own, webhook_endpoint_list_own
from tasks_app.services.webhooks import (
    webhook_endpoint_create,
    webhook_endpoint_delete,
    webhook_endpoint_rotate_secret,
    webhook_endpoint_test,
    webhook_endpoint_update,
)

WEBHOOK_ENDPOINT_ID = OpenApiParameter("webhook_endpoint_id", str, OpenApiParameter.PATH, description="`whep_` + ULID.")
_WRITES = (exc.DatabaseBusy,)


class WebhookEndpointCollectionView(ScopedAPIView):
    scopes_by_method = {"GET": READ, "POST": WRITE}

    @operation(
        operation_id="webhook_endpoints_create",
        summary="Register a webhook endpoint",
        description="The client's tasks and background responses that end with one of `event_types` are POSTed "
        "to `url`, signed in the Standard Webhooks scheme with `signing_secret`, which only this reply (and "
        "`rotate_secret`'s) shows. An extension of LMSP 1.0 (docs/webhooks.md).",
        request=WebhookEndpointCreateInputSerializer,
        responses={201: OpenApiResponse(WebhookEndpointWithSecretSchema, description="Registered.")},
        problems=[exc.InvalidRequest, *_WRITES],
    )
    def post(self, request: Request) -> Response:
        data = validated(WebhookEndpointCreateInputSerializer, request.data)
        endpoint = webhook_endpoint_create(
            client=request.user, name=data["name"], url=data["url"], event_types=data["event_types"]
        )
        return Response(WebhookEndpointWithSecretOutputSerializer(endpoint).data, status=201)

    @operation(
        operation_id="webhook_endpoints_list",
        summary="List the client's webhook endpoints, newest first",
        description="Unknown query parameters are refused.",
        parameters=[
            WebhookEndpointListQuerySerializer,
            OpenApiParameter(
                "after",
                WEBHOOK_ENDPOINT_AFTER_SCHEMA,
                description="An endpoint id: the page after it (the last page's `last_id`).",
            ),
        ],
        request=None,
        responses={200: WebhookEndpointListSchema},
        problems=[exc.InvalidRequest],
    )
    def get(self, request: Request) -> Response:
        query = validated(WebhookEndpointListQuerySerializer, request.query_params.dict())
        page = webhook_endpoint_list_own(client=request.user, after=query.get("after"), limit=query["limit"])
        return Response(list_body(WebhookEndpointOutputSerializer(page.items, many=True).data, page.has_more))


class WebhookEndpointDetailView(ScopedAPIView):
    scopes_by_method = {"GET": READ, "POST": WRITE, "DELETE": WRITE}

    @operation(
        operation_id="webhook_endpoints_retrieve",
        summary="Read a webhook endpoint",
        parameters=[WEBHOOK_ENDPOINT_ID],
        request=None,
        responses={200: WebhookEndpointSchema},
        problems=[exc.WebhookEndpointNotFound],
    )
    def get(self, request: Request, webhook_endpoint_id: str) -> Response:
        endpoint = webhook_endpoint_get_own(client=request.user, endpoint_id=webhook_endpoint_id)
        return Response(WebhookEndpointOutputSerializer(endpoint).data)

    @operation(
        operation_id="webhook_endpoints_update",
        summary="Change a webhook endpoint's name, URL or event types",
        description="Fields left out stay as they are. Deliveries already waiting go to the endpoint as it is "
        "when they are sent.",
        parameters=[WEBHOOK_ENDPOINT_ID],
        request=WebhookEndpointUpdateInputSerializer,
        responses={200: WebhookEndpointSchema},
        problems=[exc.InvalidRequest, exc.WebhookEndpointNotFound, *_WRITES],
    )
    def post(self, request: Request, webhook_endpoint_id: str) -> Response:
        endpoint = webhook_endpoint_get_own(client=request.user, endpoint_id=webhook_endpoint_id)
        data = validated(WebhookEndpointUpdateInputSerializer, request.data)
        endpoint = webhook_endpoint_update(
            endpoint=endpoint, name=data.get("name"), url=data.get("url"), event_types=data.get("event_types")
        )
        return Response(WebhookEndpointOutputSerializer(endpoint).data)

    @operation(
        operation_id="webhook_endpoints_delete",
        summary="Delete a webhook endpoint",
        description="With its deliveries, those still waiting included: nothing more is sent to it.",
        parameters=[WEBHOOK_ENDPOINT_ID],
        request=None,
        responses={200: DeletedWebhookEndpointSchema},
        problems=[exc.WebhookEndpointNotFound, *_WRITES],
    )
    def delete(self, request: Request, webhook_endpoint_id: str) -> Response:
        endpoint = webhook_endpoint_get_own(client=request.user, endpoint_id=webhook_endpoint_id)
        webhook_endpoint_delete(endpoint=endpoint)
        return Response(webhook_endpoint_deleted(webhook_endpoint_id))


class WebhookEndpointRotateView(ScopedAPIView):
    scopes_by_method = {"POST": WRITE}

    @operation(
        operation_id="webhook_endpoints_rotate_secret",
        summary="Rotate a webhook endpoint's signing secret",
        description="A new secret, shown in this reply only; deliveries from now on are signed with it.",
        parameters=[WEBHOOK_ENDPOINT_ID],
        request=WebhookSecretRotateInputSerializer,
        responses={200: WebhookEndpointWithSecretSchema},
        problems=[exc.InvalidRequest, exc.WebhookEndpointNotFound, *_WRITES],
    )
    def post(self, request: Request, webhook_endpoint_id: str) -> Response:
        endpoint = webhook_endpoint_get_own(client=request.user, endpoint_id=webhook_endpoint_id)
        data = validated(WebhookSecretRotateInputSerializer, request.data)
        endpoint = webhook_endpoint_rotate_secret(
            endpoint=endpoint, keep_previous=data["keep_old_secret_active_for_24_hours"]
        )
        return Response(WebhookEndpointWithSecretOutputSerializer(endpoint).data)


class WebhookEndpointTestView(ScopedAPIView):
    scopes_by_method = {"POST": WRITE}

    @operation(
        operation_id="webhook_endpoints_test",
        summary="Send a sample event to a webhook endpoint",
        description="One signed POST of a sample `event_type` event (naming a response and a task that do not "
        "exist), sent now and answered with the status the endpoint gave; not stored, not retried. No answer "
        "at all (a refused target, the network, the timeout) is `502 webhook_test_failed`.",
        parameters=[WEBHOOK_ENDPOINT_ID],
        request=WebhookEndpointTestInputSerializer,
        responses={200: WebhookEndpointTestResultSchema},
        problems=[exc.InvalidRequest, exc.WebhookEndpointNotFound, exc.WebhookTestFailed],
    )
    def post(self, request: Request, webhook_endpoint_id: str) -> Response:
        endpoint = webhook_endpoint_get_own(client=request.user, endpoint_id=webhook_endpoint_id)
        data = validated(WebhookEndpointTestInputSerializer, request.data)
        event_type = data["event_type"]
        status_code = webhook_endpoint_test(endpoint=endpoint, event_type=event_type)
        result = webhook_endpoint_test_result(endpoint_id=endpoint.id, event_type=event_type, status_code=status_code)
        return Response(result)


class WebhookEventTypeListView(ScopedAPIView):
    scopes_by_method = {"GET": READ}

    @operation(
        operation_id="webhook_event_types_list",
        summary="The event types an endpoint can subscribe to",
        request=None,
        responses={200: WebhookEventTypeListSchema},
        problems=[],
    )
    def get(self, request: Request) -> Response:
        return Response(webhook_event_type_list())
