"""Refuses oversized request bodies before any view reads them."""

from __future__ import annotations

import io
from collections.abc import Callable
from typing import Any

from asgiref.sync import iscoroutinefunction, markcoroutinefunction
from django.conf import settings
from django.http import HttpRequest, HttpResponse

from tasks_app.api.problems import problem_json_response
from tasks_app.exceptions import InvalidRequest, PayloadTooLarge


class RequestSizeLimitMiddleware:
    """413 for bodies over ``LMSP_MAX_REQUEST_BYTES``, declared or chunked.

    A chunked body has no Content-Length, and DRF would read it as empty; it
    is read here (at most limit + 1 bytes) and handed on with its length.
    Async-capable, so that under ASGI the async views (event streams) are not
    pushed through a thread by a sync-only middleware.
    """

    sync_capable = True
    async_capable = True

    def __init__(self, get_response: Callable[[HttpRequest], Any]) -> None:
        self.get_response = get_response
        self.is_async = iscoroutinefunction(get_response)
        if self.is_async:
            markcoroutinefunction(self)

    def __call__(self, request: HttpRequest) -> Any:
        refused = self._refuse(request)
        if self.is_async:
            return self._acall(request, refused)
        return refused if refused is not None else self.get_response(request)

    async def _acall(self, request: HttpRequest, refused: HttpResponse | None) -> HttpResponse:
        # ASGI spools the whole body before the view runs, so the read in
        # ``_refuse`` never blocks the loop on the network.
        return refused if refused is not None else await self.get_response(request)

    def _refuse(self, request: HttpRequest) -> HttpResponse | None:
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
