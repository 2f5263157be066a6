"""RFC 9457 problem objects for every error the API or Django would render."""

from __future__ import annotations

import logging
import sys
from collections.abc import Mapping, Sequence
from typing import Any

from django.http import Http404, HttpRequest, JsonResponse
from rest_framework import exceptions as drf
from rest_framework.response import Response

from tasks_app import exceptions as exc
from tasks_app.plumbing.db_locks import unavailable_problem

logger = logging.getLogger("tasks_app.api")

PROBLEM_CONTENT_TYPE = "application/problem+json"


def problem_body(error: exc.LmspError, instance: str | None) -> dict[str, Any]:
    return error.to_http_problem(instance)


def problem_json_response(error: exc.LmspError, request: HttpRequest | None) -> JsonResponse:
    """A plain Django response, for errors raised outside DRF views."""
    response = JsonResponse(
        problem_body(error, request.path if request is not None else None),
        status=error.status,
        content_type=PROBLEM_CONTENT_TYPE,
        json_dumps_params={"ensure_ascii": False, "separators": (",", ":")},
    )
    for name, value in error.headers.items():
        response[name] = value
    if isinstance(error, exc.Unauthorized) and "WWW-Authenticate" not in response:
        response["WWW-Authenticate"] = 'Bearer realm="lmsp"'
    return response


def _flatten(detail: Any, prefix: str = "") -> list[dict[str, str]]:
    """DRF's nested error detail as ``[{"field": "input.model", "message": ...}]``."""
    if isinstance(detail, Mapping):
        out: list[dict[str, str]] = []
        for key, value in detail.items():
            name = prefix if key == "non_field_errors" else (f"{prefix}.{key}" if prefix else str(key))
            out.extend(_flatten(value, name))
        return out
    if isinstance(detail, Sequence) and not isinstance(detail, str):
        out = []
        for index, value in enumerate(detail):
            if isinstance(value, (Mapping, list)) and value:
                out.extend(_flatten(value, f"{prefix}[{index}]"))
            elif not isinstance(value, (Mapping, list)):
                out.extend(_flatten(value, prefix))
        return out
    return [{"field": prefix or "body", "message": str(detail)}]


def drf_error_as_lmsp(error: drf.APIException) -> exc.LmspError:
    """The problem a DRF error (a serializer's ``ValidationError``) is answered with, for a caller that answers
    it elsewhere than in an HTTP reply (a batch line's result)."""
    return _from_drf(error)


def _from_drf(error: drf.APIException) -> exc.LmspError:
    if isinstance(error, drf.ValidationError):
        errors = _flatten(error.detail)
        summary = "; ".join(f"{e['field']}: {e['message']}" for e in errors[:5])
        return exc.InvalidRequest(f"The request is invalid: {summary}", errors=errors)
    if isinstance(error, drf.ParseError):
        return exc.InvalidRequest(str(error.detail))
    if isinstance(error, (drf.NotAuthenticated, drf.AuthenticationFailed)):
        return exc.Unauthorized(str(error.detail))
    if isinstance(error, drf.PermissionDenied):
        return exc.InsufficientScope(str(error.detail))
    if isinstance(error, drf.NotFound):
        return exc.NotFound(str(error.detail))
    if isinstance(error, drf.MethodNotAllowed):
        return exc.MethodNotAllowed(str(error.detail))
    if isinstance(error, drf.NotAcceptable):
        return exc.NotAcceptable(str(error.detail))
    if isinstance(error, drf.UnsupportedMediaType):
        return exc.UnsupportedMediaType(f"{error.detail} Send application/json.")
    if isinstance(error, drf.Throttled):
        wait = int(error.wait or 1)
        return exc.RateLimited(f"Too many requests; retry in {wait} s", headers={"Retry-After": str(wait)})
    return exc.InternalError("The server failed to serve the request")


def exception_handler(error: Exception, context: dict[str, Any]) -> Response | None:
    """DRF's EXCEPTION_HANDLER: every error becomes a problem object, never a traceback."""
    request = context.get("request")
    if (unavailable := unavailable_problem(error)) is not None:
        problem = unavailable
    elif isinstance(error, exc.LmspError):
        problem = error
    elif isinstance(error, drf.APIException):
        problem = _from_drf(error)
    else:
        if isinstance(error, Http404):
            problem = exc.NotFound("No such resource")
        else:
            view = context.get("view")
            logger.exception("unhandled error in %s", type(view).__name__ if view else "view")
            problem = exc.InternalError("The server failed to serve the request")
    headers = dict(problem.headers)
    if isinstance(problem, exc.Unauthorized):
        headers.setdefault("WWW-Authenticate", 'Bearer realm="lmsp"')
    return Response(
        problem_body(problem, request.path if request is not None else None),
        status=problem.status,
        headers=headers,
        content_type=PROBLEM_CONTENT_TYPE,
    )


def handler404(request: HttpRequest, exception: Exception | None = None) -> JsonResponse:
    return problem_json_response(exc.NotFound(f"No route for {request.path}"), request)


def handler500(request: HttpRequest) -> JsonResponse:
    """Django's answer to an exception raised outside a view (a middleware's session write, say).

    Called inside Django's ``except`` block, so the exception is at hand: a
    database outage is the same 503 as in a view, and marked logged (the
    outage has its one line), so Django adds no traceback of its own.
    """
    unavailable = unavailable_problem(sys.exc_info()[1])
    if unavailable is not None:
        response = problem_json_response(unavailable, request)
        response._has_been_logged = True
        return response
    return problem_json_response(exc.InternalError("The server failed to serve the request"), request)


def handler400(request: HttpRequest, exception: Exception | None = None) -> JsonResponse:
    return problem_json_response(exc.InvalidRequest("Bad request"), request)


def handler403(request: HttpRequest, exception: Exception | None = None) -> JsonResponse:
    return problem_json_response(exc.InsufficientScope("Forbidden"), request)
