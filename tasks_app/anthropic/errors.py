"""Anthropic's error shape: ``{"type": "error", "error": {"type", "message"}}`` with its status codes.

Every problem under ``/lmsp/v1/messages`` is answered so
(``tasks_app.edge.error_shapes``); the SDKs raise their typed errors from
the status (``AuthenticationError`` for 401, ``RateLimitError`` for 429...)
and read the text from ``error.message``. Claude Code reads the text of a
prompt over the context (``prompt is too long: N tokens > M maximum``) to
offer compacting the conversation: the problem's detail is the message as
it is, without the LMSP code before it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

# Anthropic's error types by status (docs.anthropic.com "Errors"); a status not listed is an api_error.
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    409: "invalid_request_error",
    410: "not_found_error",
    413: "request_too_large",
    415: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    431: "request_too_large",
    503: "overloaded_error",
    507: "overloaded_error",
}


def anthropic_error(problem: Mapping[str, Any]) -> tuple[int, dict[str, Any]]:
    """A problem object (PROFILE.md section 2) as Anthropic's clients read an error."""
    status = int(problem.get("status") or 500)
    message = str(problem.get("detail") or problem.get("title") or "error")
    errors = problem.get("errors") or []
    if errors and problem.get("code") == "invalid_request" and errors[0].get("field") not in message:
        message = f"{errors[0].get('field')}: {errors[0].get('message')}"
    return status, {"type": "error", "error": {"type": error_type(status), "message": message}}


def error_type(status: int) -> str:
    return ERROR_TYPES.get(status, "api_error")
