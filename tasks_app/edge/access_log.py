"""One access line per request, on the ``lmsp.access`` logger (uvicorn's own access log stays off).

``GET /lmsp/v1/tasks/task_… 200 3.1ms client=4 peer=127.0.0.1:50412``:
method, path, status, the time until the response was ready, the
authenticated client's id (``client=-`` without one, ``client=?`` when the
service failed before it could check its credentials: a database outage) and the peer's address.
A refusal adds what its problem object names, so that an operator sees why
without the client's help: ``POST /lmsp/v1/responses 400 2.0ms
problem=unsupported_parameter param=tools[1].type client=4 …``.
The path never carries its query string: a browser's stream token rides in
``?token=``. Streams (event streams, ``"stream": true``) are logged when
their response starts, with the time to their headers, marked ``stream``;
their length shows in the metrics (``docs/metrics.md``), not here.

First in ``MIDDLEWARE``, so every answer is logged, refusals by the other
middleware included. Async-capable, so that under ASGI the async views are
not pushed through a thread.
"""

from __future__ import annotations

import json
import logging
import time
from urllib.parse import quote

from django.http import HttpRequest, HttpResponseBase
from django.utils.encoding import escape_uri_path
from django.utils.functional import LazyObject

from tasks_app.edge.middleware_base import SyncAndAsyncMiddleware
from tasks_app.edge.problems import PROBLEM_CONTENT_TYPE
from tasks_app.models import Client

logger = logging.getLogger("lmsp.access")

# A problem's body is small; a larger one is not ours to parse on the way out.
_PROBLEM_BODY_LIMIT = 64 * 1024


def request_client_id(request: HttpRequest) -> int | None:
    """The id of the client the view authenticated, None without one.

    DRF and the stream views put the client on ``request.user``; an admin
    session's user (a lazy object there) is never loaded for this.
    """
    user = request.__dict__.get("user")
    if user is None or isinstance(user, LazyObject) or not isinstance(user, Client):
        return None
    return user.pk


def client_field(request: HttpRequest, response: HttpResponseBase, client: int | None) -> str:
    """The client's id; ``-`` for none; ``?`` when credentials came but the service failed before it could
    check them (the database was away): not an anonymous request, an unknown one."""
    if client is not None:
        return str(client)
    sent = request.META.get("HTTP_AUTHORIZATION") or "token" in request.GET
    return "?" if sent and response.status_code >= 500 else "-"


def _field(value: object) -> str:
    """A client-chosen string (a field name it sent) as one token: no space or newline can forge a line."""
    return quote(str(value)[:120], safe="[]._-:/*")


def problem_fields(response: HttpResponseBase) -> str:
    """`` problem=<code> param=<field>`` for an answer that is a problem object, else ``""``."""
    if response.status_code < 400 or response.streaming:
        return ""
    if not response.get("Content-Type", "").startswith(PROBLEM_CONTENT_TYPE):
        return ""
    content = response.content
    if len(content) > _PROBLEM_BODY_LIMIT:
        return ""
    try:
        body = json.loads(content)
    except ValueError:
        return ""
    if not isinstance(body, dict):
        return ""
    error = body.get("error") if isinstance(body.get("error"), dict) else {}
    fields = f" problem={_field(body.get('code') or '-')}"
    if error.get("param"):
        fields += f" param={_field(error['param'])}"
    return fields


def is_answered_problem(response: HttpResponseBase) -> bool:
    """Whether the answer is a problem the service chose to give (a refusal, an outage's 503), not a crash."""
    return response.get("Content-Type", "").startswith(PROBLEM_CONTENT_TYPE) and response.status_code != 500


def is_stream(response: HttpResponseBase) -> bool:
    """Whether the answer is an event stream: under the ASGI server a view answers only its headers, and
    ``EventStreamMiddleware`` writes the events after Django is done (``tasks_app/edge/sse.py``)."""
    return response.streaming or response.get("Content-Type", "").startswith("text/event-stream")


def access_line(request: HttpRequest, response: HttpResponseBase, started: float) -> None:
    """Log the request's one access line."""
    elapsed_ms = (time.perf_counter() - started) * 1000
    peer = request.META.get("REMOTE_ADDR") or "-"
    if request.META.get("REMOTE_PORT"):
        peer = f"{peer}:{request.META['REMOTE_PORT']}"
    client = request_client_id(request)
    logger.info(
        "%s %s %d %.1fms%s%s client=%s peer=%s",
        request.method,
        # Percent-encoded again: a decoded path could hold a newline or a space.
        escape_uri_path(request.path),
        response.status_code,
        elapsed_ms,
        " stream" if is_stream(response) else "",
        problem_fields(response),
        client_field(request, response, client),
        peer,
    )


class AccessLogMiddleware(SyncAndAsyncMiddleware):
    """Logs each request once its response is ready (a stream's: once it starts)."""

    def before(self, request: HttpRequest) -> None:
        request.lmsp_access_started = time.perf_counter()

    def after(self, request: HttpRequest, response: HttpResponseBase) -> HttpResponseBase:
        access_line(request, response, request.lmsp_access_started)
        if is_answered_problem(response):
            # The access line names it; django.request would add an ERROR line per 503 of an outage. An
            # exception no view answered was logged with its traceback before it got here.
            response._has_been_logged = True
        return response
