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

from tasks_app.exceptions import DatabaseBusy
from tasks_app.plumbing.database_outages import Unavailable, database_unavailability, database_unavailable_noted

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
# How often a read that waits out an outage tries again: soon at first, then every 2 s.
OUTAGE_FIRST_PAUSE_SECONDS = 0.1
OUTAGE_MAX_PAUSE_SECONDS = 2.0


def _call(fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
    now = time.monotonic()
    if now - getattr(_local, "checked_at", float("-inf")) >= CHECK_INTERVAL_SECONDS:
        # Drops a connection the server closed (PostgreSQL restarted) or that
        # outlived CONN_MAX_AGE, as Django does at the start of a request.
        close_old_connections()
        _local.checked_at = now
    connection = connections["default"]
    reused = connection.connection is not None
    try:
        return fn(*args, **kwargs)
    except DatabaseError as error:
        # Check again before the next read instead of failing every read
        # until the next interval on a connection that broke meanwhile.
        _local.checked_at = float("-inf")
        if not reused or connection.in_atomic_block or database_unavailability(error) is not Unavailable.UNREACHABLE:
            raise
    # A connection the server dropped while it sat here (a restart, an idle timeout): the first call after
    # the database came back gets a new one, as a new request would, instead of the old one's error. Each
    # call is one short transaction of its own, so trying it again is exact.
    connection.close()
    return fn(*args, **kwargs)


async def run_db(fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
    """Run ``fn`` (which uses the ORM) on a pool thread and await its result."""
    loop = asyncio.get_running_loop()
    return await loop.run_in_executor(_pool(), lambda: _call(fn, *args, **kwargs))


async def run_db_through_outages(fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
    """:func:`run_db`, tried again for as long as the database is away (or locked past the lock timeout).

    For the reads that follow a task already accepted (a client waiting for
    its response, an open stream): the task goes on meanwhile, and the client
    gets its answer once the database is back rather than an error that would
    make it send the work again. The outage is logged once, by
    ``tasks_app.plumbing.database_outages``; a client that leaves ends the wait.
    """
    pause = OUTAGE_FIRST_PAUSE_SECONDS
    while True:
        try:
            return await run_db(fn, *args, **kwargs)
        except (DatabaseBusy, DatabaseError) as error:
            if database_unavailable_noted(error) is None:
                raise
        await asyncio.sleep(pause)
        pause = min(pause * 2, OUTAGE_MAX_PAUSE_SECONDS)


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
