"""Refuses oversized request bodies before any view reads them."""

from __future__ import annotations

import io
from collections.abc import Callable

from django.conf import settings
from django.http import HttpRequest, HttpResponse

from tasks_app.api.problems import problem_json_response
from tasks_app.exceptions import InvalidRequest, PayloadTooLarge


class RequestSizeLimitMiddleware:
    """413 for bodies over ``LMSP_MAX_REQUEST_BYTES``, declared or chunked.

    A chunked body has no Content-Length, and DRF would read it as empty; it
    is read here (at most limit + 1 bytes) and handed on with its length.
    """

    def __init__(self, get_response: Callable[[HttpRequest], HttpResponse]) -> None:
        self.get_response = get_response

    def __call__(self, request: HttpRequest) -> HttpResponse:
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
        return self.get_response(request)
