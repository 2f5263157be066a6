"""The views of ``/models``: the registered models, listed and read."""

from __future__ import annotations

from drf_spectacular.utils import OpenApiParameter
from rest_framework.request import Request
from rest_framework.response import Response

from tasks_app import exceptions as exc
from tasks_app.api.model_serializers import MODEL_AFTER_SCHEMA, ModelOutputSerializer
from tasks_app.api.pagination import ListQuerySerializer, list_body
from tasks_app.api.schema_annotations import MODEL_ID, operation
from tasks_app.api.schema_components import ModelListSchema, ModelSchema
from tasks_app.edge.scoped_views import READ, ScopedAPIView, validated
from tasks_app.selectors import tasks as selectors


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
        query = validated(ListQuerySerializer, request.query_params.dict())
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
