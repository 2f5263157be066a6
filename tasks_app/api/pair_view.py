"""``POST /pair``: a pairing code traded for a new client's token (PROFILE.md section 1)."""

from __future__ import annotations

from rest_framework.request import Request
from rest_framework.response import Response

from tasks_app import exceptions as exc
from tasks_app.api.pair_serializers import ClientOutputSerializer, PairInputSerializer
from tasks_app.api.schema_annotations import operation
from tasks_app.api.schema_components import PairedClientSchema
from tasks_app.edge.scoped_views import ScopedAPIView, validated
from tasks_app.edge.throttles import PairThrottle
from tasks_app.services.clients import pairing_code_redeem


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
        data = validated(PairInputSerializer, request.data)
        client, token = pairing_code_redeem(code=data["code"], client_name=data["client_name"])
        return Response(ClientOutputSerializer((client, token)).data, status=201)
