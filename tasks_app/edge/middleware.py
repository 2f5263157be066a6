"""Refuses oversized request bodies before any view reads them; a database that is away is a 503."""

from __future__ import annotations

import io
import shutil
import tempfile

from django.conf import settings
from django.http import HttpRequest, HttpResponse

from tasks_app.edge.middleware_base import SyncAndAsyncMiddleware
from tasks_app.edge.problems import problem_json_response
from tasks_app.exceptions import InvalidRequest, PayloadTooLarge
from tasks_app.plumbing.db_locks import unavailable_problem

# The one route that takes a body past LMSP_MAX_REQUEST_BYTES: a file upload (docs/batches.md).
FILE_UPLOAD_PATH = "/lmsp/v1/files"
# Room for the multipart boundaries and the form's other fields around the uploaded file.
MULTIPART_OVERHEAD_BYTES = 64 * 1024


def request_body_limit(method: str, path: str) -> int:
    """The largest body the request may send: LMSP_MAX_REQUEST_BYTES, or for an upload LMSP_MAX_FILE_BYTES."""
    if method == "POST" and path.rstrip("/") == FILE_UPLOAD_PATH:
        return settings.LMSP_MAX_FILE_BYTES + MULTIPART_OVERHEAD_BYTES
    return settings.LMSP_MAX_REQUEST_BYTES


class RequestSizeLimitMiddleware(SyncAndAsyncMiddleware):
    """413 for bodies over ``LMSP_MAX_REQUEST_BYTES``, declared or chunked.

    A chunked body has no Content-Length, and DRF would read it as empty; it
    is read here (at most limit + 1 bytes) and handed on with its length.
    ASGI spools the whole body before the view runs, so that read never
    blocks the event loop on the network.
    """

    def before(self, request: HttpRequest) -> HttpResponse | None:
        limit = request_body_limit(request.method or "", request.path_info)
        raw = request.META.get("CONTENT_LENGTH") or ""
        if raw:
            try:
                length = int(raw)
            except ValueError:
                return problem_json_response(InvalidRequest("Content-Length is not a number"), request)
            if length > limit:
                return problem_json_response(PayloadTooLarge.over(limit), request)
        elif "chunked" in request.META.get("HTTP_TRANSFER_ENCODING", "").lower():
            # An upload's body may be large: past LMSP_MAX_REQUEST_BYTES it is spooled to disk, not memory.
            body = tempfile.SpooledTemporaryFile(max_size=settings.LMSP_MAX_REQUEST_BYTES)
            shutil.copyfileobj(io.BufferedReader(_Limited(request, limit + 1)), body)
            length = body.tell()
            if length > limit:
                body.close()
                return problem_json_response(PayloadTooLarge.over(limit), request)
            body.seek(0)
            request._stream = body
            request._read_started = False
            request.META["CONTENT_LENGTH"] = str(length)
        return None


class _Limited(io.RawIOBase):
    """At most ``limit`` bytes of a request's body, read in pieces."""

    def __init__(self, request: HttpRequest, limit: int) -> None:
        self.request, self.left = request, limit

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:  # type: ignore[no-untyped-def]
        data = self.request.read(min(len(buffer), self.left)) if self.left > 0 else b""
        buffer[: len(data)] = data
        self.left -= len(data)
        return len(data)


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
