"""Refuses a Host header the service does not answer to, as a problem, before anything reads it.

Django raises ``DisallowedHost`` wherever the host is first read and logs
each one as an error with a traceback; scanners send foreign Host headers
all day. Checked here first, every path (API, admin, metrics) answers the
same ``400 invalid_request`` problem, in DEBUG too, with one log line.
"""

from __future__ import annotations

import logging

from django.core.exceptions import DisallowedHost
from django.http import HttpRequest, HttpResponse

from tasks_app.edge.middleware_base import SyncAndAsyncMiddleware
from tasks_app.edge.problems import problem_json_response
from tasks_app.exceptions import InvalidRequest

logger = logging.getLogger(__name__)

_SHOWN_HOST_CHARS = 100


def host_refusal(request: HttpRequest) -> HttpResponse | None:
    """The problem answer for a Host header outside ALLOWED_HOSTS; None for one the service answers to."""
    try:
        request.get_host()
    except DisallowedHost:
        host = request.META.get("HTTP_HOST", request.META.get("SERVER_NAME", ""))[:_SHOWN_HOST_CHARS]
        logger.info("refused Host header %r (LMSP_ALLOWED_HOSTS)", host)
        return problem_json_response(
            InvalidRequest(
                f"The Host header {host!r} is not a name this service answers to",
                errors=[{"field": "Host", "message": "not allowed (LMSP_ALLOWED_HOSTS)"}],
            ),
            request,
        )
    return None


class AllowedHostMiddleware(SyncAndAsyncMiddleware):
    """``400 invalid_request`` for a foreign Host header, before the rest of the chain runs."""

    def before(self, request: HttpRequest) -> HttpResponse | None:
        return host_refusal(request)
