"""A few long-lived threads that run the database reads of async views.

Under ASGI, Django gives every request context its own connection objects, so
``sync_to_async`` in a stream would open a connection per stream and keep it
(and a thread) for as long as the stream stays open. Streams and waits instead
hand their reads to this pool: ``run_in_executor`` copies no context, so each
thread keeps one connection of its own, opened once and reused, like a WSGI
worker thread. A disconnected stream holds nothing here.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import ParamSpec, TypeVar

from django.conf import settings
from django.db import DatabaseError, close_old_connections, connections

P = ParamSpec("P")
T = TypeVar("T")

_lock = threading.Lock()
_executor: ThreadPoolExecutor | None = None


def _pool() -> ThreadPoolExecutor:
    global _executor
    with _lock:
        if _executor is None:
            _executor = ThreadPoolExecutor(max_workers=settings.LMSP_STREAM_DB_THREADS, thread_name_prefix="lmsp-db")
        return _executor


_local = threading.local()
# How often a pool thread checks its connection. Django checks at the start of
# every request; doing it before every read would cost PostgreSQL a
# ``SELECT 1`` round trip per read (CONN_HEALTH_CHECKS).
CHECK_INTERVAL_SECONDS = 5.0


def _call(fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
    now = time.monotonic()
    if now - getattr(_local, "checked_at", float("-inf")) >= CHECK_INTERVAL_SECONDS:
        # Drops a connection the server closed (PostgreSQL restarted) or that
        # outlived CONN_MAX_AGE, as Django does at the start of a request.
        close_old_connections()
        _local.checked_at = now
    try:
        return fn(*args, **kwargs)
    except DatabaseError:
        # Check again before the next read instead of failing every read
        # until the next interval on a connection that broke meanwhile.
        _local.checked_at = float("-inf")
        raise


async def run_db(fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
    """Run ``fn`` (which uses the ORM) on a pool thread and await its result."""
    loop = asyncio.get_running_loop()
    return await loop.run_in_executor(_pool(), lambda: _call(fn, *args, **kwargs))


def close_pool() -> None:
    """Close every pool thread's connection and stop the threads (tests drop their database after)."""
    global _executor
    with _lock:
        executor, _executor = _executor, None
    if executor is None:
        return
    # Each job waits for all the others, so every thread runs exactly one.
    size = settings.LMSP_STREAM_DB_THREADS
    barrier = threading.Barrier(size)

    def close() -> None:
        connections.close_all()
        barrier.wait(timeout=10)

    for future in [executor.submit(close) for _ in range(size)]:
        future.result()
    executor.shutdown()
