"""Who an ``/api/...`` request acts as: its bearer token, or (``LMSP_OLLAMA_ANONYMOUS``) a named client.

Ollama's own server takes no token, and some of its clients cannot send one
(docs/ollama.md). With ``LMSP_OLLAMA_ANONYMOUS`` naming a client, a request
from a loopback address without an ``Authorization`` header acts as that
client, with its scopes; from any other address, or with the setting empty
(the default), a token is required. A request with the header is
authenticated as every other request is: a bad token is a 401 whatever the
setting says.
"""

from __future__ import annotations

import ipaddress

from django.conf import settings
from django.http import HttpRequest
from rest_framework.request import Request

from tasks_app.edge.auth import BearerTokenAuthentication
from tasks_app.exceptions import Unauthorized
from tasks_app.models import Client


def is_loopback(address: str | None) -> bool:
    try:
        ip = ipaddress.ip_address(address or "")
    except ValueError:
        return False
    mapped = getattr(ip, "ipv4_mapped", None)
    return ip.is_loopback or (mapped is not None and mapped.is_loopback)


def anonymous_client(request: HttpRequest | Request) -> Client | None:
    """The client a header-less local request acts as, or None (a token is needed)."""
    name = settings.LMSP_OLLAMA_ANONYMOUS
    if not name or not is_loopback(request.META.get("REMOTE_ADDR")):
        return None
    client = Client.objects.filter(name=name, revoked_at__isnull=True).first()
    if client is None:
        # Said, not hidden behind a plain 401: the operator named a client that is not there.
        raise Unauthorized(f"LMSP_OLLAMA_ANONYMOUS names {name!r}, which is no client with an unrevoked token")
    return client


class OllamaAuthentication(BearerTokenAuthentication):
    """``Authorization: Bearer <token>``, else the anonymous client of a local request (module docstring)."""

    def authenticate(self, request: Request | HttpRequest) -> tuple[Client, str | None] | None:
        if request.META.get("HTTP_AUTHORIZATION"):
            return super().authenticate(request)
        client = anonymous_client(request)
        return None if client is None else (client, None)


def ollama_client(request: HttpRequest) -> Client | None:
    """The client a plain Django request acts as (before a view runs), or None."""
    found = OllamaAuthentication().authenticate(request)
    return None if found is None else found[0]
