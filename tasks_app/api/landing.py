"""``GET /`` and ``GET /lmsp/v1``: where a person who opens the printed address finds their way.

Links to the API's docs and schema, the admin, the health check and the
metrics, and the README's first request; JSON for API clients, HTML for a
browser (``Accept``). Public, like the docs page: it holds nothing an
anonymous caller should not see (no token, no setting, no path on disk).
Not part of the OpenAPI schema, which documents the API under
``/lmsp/v1/`` only.
"""

from __future__ import annotations

from typing import Any

from django.http import HttpRequest, HttpResponse, JsonResponse
from django.template.loader import render_to_string
from django.urls import reverse
from django.views.decorators.csrf import csrf_exempt

from tasks_app.edge.problems import problem_json_response
from tasks_app.exceptions import MethodNotAllowed

ALLOWED_METHODS = ("GET", "HEAD")
HTML = "text/html"
JSON = "application/json"
# The README's first request; the quick start keeps its token in data/local-token.
TOKEN_LINE = "TOKEN=$(cat data/local-token)"
EXAMPLE_BODY = '{"type":"response","input":{"model":"demo","input":"Hello"},"on_restart":"fail"}'


def landing_describe(base: str) -> dict[str, Any]:
    """What the landing page says, with absolute links under ``base`` (scheme and host, no slash)."""
    tasks = base + reverse("tasks")
    example = "\n".join(
        [
            TOKEN_LINE,
            f"curl -s -X POST {tasks} \\",
            '  -H "Authorization: Bearer $TOKEN" -H "Content-Type: application/json" \\',
            """  -H "Idempotency-Key: $(python3 -c 'import uuid; print(uuid.uuid4())')" \\""",
            f"  -d '{EXAMPLE_BODY}'",
        ]
    )
    return {
        "service": "LMSP",
        "description": "Durable generation tasks (LMSP 1.0): create a task, get 202, read or cancel it later.",
        "api": base + "/lmsp/v1",
        "authentication": "Authorization: Bearer <token>",
        "tokens": "manage.py lmsp_client create NAME, or pairing (POST /lmsp/v1/pair); "
        "the quick start keeps one in data/local-token",
        "links": {
            "docs": base + reverse("openapi-docs"),
            "openapi": base + reverse("openapi"),
            "admin": base + reverse("admin:index"),
            "health": base + reverse("health"),
            "metrics": base + reverse("metrics"),
        },
        "example": example,
    }


@csrf_exempt
async def landing_view(request: HttpRequest) -> HttpResponse:
    if request.method not in ALLOWED_METHODS:
        error = MethodNotAllowed(
            f"Method {request.method} is not allowed here", headers={"Allow": ", ".join(ALLOWED_METHODS)}
        )
        return problem_json_response(error, request)
    page = landing_describe(f"{request.scheme}://{request.get_host()}")
    # A browser asks for HTML first; curl (*/*), an API client or no Accept at all gets JSON.
    if request.get_preferred_type([JSON, HTML]) == HTML:
        response = HttpResponse(render_to_string("tasks_app/landing.html", {"page": page}), content_type=HTML)
    else:
        response = JsonResponse(page, json_dumps_params={"indent": 2})
    response["Vary"] = "Accept"
    return response
