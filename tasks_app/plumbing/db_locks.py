"""Bounded waits for the database's locks, and the clock a write is stamped with.

A process frozen inside a transaction (SIGSTOP, a paused VM, swap) holds
SQLite's single write lock, or a PostgreSQL row lock, for as long as it is
frozen. Nobody may wait on it unbounded:

- every connection waits at most ``LMSP_DB_LOCK_TIMEOUT_SECONDS`` (SQLite's
  busy timeout; PostgreSQL's ``lock_timeout``), then the statement fails and
  its transaction writes nothing;
- a request that fails so answers ``503 service_unavailable`` with
  ``Retry-After`` (``DatabaseBusy``);
- maintenance (reaper, recovery, cleanup) waits less
  (:func:`lock_wait`) and comes back next round; a worker retries its
  commit (``workers.execution``).

The heartbeat a commit writes is the time the write really happened, taken
once the lock is held (:func:`write_clock`), so a worker that waited long for
the lock does not look dead the moment it gets it; the reaper compares it on
the same clock (:func:`clock_now`).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime, timedelta
from typing import Any

from django.conf import settings
from django.db import OperationalError, connection
from django.db.models import DateTimeField, Func
from django.db.models.functions import Now
from django.utils import timezone

from tasks_app.exceptions import DatabaseBusy, DatabaseUnavailable, InsufficientStorage, LmspError
from tasks_app.plumbing.database_outages import Unavailable, database_unavailability, database_unavailable_noted

# What SQLite says when its busy timeout ran out; PostgreSQL's lock_not_available.
_SQLITE_LOCKED = ("database is locked", "database table is locked")
_PG_LOCK_NOT_AVAILABLE = "55P03"


def is_lock_timeout(error: BaseException) -> bool:
    """Whether ``error`` is a lock wait that ran out (nothing was written by its statement)."""
    if not isinstance(error, OperationalError):
        return False
    cause = error.__cause__
    if getattr(cause, "sqlstate", None) == _PG_LOCK_NOT_AVAILABLE:
        return True
    return any(text in str(error) for text in _SQLITE_LOCKED)


def is_database_unavailable(error: BaseException) -> bool:
    """Whether ``error`` says the database cannot be reached or written now, rather than something about a row.

    A connection that failed or was closed, a server that ended the session
    (restart, ``idle_in_transaction_session_timeout``), a file SQLite cannot
    open or write (read-only, full), and a lock wait that ran out: in each
    case the transaction wrote nothing, and the same work may succeed once
    the database is back (``tasks_app.plumbing.database_outages``).
    """
    return database_unavailability(error) is not None


def unavailable_problem(error: BaseException) -> LmspError | None:
    """The problem a request answers when ``error`` means the database is unavailable (None otherwise).

    ``503 service_unavailable`` with ``Retry-After``; ``507 insufficient_storage`` for a full disk. The
    outage is noted (one log line per outage, counted), never logged per request.
    """
    reason = database_unavailable_noted(error)
    if reason is None:
        return None
    if isinstance(error, DatabaseBusy):
        return error
    if reason is Unavailable.LOCKED:
        return busy_error(error)
    retry_after = str(settings.LMSP_DB_UNAVAILABLE_RETRY_AFTER_SECONDS)
    headers = {"Retry-After": retry_after}
    if reason is Unavailable.FULL:
        return InsufficientStorage(
            f"The service's database has no room left on its disk; nothing was written, retry in {retry_after} s",
            headers=headers,
        )
    says = "refuses writes (read-only)" if reason is Unavailable.READ_ONLY else "cannot be reached"
    return DatabaseUnavailable(
        f"The service's database {says} now; nothing was written, retry in {retry_after} s", headers=headers
    )


def busy_error(error: BaseException | None = None) -> DatabaseBusy:
    """The problem for a lock wait that ran out."""
    retry_after = str(settings.LMSP_DB_BUSY_RETRY_AFTER_SECONDS)
    return DatabaseBusy(
        "The database could not be written in time (another writer holds its lock); nothing was written, "
        f"retry in {retry_after} s",
        headers={"Retry-After": retry_after},
    )


@contextmanager
def busy_as_unavailable() -> Iterator[None]:
    """Turns a lock wait that ran out into ``DatabaseBusy`` (503); other errors pass."""
    try:
        yield
    except OperationalError as error:
        if is_lock_timeout(error):
            raise busy_error(error) from error
        raise


@contextmanager
def lock_wait(seconds: float) -> Iterator[None]:
    """Within the block, this connection waits at most ``seconds`` for a lock.

    Enter it outside any transaction: on PostgreSQL the setting is the
    session's (a ``SET LOCAL`` would end with the first transaction), and
    the default comes back after the block.
    """
    millis = max(1, int(seconds * 1000))
    # Nested blocks restore what the outer one set; a new connection starts at the default.
    previous = getattr(connection, _CURRENT, int(settings.LMSP_DB_LOCK_TIMEOUT_SECONDS * 1000))
    _set_lock_timeout(millis)
    try:
        yield
    finally:
        if connection.connection is not None and not connection.needs_rollback:
            _set_lock_timeout(previous)


# The lock wait :func:`lock_wait` last set, kept on the connection wrapper of its thread.
_CURRENT = "_lmsp_lock_wait_ms"


def _set_lock_timeout(millis: int) -> None:
    setattr(connection, _CURRENT, millis)
    with connection.cursor() as cursor:
        if connection.vendor == "sqlite":
            cursor.execute(f"PRAGMA busy_timeout = {int(millis)}")
        else:
            cursor.execute(f"SET lock_timeout = {int(millis)}")


class _ClockTimestamp(Func):
    """PostgreSQL's ``clock_timestamp()``: the time of the write, not of the transaction's start."""

    function = "clock_timestamp"
    template = "%(function)s()"
    output_field = DateTimeField()


def write_clock(now: datetime) -> Any:
    """The value a stamped column (``heartbeat_at``) gets in a write that holds its lock.

    On SQLite ``now`` is read after ``BEGIN IMMEDIATE`` got the write lock;
    on PostgreSQL the row lock is taken by the UPDATE itself, so the
    database's clock at the write stands in (workers on several hosts then
    also share one clock).
    """
    return now if connection.vendor == "sqlite" else _ClockTimestamp()


def clock_now() -> Any:
    """The current time on the clock heartbeats are written with (see :func:`write_clock`)."""
    return timezone.now() if connection.vendor == "sqlite" else Now()


def stale_before(seconds: float) -> Any:
    """A cutoff for ``heartbeat_at__lt``: ``seconds`` ago on the heartbeats' clock."""
    return clock_now() - timedelta(seconds=seconds)
