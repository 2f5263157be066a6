"""``GET /healthz``: whether this web process can serve requests now, and if not, what is away.

Outside the bearer-token API, like ``/metrics``: a load balancer, a
container healthcheck or an operator's ``curl`` asks without credentials,
and the answer names no address. ``200`` while the database answers
(Redis down only slows dispatch: the sweeper sends what waited); ``503``, a
problem object with ``Retry-After``, while the database cannot be reached,
or refuses writes (read-only, full) as this process last found it.
"""

from __future__ import annotations

import asyncio
from typing import Any

from django.conf import settings
from django.db import DatabaseError, connection
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.views.decorators.csrf import csrf_exempt

from tasks_app.edge.problems import PROBLEM_CONTENT_TYPE, problem_json_response
from tasks_app.exceptions import DatabaseUnavailable, MethodNotAllowed
from tasks_app.metrics.store import metrics_redis
from tasks_app.plumbing.database_outages import Unavailable, database_outage, database_unavailable_noted
from tasks_app.plumbing.dbpool import run_db

ALLOWED_METHODS = ("GET", "HEAD")


def _database_ping() -> None:
    with connection.cursor() as cursor:
        cursor.execute("SELECT 1")


async def _database_check() -> dict[str, Any]:
    try:
        await run_db(_database_ping)
    except DatabaseError as error:
        reason = database_unavailable_noted(error)
        if reason is None:
            raise
        return {"status": "down", "reason": reason.value, **_since()}
    outage = database_outage()
    if outage is not None and outage[0] in (Unavailable.READ_ONLY, Unavailable.FULL):
        # Reads work; the last write failed and none has succeeded since.
        return {"status": "down", "reason": outage[0].value, **_since()}
    return {"status": "up"}


def _since() -> dict[str, float]:
    outage = database_outage()
    return {} if outage is None else {"seconds": round(outage[1], 1)}


def _redis_ping() -> dict[str, str]:
    try:
        metrics_redis().ping()
    except Exception:  # any failure of the ping is the answer: Redis is not usable from here
        return {"status": "down"}
    return {"status": "up"}


@csrf_exempt
async def health_view(request: HttpRequest) -> HttpResponse:
    if request.method not in ALLOWED_METHODS:
        error = MethodNotAllowed(
            f"Method {request.method} is not allowed here", headers={"Allow": ", ".join(ALLOWED_METHODS)}
        )
        return problem_json_response(error, request)
    database, redis = await asyncio.gather(_database_check(), asyncio.to_thread(_redis_ping))
    checks = {"database": database, "redis": redis}
    if database["status"] == "up":
        response = JsonResponse({"status": "ok", "checks": checks})
    else:
        retry_after = str(settings.LMSP_DB_UNAVAILABLE_RETRY_AFTER_SECONDS)
        says = {"unreachable": "cannot be reached", "read_only": "refuses writes", "full": "has no room on its disk"}
        error = DatabaseUnavailable(f"The service's database {says.get(database['reason'], 'is unavailable')}")
        body = {**error.to_http_problem(request.path), "checks": checks}
        response = JsonResponse(body, status=error.status, content_type=PROBLEM_CONTENT_TYPE)
        response["Retry-After"] = retry_after
    response["Cache-Control"] = "no-store"
    return response
