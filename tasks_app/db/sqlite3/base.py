"""Django's SQLite backend, with one process's writers queued on a lock before ``BEGIN IMMEDIATE``.

SQLite has one write lock per database file. A connection that finds it
held sleeps in SQLite's busy handler, in steps that grow from 1 ms to 100 ms,
and tries again, so threads of one web process that queue behind each other
pay tens of milliseconds for a lock that was free again after one. Here a
transaction first takes a lock of this process, per database file: a thread
waiting on it wakes as soon as it is released, and ``BEGIN IMMEDIATE`` only
ever waits for other processes (workers, the maintenance node).

The wait for the process lock and the ``BEGIN`` after it together stay
within the connection's busy timeout (``PRAGMA busy_timeout``, which
``tasks_app.plumbing.db_locks.lock_wait`` may change) and a tenth of it; when it runs
out the transaction fails with SQLite's own error, ``database is locked``,
having written nothing. The lock is released when the transaction ends
(commit, rollback, close), or when its connection is dropped unclosed.
"""

from __future__ import annotations

import sqlite3
import threading
import time
import weakref
from typing import Any

from django.db.backends.sqlite3 import base
from django.db.utils import OperationalError

_locks: dict[str, threading.Lock] = {}
_locks_guard = threading.Lock()


def _writer_lock(name: str) -> threading.Lock:
    with _locks_guard:
        return _locks.setdefault(name, threading.Lock())


class _Connection(sqlite3.Connection):
    """sqlite3's connection, knowing its busy timeout, and weakly referable (to release the lock if dropped)."""

    busy_timeout_ms = 0

    def busy_timeout_refresh(self) -> None:
        (self.busy_timeout_ms,) = self.execute("PRAGMA busy_timeout").fetchone()


class _Cursor(base.SQLiteCursorWrapper):
    def execute(self, query: str, params: Any = None) -> Any:
        result = super().execute(query, params)
        if params is None and query[:19].upper() == "PRAGMA BUSY_TIMEOUT":
            self.connection.busy_timeout_refresh()
        return result


class DatabaseWrapper(base.DatabaseWrapper):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._writer_release: weakref.finalize | None = None

    def get_connection_params(self) -> dict[str, Any]:
        return {**super().get_connection_params(), "factory": _Connection}

    def get_new_connection(self, conn_params: dict[str, Any]) -> _Connection:
        conn = super().get_new_connection(conn_params)
        conn.busy_timeout_refresh()  # after the init commands
        return conn

    def create_cursor(self, name: str | None = None) -> _Cursor:
        return self.connection.cursor(factory=_Cursor)

    def _start_transaction_under_autocommit(self) -> None:
        if self.is_in_memory_db():
            super()._start_transaction_under_autocommit()
            return
        lock = _writer_lock(str(self.settings_dict["NAME"]))
        waited = 0.0
        timeout = self.connection.busy_timeout_ms / 1000
        if not lock.acquire(blocking=False):
            started = time.monotonic()
            if not lock.acquire(timeout=timeout):
                raise OperationalError("database is locked") from sqlite3.OperationalError("database is locked")
            waited = time.monotonic() - started
        # Released exactly once: by the end of the transaction, or with the connection.
        self._writer_release = weakref.finalize(self.connection, lock.release)
        try:
            if waited <= timeout / 10:
                # Short waits (the usual queue) are not worth two more statements.
                super()._start_transaction_under_autocommit()
            else:
                self._begin_within(timeout - waited)
        except BaseException:
            self._release_writer_lock()
            raise

    def _begin_within(self, seconds: float) -> None:
        restore = self.connection.busy_timeout_ms
        with self.wrap_database_errors:
            self.connection.execute(f"PRAGMA busy_timeout = {max(1, int(seconds * 1000))}")
        try:
            super()._start_transaction_under_autocommit()
        finally:
            with self.wrap_database_errors:
                self.connection.execute(f"PRAGMA busy_timeout = {restore}")

    def _release_writer_lock(self) -> None:
        release, self._writer_release = self._writer_release, None
        if release is not None:
            release()

    def _release_if_ended(self) -> None:
        if self._writer_release is not None and (self.connection is None or not self.connection.in_transaction):
            self._release_writer_lock()

    def _commit(self) -> None:
        try:
            super()._commit()
        finally:
            self._release_if_ended()

    def _rollback(self) -> None:
        try:
            super()._rollback()
        finally:
            self._release_if_ended()

    def _close(self) -> None:
        try:
            super()._close()
        finally:
            self._release_writer_lock()
