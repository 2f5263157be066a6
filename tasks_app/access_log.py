"""One access line per request, on the ``lmsp.access`` logger (uvicorn's own access log stays off).

``GET /lmsp/v1/tasks/task_… 200 3.1ms client=4 peer=127.0.0.1:50412``:
method, path, status, the time until the response was ready, the
authenticated client's id (``client=-`` without one) and the peer's address.
The path never carries its query string: a browser's stream token rides in
``?token=``. Streams (event streams, ``"stream": true``) are logged when
their response starts, with the time to their headers, marked ``stream``;
their length shows in the metrics (``docs/metrics.md``), not here.

First in ``MIDDLEWARE``, so every answer is logged, refusals by the other
middleware included. Async-capable, so that under ASGI the async views are
not pushed through a thread.
"""

from __future__ import annotations

import logging
import time

from django.http import HttpRequest, HttpResponseBase
from django.utils.encoding import escape_uri_path
from django.utils.functional import LazyObject

from tasks_app.middleware_base import SyncAndAsyncMiddleware
from tasks_app.models import Client

logger = logging.getLogger("lmsp.access")


def request_client_id(request: HttpRequest) -> int | None:
    """The id of the client the view authenticated, None without one.

    DRF and the stream views put the client on ``request.user``; an admin
    session's user (a lazy object there) is never loaded for this.
    """
    user = request.__dict__.get("user")
    if user is None or isinstance(user, LazyObject) or not isinstance(user, Client):
        return None
    return user.pk


def access_line(request: HttpRequest, response: HttpResponseBase, started: float) -> None:
    """Log the request's one access line."""
    elapsed_ms = (time.perf_counter() - started) * 1000
    peer = request.META.get("REMOTE_ADDR") or "-"
    if request.META.get("REMOTE_PORT"):
        peer = f"{peer}:{request.META['REMOTE_PORT']}"
    client = request_client_id(request)
    logger.info(
        "%s %s %d %.1fms%s client=%s peer=%s",
        request.method,
        # Percent-encoded again: a decoded path could hold a newline or a space.
        escape_uri_path(request.path),
        response.status_code,
        elapsed_ms,
        " stream" if response.streaming else "",
        "-" if client is None else client,
        peer,
    )


class AccessLogMiddleware(SyncAndAsyncMiddleware):
    """Logs each request once its response is ready (a stream's: once it starts)."""

    def before(self, request: HttpRequest) -> None:
        request.lmsp_access_started = time.perf_counter()

    def after(self, request: HttpRequest, response: HttpResponseBase) -> HttpResponseBase:
        access_line(request, response, request.lmsp_access_started)
        return response
