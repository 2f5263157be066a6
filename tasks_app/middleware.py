"""Refuses oversized request bodies before any view reads them."""

from __future__ import annotations

from collections.abc import Callable

from django.conf import settings
from django.http import HttpRequest, HttpResponse

from tasks_app.api.problems import problem_json_response
from tasks_app.exceptions import InvalidRequest, PayloadTooLarge


class RequestSizeLimitMiddleware:
    def __init__(self, get_response: Callable[[HttpRequest], HttpResponse]) -> None:
        self.get_response = get_response

    def __call__(self, request: HttpRequest) -> HttpResponse:
        raw = request.META.get("CONTENT_LENGTH") or "0"
        try:
            length = int(raw)
        except ValueError:
            return problem_json_response(InvalidRequest("Content-Length is not a number"), request)
        limit = settings.LMSP_MAX_REQUEST_BYTES
        if length > limit:
            return problem_json_response(PayloadTooLarge(f"The request body exceeds {limit} bytes"), request)
        return self.get_response(request)
