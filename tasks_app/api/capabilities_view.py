"""``GET /capabilities``: what this service can do (public)."""

from __future__ import annotations

from rest_framework.request import Request
from rest_framework.response import Response

from tasks_app.api.schema_annotations import operation
from tasks_app.api.schema_components import CapabilitiesSchema
from tasks_app.edge.scoped_views import ScopedAPIView
from tasks_app.services.capabilities import capabilities_describe


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
