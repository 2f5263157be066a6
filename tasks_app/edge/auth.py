"""Bearer-token authentication and scopes (PROFILE.md section 1)."""

from __future__ import annotations

import hmac

from django.contrib.auth import get_user
from django.http import HttpRequest
from rest_framework.authentication import BaseAuthentication
from rest_framework.permissions import BasePermission
from rest_framework.request import Request

from tasks_app.exceptions import InsufficientScope, Unauthorized
from tasks_app.models import Client
from tasks_app.selectors.tasks import StreamReader
from tasks_app.services.clients import client_touch, token_digest
from tasks_app.services.stream_tokens import stream_token_verify


class BearerTokenAuthentication(BaseAuthentication):
    """``Authorization: Bearer <token>``; only the token's SHA-256 is stored (``token_client``)."""

    def authenticate(self, request: Request | HttpRequest) -> tuple[Client, str] | None:
        header = request.META.get("HTTP_AUTHORIZATION", "")
        if not header:
            return None
        scheme, _, token = header.partition(" ")
        token = token.strip()
        if scheme.lower() != "bearer" or not token or " " in token:
            raise Unauthorized(
                "Malformed Authorization header; use 'Bearer <token>'",
                headers={"WWW-Authenticate": 'Bearer realm="lmsp", error="invalid_request"'},
            )
        return token_client(token), token

    def authenticate_header(self, request: Request) -> str:
        return 'Bearer realm="lmsp"'


def token_client(token: str) -> Client:
    """The client a token belongs to, however it came (a bearer token, another protocol's key header).

    The row is found by the hash (a hash reveals nothing about a token it did
    not come from), then the hashes are compared in constant time anyway.
    """
    digest = token_digest(token)
    client = Client.objects.filter(token_hash=digest).first()
    if client is None or not hmac.compare_digest(client.token_hash, digest):
        raise Unauthorized(
            "The token is not valid", headers={"WWW-Authenticate": 'Bearer realm="lmsp", error="invalid_token"'}
        )
    if client.revoked_at is not None:
        raise Unauthorized(
            "The token was revoked",
            headers={"WWW-Authenticate": 'Bearer realm="lmsp", error="invalid_token"'},
        )
    client_touch(client=client)
    return client


class HasRequiredScopes(BasePermission):
    """Views name ``required_scopes``; ``admin`` implies every scope.

    A view with ``required_scopes = None`` is public.
    """

    def has_permission(self, request: Request, view) -> bool:
        required = getattr(view, "required_scopes", ())
        if required is None:
            return True
        client = request.user
        if not isinstance(client, Client):
            raise Unauthorized("An 'Authorization: Bearer <token>' header is required")
        missing = [scope for scope in required if not client.has_scope(scope)]
        if missing:
            raise InsufficientScope(f"This endpoint needs the scope {', '.join(missing)!s}")
        return True


def stream_reader_authenticate(request: HttpRequest) -> StreamReader:
    """The event-stream endpoints' three ways in (PROFILE.md section 1), in this order.

    ``Authorization: Bearer`` with ``read`` scope; ``?token=`` (a stream
    token); a logged-in, active Django staff session. A bearer token is never
    accepted from the URL.
    """
    if request.META.get("HTTP_AUTHORIZATION"):
        client, _ = BearerTokenAuthentication().authenticate(request)
        # As DRF does for its views: the access log names the client.
        request.user = client
        if not client.has_scope("read"):
            raise InsufficientScope("This endpoint needs the scope read")
        return StreamReader(client=client)
    token = request.GET.get("token")
    if token is not None:
        grant = stream_token_verify(token=token)
        request.user = grant.client
        return StreamReader(client=grant.client, only_task_id=grant.task_id)
    user = get_user(request)
    if user.is_active and user.is_staff:
        return StreamReader(staff=True)
    raise Unauthorized(
        "An 'Authorization: Bearer <token>' header, a stream token (?token=) or a staff session is required"
    )
