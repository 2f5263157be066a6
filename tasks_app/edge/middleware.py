"""Refuses oversized request bodies before any view reads them; a database that is away is a 503."""

from __future__ import annotations

import io

from django.conf import settings
from django.http import HttpRequest, HttpResponse

from tasks_app.edge.middleware_base import SyncAndAsyncMiddleware
from tasks_app.edge.problems import problem_json_response
from tasks_app.exceptions import InvalidRequest, PayloadTooLarge
from tasks_app.plumbing.db_locks import unavailable_problem


class RequestSizeLimitMiddleware(SyncAndAsyncMiddleware):
    """413 for bodies over ``LMSP_MAX_REQUEST_BYTES``, declared or chunked.

    A chunked body has no Content-Length, and DRF would read it as empty; it
    is read here (at most limit + 1 bytes) and handed on with its length.
    ASGI spools the whole body before the view runs, so that read never
    blocks the event loop on the network.
    """

    def before(self, request: HttpRequest) -> HttpResponse | None:
        limit = settings.LMSP_MAX_REQUEST_BYTES
        raw = request.META.get("CONTENT_LENGTH") or ""
        if raw:
            try:
                length = int(raw)
            except ValueError:
                return problem_json_response(InvalidRequest("Content-Length is not a number"), request)
            if length > limit:
                return problem_json_response(PayloadTooLarge.over(limit), request)
        elif "chunked" in request.META.get("HTTP_TRANSFER_ENCODING", "").lower():
            body = request.read(limit + 1)
            if len(body) > limit:
                return problem_json_response(PayloadTooLarge.over(limit), request)
            request._stream = io.BytesIO(body)
            request._read_started = False
            request.META["CONTENT_LENGTH"] = str(len(body))
        return None


class DatabaseUnavailableMiddleware(SyncAndAsyncMiddleware):
    """``503 service_unavailable`` (``507`` for a full disk) with ``Retry-After`` when a view outside DRF (the
    admin, the event streams' openings, ``POST /responses``) met a database that is away, read-only, full or
    locked past the lock timeout (``tasks_app.plumbing.database_outages``).

    DRF views get the same answer from the API's exception handler. The
    failed statement's transaction wrote nothing, so the client may retry.
    """

    def process_exception(self, request: HttpRequest, exception: Exception) -> HttpResponse | None:
        problem = unavailable_problem(exception)
        return None if problem is None else problem_json_response(problem, request)
