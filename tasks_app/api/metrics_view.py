"""``GET /metrics``: the installation's Prometheus metrics (docs/metrics.md).

Outside the bearer-token API: Prometheus scrapes without credentials. With
``LMSP_METRICS_LOCAL_ONLY`` only loopback clients get an answer. Async, like
the streams: it runs on the event loop that owns this process's streams (to
count them), and its reads go to the database pool and a thread, so a slow
Redis never blocks the loop.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging

from django.conf import settings
from django.db import DatabaseError
from django.http import HttpRequest, HttpResponse
from django.views.decorators.csrf import csrf_exempt

from tasks_app.edge.problems import problem_json_response
from tasks_app.exceptions import LocalClientsOnly, MethodNotAllowed
from tasks_app.metrics.exposition import metrics_exposition
from tasks_app.metrics.scrape import Scrape, metrics_redis_read, tasks_active_count
from tasks_app.metrics.store import RateLimitedWarning
from tasks_app.plumbing.dbpool import run_db
from tasks_app.plumbing.event_feeds import feeds

logger = logging.getLogger(__name__)

ALLOWED_METHODS = ("GET", "HEAD")

_db_warning = RateLimitedWarning(logger)


def is_loopback(address: str | None) -> bool:
    """Whether a client address is this host's loopback (127.0.0.0/8, ::1, or 127.x mapped into IPv6)."""
    try:
        ip = ipaddress.ip_address((address or "").strip())
    except ValueError:
        # No address (a Unix socket) or a garbled one: not known to be local.
        return False
    mapped = getattr(ip, "ipv4_mapped", None)
    return ip.is_loopback or (mapped is not None and mapped.is_loopback)


async def _active_counts() -> dict[str, int] | None:
    try:
        return await run_db(tasks_active_count)
    except DatabaseError as exc:
        _db_warning("metrics: counting active tasks failed (%s)", exc)
        return None


async def _scrape() -> Scrape:
    active, readout = await asyncio.gather(_active_counts(), asyncio.to_thread(metrics_redis_read))
    return Scrape(active=active, redis=readout, open_streams=feeds().open_streams)


@csrf_exempt
async def metrics_view(request: HttpRequest) -> HttpResponse:
    if settings.LMSP_METRICS_LOCAL_ONLY and not is_loopback(request.META.get("REMOTE_ADDR")):
        error = LocalClientsOnly("Metrics are served only to clients on this host (LMSP_METRICS_LOCAL_ONLY)")
        return problem_json_response(error, request)
    if request.method not in ALLOWED_METHODS:
        error = MethodNotAllowed(
            f"Method {request.method} is not allowed here", headers={"Allow": ", ".join(ALLOWED_METHODS)}
        )
        return problem_json_response(error, request)
    scrape = await _scrape()
    body, content_type = metrics_exposition(scrape, accept=request.headers.get("Accept", ""))
    response = HttpResponse(body, content_type=content_type)
    response["Cache-Control"] = "no-store"
    return response
