"""The database going away, as one process sees it: what the error means, one log line per outage, a count.

Every process of the service (the web, a worker, the maintenance node, the
webhook deliverer) meets the same few conditions: the server cannot be
reached (stopped, restarting, a cut network, out of connections), the
database refuses writes (SQLite's file or a PostgreSQL standby is read-only;
the disk is full), or a lock was held past ``LMSP_DB_LOCK_TIMEOUT_SECONDS``.
In each the failed statement's transaction wrote nothing and the same work
may succeed later, so none of them is a bug: a request answers ``503``
(``507`` for a full disk) with ``Retry-After``, a worker retries its commit,
maintenance skips a round (docs/recovery.md, "While the database is away").

:func:`database_unavailability` says whether an error is one of those.
:func:`database_unavailable_noted` and :func:`database_available_noted`
keep the process's one outage record: its first failure logs one WARNING
naming the database and what this process does meanwhile, and adds to
``lmsp_database_unavailable_total``; once the database has answered for
``SETTLE_SECONDS`` the end is logged with the outage's length; the failures
between, and a flap within the settling second, log nothing. The success is
seen by a statement wrapper every connection gets when it opens
(:func:`outage_watch_install`), so whichever code path first reaches the
database again ends the outage, without each caller saying so.
"""

from __future__ import annotations

import logging
import sqlite3
import threading
import time
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from django.conf import settings
from django.db import DatabaseError, InterfaceError, OperationalError
from django.db.backends.signals import connection_created

from tasks_app.exceptions import DatabaseBusy
from tasks_app.metrics.counters import database_unavailable_count, database_unavailable_seconds_add

logger = logging.getLogger("tasks_app.database")


class Unavailable(StrEnum):
    """Why the database cannot do what was asked, now; each clears by itself or by an operator's hand."""

    UNREACHABLE = "unreachable"
    READ_ONLY = "read_only"
    FULL = "full"
    LOCKED = "locked"


# What each reason says about the database, in the log line.
_SAYS = {
    Unavailable.UNREACHABLE: "cannot be reached",
    Unavailable.READ_ONLY: "refuses writes (read-only)",
    Unavailable.FULL: "is full (no room left on its disk)",
    Unavailable.LOCKED: "stays locked by another writer past the lock timeout",
}

# SQLite's primary result codes (https://sqlite.org/rescode.html).
_SQLITE_CODES = {
    5: Unavailable.LOCKED,  # SQLITE_BUSY
    6: Unavailable.LOCKED,  # SQLITE_LOCKED
    8: Unavailable.READ_ONLY,  # SQLITE_READONLY
    10: Unavailable.UNREACHABLE,  # SQLITE_IOERR
    13: Unavailable.FULL,  # SQLITE_FULL
    14: Unavailable.UNREACHABLE,  # SQLITE_CANTOPEN
    15: Unavailable.UNREACHABLE,  # SQLITE_PROTOCOL
}
# The same, for errors raised without a code (our backend's own "database is locked").
_SQLITE_TEXTS = (
    ("database is locked", Unavailable.LOCKED),
    ("database table is locked", Unavailable.LOCKED),
    ("readonly database", Unavailable.READ_ONLY),
    ("database or disk is full", Unavailable.FULL),
    ("disk i/o error", Unavailable.UNREACHABLE),
    ("unable to open database file", Unavailable.UNREACHABLE),
)
# PostgreSQL's SQLSTATEs (https://www.postgresql.org/docs/current/errcodes-appendix.html); class 08 is all
# connection exceptions.
_PG_STATES = {
    "57P01": Unavailable.UNREACHABLE,  # admin_shutdown: the server is stopping
    "57P02": Unavailable.UNREACHABLE,  # crash_shutdown
    "57P03": Unavailable.UNREACHABLE,  # cannot_connect_now: starting up or in recovery
    "53300": Unavailable.UNREACHABLE,  # too_many_connections
    "53200": Unavailable.UNREACHABLE,  # out_of_memory
    "25P03": Unavailable.UNREACHABLE,  # idle_in_transaction_session_timeout: the session was ended
    "53100": Unavailable.FULL,  # disk_full
    "25006": Unavailable.READ_ONLY,  # read_only_sql_transaction: a standby, or default_transaction_read_only
    "55P03": Unavailable.LOCKED,  # lock_not_available: lock_timeout ran out
}


def database_unavailability(error: BaseException) -> Unavailable | None:
    """Why ``error`` means the database cannot serve now, or None when it is about the statement itself.

    None for a constraint, a syntax error, a missing table: those are bugs
    or bad data, and a retry would fail the same way.
    """
    if isinstance(error, DatabaseBusy):
        # Raised by the lifecycle for a lock wait that ran out (tasks_app.plumbing.db_locks).
        return Unavailable.LOCKED
    if not isinstance(error, DatabaseError):
        return None
    cause = error.__cause__
    if isinstance(cause, sqlite3.Error):
        code = getattr(cause, "sqlite_errorcode", None)
        if code is not None and (code & 0xFF) in _SQLITE_CODES:
            return _SQLITE_CODES[code & 0xFF]
        text = str(cause).lower()
        return next((reason for needle, reason in _SQLITE_TEXTS if needle in text), None)
    sqlstate = getattr(cause, "sqlstate", None)
    if sqlstate:
        return Unavailable.UNREACHABLE if sqlstate.startswith("08") else _PG_STATES.get(sqlstate)
    if isinstance(error, OperationalError | InterfaceError):
        # No SQLSTATE: the client library's own failure (connection refused, the server closed the
        # connection, a connection already closed), or our SQLite backend's lock wait that ran out.
        text = str(error).lower()
        return next((reason for needle, reason in _SQLITE_TEXTS if needle in text), Unavailable.UNREACHABLE)
    return None


