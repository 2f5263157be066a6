"""CORS for the read-only event streams, so a browser app on another origin can use a stream token.

Only the two GET routes that accept ``?token=`` take part: a task's events
and a response's events (``?stream=true``). For an origin listed in
``LMSP_CORS_ORIGINS`` a preflight is answered here (``204``) and every
answer of those routes names the origin; any other origin, route or method
gets no CORS header, exactly as before. Credentials are never allowed: the
stream token in the URL is the only way in that a cross-origin page has.

The middleware only sets headers on the response object the view returns,
before anything is sent; an event stream's body is written later (by
``tasks_app.edge.sse``) and is never touched here.
"""

from __future__ import annotations

from django.conf import settings
from django.http import HttpRequest, HttpResponse
from django.urls import Resolver404, resolve
from django.utils.cache import patch_vary_headers

from tasks_app.edge.middleware_base import SyncAndAsyncMiddleware

# Route names (tasks_app/api/urls.py) of the stream endpoints, and whether
# the route streams only with ``?stream=true``.
_STREAM_ROUTES = {"task-events": False, "response-detail": True}
ALLOWED_METHODS = "GET"
# What a browser's EventSource adds when it reconnects.
ALLOWED_HEADERS = "Last-Event-ID"
PREFLIGHT_MAX_AGE_SECONDS = 600


def _is_stream_route(request: HttpRequest) -> bool:
    try:
        match = resolve(request.path_info)
    except Resolver404:
        return False
    if match.url_name not in _STREAM_ROUTES:
        return False
    return not _STREAM_ROUTES[match.url_name] or request.GET.get("stream", "").lower() == "true"


def cors_origin(request: HttpRequest) -> str | None:
    """The request's ``Origin`` when CORS applies to it: a configured origin, on a stream route."""
    allowed = settings.LMSP_CORS_ORIGINS
    origin = request.META.get("HTTP_ORIGIN", "").strip()
    if not allowed or not origin or request.method not in {"GET", "HEAD", "OPTIONS"}:
        return None
    if "*" not in allowed and origin.lower() not in allowed:
        return None
    return origin if _is_stream_route(request) else None


def _is_preflight(request: HttpRequest) -> bool:
    asked = request.META.get("HTTP_ACCESS_CONTROL_REQUEST_METHOD", "").upper()
    return request.method == "OPTIONS" and asked in {"GET", "HEAD"}


def _preflight_response(origin: str) -> HttpResponse:
    response = HttpResponse(status=204)
    response["Access-Control-Allow-Methods"] = ALLOWED_METHODS
    response["Access-Control-Allow-Headers"] = ALLOWED_HEADERS
    response["Access-Control-Max-Age"] = str(PREFLIGHT_MAX_AGE_SECONDS)
    return _allow(response, origin)


def _allow(response: HttpResponse, origin: str) -> HttpResponse:
    response["Access-Control-Allow-Origin"] = origin
    patch_vary_headers(response, ("Origin",))
    return response


class StreamCorsMiddleware(SyncAndAsyncMiddleware):
    """Answers preflights of the stream routes for allowed origins, and marks their answers for those origins."""

    def before(self, request: HttpRequest) -> HttpResponse | None:
        origin = cors_origin(request)
        return _preflight_response(origin) if origin is not None and _is_preflight(request) else None

    def after(self, request: HttpRequest, response: HttpResponse) -> HttpResponse:
        origin = cors_origin(request)
        return _allow(response, origin) if origin is not None else response
