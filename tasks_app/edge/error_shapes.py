"""Another protocol's routes answer errors in that protocol's shape, whoever raised them.

A problem can come from anywhere on the way in (the host check, the size
limit, authentication, a throttle, a database outage, a view); under a route
prefix that a protocol adapter owns (``LMSP_ERROR_SHAPES``: prefix -> the
dotted name of a function of the problem), the problem is handed to that
adapter's translation, so its clients read their own error shape and status
codes (PROFILE.md section 11). The edge knows no protocol: the adapters
register their translations in settings.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from typing import Any

from django.conf import settings
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.utils.module_loading import import_string

from tasks_app.edge.middleware_base import SyncAndAsyncMiddleware
from tasks_app.edge.problems import PROBLEM_CONTENT_TYPE

ErrorShape = Callable[[Mapping[str, Any]], tuple[int, dict[str, Any]]]
"""A problem object -> the status and body the protocol answers it with."""

# Headers a reshaped answer keeps (the rest describe the problem body it replaces).
KEPT_HEADERS = ("Retry-After", "WWW-Authenticate", "Allow", "Vary")


def _shapes() -> list[tuple[str, ErrorShape]]:
    shapes = [(prefix, import_string(dotted)) for prefix, dotted in settings.LMSP_ERROR_SHAPES.items()]
    # The longest prefix first: a nested route's shape wins over its parent's.
    return sorted(shapes, key=lambda pair: -len(pair[0]))


class ProtocolErrorShapeMiddleware(SyncAndAsyncMiddleware):
    """Reshapes a problem answer under a registered prefix; any other answer passes as it is."""

    def __init__(self, get_response: Callable[[HttpRequest], Any]) -> None:
        super().__init__(get_response)
        self.shapes = _shapes()

    def after(self, request: HttpRequest, response: HttpResponse) -> HttpResponse:
        if getattr(response, "streaming", False):
            return response
        if not response.get("Content-Type", "").startswith(PROBLEM_CONTENT_TYPE):
            return response
        shape = next((shape for prefix, shape in self.shapes if request.path.startswith(prefix)), None)
        if shape is None:
            return response
        try:
            problem = json.loads(response.content)
        except ValueError:
            return response
        status, body = shape(problem)
        reshaped = JsonResponse(body, status=status, json_dumps_params={"ensure_ascii": False})
        for name in KEPT_HEADERS:
            if name in response:
                reshaped[name] = response[name]
        return reshaped