def database_described() -> str:
    """The database this process uses, as an operator finds it: the server and database, or the file."""
    database = settings.DATABASES["default"]
    if database["ENGINE"].endswith("sqlite3"):
        return f"the SQLite file {database['NAME']}"
    host = database.get("HOST") or "localhost"
    port = database.get("PORT") or 5432
    return f"PostgreSQL at {host}:{port}/{database['NAME']}"


def one_line(error: BaseException) -> str:
    """An error's text on one line, short: a log line, not a traceback."""
    text = " ".join(line.strip() for line in str(error).splitlines() if line.strip())
    return text[:240] or type(error).__name__


# What each kind of process does while the database is away, for its outage line.
_MEANWHILE = {
    "web": "requests answer 503 with Retry-After (507 for a full disk) and open streams wait",
    "worker": "commits wait and are retried; generations go on",
    "maintenance": "the sweeper, reaper and cleanup skip their rounds",
    "webhooks": "deliveries wait in the outbox",
}


# An outage ends once the database has answered for this long. A failure within it continues the outage (a
# flapping network; a disk nearly full that takes a small write and refuses the next) instead of starting
# another: one start line and one end line per outage, not a pair per flap.
SETTLE_SECONDS = 1.0


@dataclass
class _Outage:
    reason: Unavailable
    since: float
    refused: int = 0
    # Set by the first success after a failure: the token of the settle timer that may end the outage.
    answered: object | None = None
    answered_at: float = 0.0


class _Watch:
    """One process's record of the outage under way, if any."""

    def __init__(self) -> None:
        self.process = "process"
        self.outage: _Outage | None = None
        self._lock = threading.Lock()

    def failed(self, reason: Unavailable, error: BaseException) -> None:
        with self._lock:
            if self.outage is not None:
                self.outage.refused += 1
                self.outage.answered = None
                return
            self.outage = _Outage(reason, time.monotonic())
        logger.warning(
            "database unavailable: %s %s (%s); %s until it is back",
            database_described(),
            _SAYS[reason],
            one_line(error),
            _MEANWHILE.get(self.process, "work waits"),
        )
        _count(self.process, reason)

    def succeeded(self) -> None:
        token = object()
        with self._lock:
            outage = self.outage
            if outage is None or outage.answered is not None:
                return
            outage.answered, outage.answered_at = token, time.monotonic()
        timer = threading.Timer(SETTLE_SECONDS, self._settled, args=(outage, token))
        timer.daemon = True
        timer.start()

    def _settled(self, outage: _Outage, token: object) -> None:
        with self._lock:
            if self.outage is not outage or outage.answered is not token:
                return  # it failed again meanwhile: the outage goes on
            self.outage = None
        seconds = outage.answered_at - outage.since
        logger.warning(
            "database available again: %s after %.1f s (%s; %d more failures meanwhile)",
            database_described(),
            seconds,
            outage.reason.value,
            outage.refused,
        )
        _count_seconds(self.process, seconds)


_watch = _Watch()


def outage_process_set(name: str) -> None:
    """Name this process's role (``web``, ``worker``, ``maintenance``, ``webhooks``) in its outage lines and count."""
    _watch.process = name


def database_unavailable_noted(error: BaseException) -> Unavailable | None:
    """Record ``error`` if it means the database is unavailable (logged once per outage); its reason, or None."""
    reason = database_unavailability(error)
    if reason is not None:
        _watch.failed(reason, error)
    return reason


def database_available_noted() -> None:
    """The database just did what was asked: the outage under way, if any, ends once it has answered for
    ``SETTLE_SECONDS`` (logged once)."""
    if _watch.outage is not None:
        _watch.succeeded()


def database_outage() -> tuple[Unavailable, float] | None:
    """The outage this process is in now, and for how many seconds; None when the database answered last."""
    outage = _watch.outage
    if outage is None or outage.answered is not None:
        return None
    return outage.reason, time.monotonic() - outage.since


# A statement whose success proves that writes work again (a read succeeds on a read-only or full database,
# and under another writer's lock).
_WRITES = ("INSERT", "UPDATE", "DELETE")


def _observe(execute: Any, sql: str, params: Any, many: bool, context: dict[str, Any]) -> Any:
    try:
        result = execute(sql, params, many, context)
    except DatabaseError as error:
        database_unavailable_noted(error)
        raise
    outage = _watch.outage
    if (
        outage is not None
        and outage.answered is None
        and (outage.reason is Unavailable.UNREACHABLE or sql.lstrip()[:6].upper() in _WRITES)
    ):
        _watch.succeeded()
    return result


def _watch_connection(sender: Any, connection: Any, **kwargs: Any) -> None:
    # A connection object opens again after each close: install once.
    if _observe not in connection.execute_wrappers:
        connection.execute_wrappers.append(_observe)
    if _watch.outage is not None and _watch.outage.reason is Unavailable.UNREACHABLE:
        # Connected: the server is back, whatever the first statement does.
        _watch.succeeded()


def outage_watch_install() -> None:
    """Watch every connection this process opens (called once, when the app is ready)."""
    connection_created.connect(_watch_connection, dispatch_uid="lmsp-database-outages")


def _count(process: str, reason: Unavailable) -> None:
    database_unavailable_count(process=process, reason=reason.value)


def _count_seconds(process: str, seconds: float) -> None:
    database_unavailable_seconds_add(process=process, seconds=seconds)
