"""A run's database calls that wait out an outage: retried while the database cannot be written, until
the heartbeat timeout; past it the run gives up and hands its task back (``DatabaseGaveUp``)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any, TypeVar

from django.conf import settings
from django.db import DatabaseError, connection

from tasks_app.exceptions import DatabaseBusy
from tasks_app.plumbing.database_outages import database_unavailable_noted
from tasks_app.plumbing.db_locks import is_database_unavailable

# Every line of a task's run goes under one logger, wherever its code lives: an operator follows a run by it.
logger = logging.getLogger("workers.execution")


Result = TypeVar("Result")


class DatabaseGaveUp(Exception):
    """The database could not be written for as long as a commit may wait (locked, or unreachable)."""

    def __init__(
        self, verb: str, task_id: str | None, seconds: float, cause: BaseException, *, maybe_written: bool = False
    ) -> None:
        super().__init__(f"{verb} for {task_id}: the database could not be written for {seconds:.0f} s ({cause})")
        self.seconds = seconds
        self.cause = cause
        # A try broke on an open connection: its commit may have reached the database before the answer was lost.
        self.maybe_written = maybe_written


def database_unavailable(exc: BaseException) -> bool:
    return isinstance(exc, DatabaseBusy) or (isinstance(exc, DatabaseError) and is_database_unavailable(exc))


def committed(
    verb: Callable[..., Result], *, patience: float | None = None, subject: str | None = None, **kwargs: Any
) -> Result:
    """Call a lifecycle verb, retrying while the database cannot be written (its lock, or its connection).

    A failed try wrote nothing, or (a connection that broke after its commit
    was sent) wrote it all: the verbs compare-and-set on the old status, so
    trying again is exact either way. Another process
    frozen inside a transaction holds the lock until it thaws or dies; a
    connection that broke (a server restart, a cut network, a session the
    server ended) is dropped and opened again. Past ``patience`` (the
    heartbeat timeout) the reaper may have taken the task, which the
    compare-and-set then reports as a lost race; if the database still cannot
    be written, :class:`DatabaseGaveUp` says so and the run hands its task back.
    """
    patience = settings.LMSP_HEARTBEAT_TIMEOUT_SECONDS if patience is None else patience
    subject = kwargs.get("task_id") if subject is None else subject
    started = time.monotonic()
    pause = 0.05
    maybe_written = False
    while True:
        connected = connection.connection is not None
        try:
            return verb(**kwargs)
        except (DatabaseBusy, DatabaseError) as exc:
            if not database_unavailable(exc):
                raise
            if not isinstance(exc, DatabaseBusy):
                # A broken connection stays broken: the next try opens a new one.
                connection.close()
                maybe_written = maybe_written or connected
            if time.monotonic() + pause - started >= patience:
                raise DatabaseGaveUp(
                    verb.__name__, subject, time.monotonic() - started, exc, maybe_written=maybe_written
                ) from exc
            # The outage itself is logged once per process (tasks_app.plumbing.database_outages), not per try.
            database_unavailable_noted(exc)
            logger.debug(
                "%s for %s: the database cannot be written now (%s); retrying",
                verb.__name__,
                subject,
                "locked by another writer" if isinstance(exc, DatabaseBusy) else one_line(exc),
            )
            time.sleep(pause)
            pause = min(pause * 2, 1.0)


def one_line(exc: BaseException) -> str:
    return " ".join(line.strip() for line in str(exc).splitlines() if line.strip())[:200] or type(exc).__name__
