"""Bearer-token authentication and scopes (PROFILE.md section 1)."""

from __future__ import annotations

import hmac

from rest_framework.authentication import BaseAuthentication
from rest_framework.permissions import BasePermission
from rest_framework.request import Request

from tasks_app.exceptions import InsufficientScope, Unauthorized
from tasks_app.models import Client
from tasks_app.services.clients import client_touch, token_digest


class BearerTokenAuthentication(BaseAuthentication):
    """``Authorization: Bearer <token>``; only the token's SHA-256 is stored.

    The row is found by the hash (a hash reveals nothing about a token it did
    not come from), then the hashes are compared in constant time anyway.
    """

    def authenticate(self, request: Request) -> tuple[Client, str] | None:
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
        return client, token

    def authenticate_header(self, request: Request) -> str:
        return 'Bearer realm="lmsp"'


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
