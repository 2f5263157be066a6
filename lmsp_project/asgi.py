"""ASGI entry point: uvicorn serves the API; event-stream bodies are written beside Django.

Two paths through one port. The async views (event streams, ``POST
/responses``, ``/metrics``) go through Django's ASGI handler. Everything else
(the REST views, the admin, the schema, static files, every 404) is sync
and goes to Django's WSGI handler on ``LMSP_WEB_THREADS`` long-lived threads
(``lmsp_project.wsgi_bridge``), where each thread keeps its database
connection from one request to the next. Under Django's ASGI handler a sync
view pays for a new connection per request (docs/scaling.md, bench/README.md).
``LMSP_WEB_THREADS=0`` sends everything through the ASGI handler, as before.

A web process also sends the run messages of the tasks it accepted from a
thread of its own (``tasks_app.plumbing.dispatch_sender``), after the ``202``.
"""

import os
from functools import lru_cache

from asgiref.sync import iscoroutinefunction
from django.contrib.staticfiles.handlers import ASGIStaticFilesHandler, StaticFilesHandler
from django.core.asgi import get_asgi_application
from django.core.handlers.wsgi import WSGIHandler
from django.urls import Resolver404, get_resolver

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "lmsp_project.settings")

# The admin's and the API docs page's files (/static/) come from the apps'
# folders: a local service has no separate web server in front of it.
django_application = ASGIStaticFilesHandler(get_asgi_application())

from django.conf import settings  # noqa: E402  (after setup)

from lmsp_project.wsgi_bridge import Receive, Scope, Send, WsgiBridge  # noqa: E402
from tasks_app.edge.middleware import request_body_limit  # noqa: E402
from tasks_app.edge.sse import ASGIApp, EventStreamMiddleware  # noqa: E402  (needs the apps loaded)
from tasks_app.openai.batches.keeper import batch_keeper_start  # noqa: E402
from tasks_app.plumbing.database_outages import outage_process_set  # noqa: E402
from tasks_app.plumbing.dispatch_sender import dispatch_sender_start  # noqa: E402

streams_application = EventStreamMiddleware(django_application)
outage_process_set("web")


@lru_cache(maxsize=1024)
def _serves_async(path_info: str) -> bool:
    """Whether the view at ``path_info`` is a coroutine function (a path no view serves is not)."""
    try:
        match = get_resolver().resolve(path_info)
    except Resolver404:
        return False
    return iscoroutinefunction(match.func)


class SyncViewsOverWsgi:
    """Sends a request to ``sync_app`` unless the view it resolves to is async."""

    def __init__(self, *, sync_app: ASGIApp, async_app: ASGIApp) -> None:
        self.sync_app = sync_app
        self.async_app = async_app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            path_info = scope["path"].removeprefix(scope.get("root_path", "")) or "/"
            if not _serves_async(path_info):
                await self.sync_app(scope, receive, send)
                return
        await self.async_app(scope, receive, send)


def _application() -> ASGIApp:
    if settings.LMSP_WEB_THREADS <= 0:
        return streams_application
    # The body limit middleware refuses what is over the limit; the bridge
    # reads no more than that of a body (and one byte) to let it.
    bridge = WsgiBridge(
        StaticFilesHandler(WSGIHandler()),
        threads=settings.LMSP_WEB_THREADS,
        max_body=settings.LMSP_MAX_REQUEST_BYTES,
        thread_name_prefix="lmsp-web",
        body_limit=request_body_limit,
    )
    return SyncViewsOverWsgi(sync_app=bridge, async_app=streams_application)


application = _application()
# Run messages go to Redis from a thread of their own, after the 202.
dispatch_sender_start()
# Batches are fed to the workers and their results written by a thread of each web process (docs/batches.md).
batch_keeper_start()
