"""SQLite: the writers of one process queue on a lock of the process (tasks_app/db/sqlite3/base.py).

The lock replaces SQLite's sleeping busy handler for threads of one process;
what a writer sees must not change: it waits for the transaction ahead of
it, gives up with SQLite's own ``database is locked`` after its busy timeout
having written nothing, and no ended (or abandoned) transaction keeps the
lock.
"""

from __future__ import annotations

import gc
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from django.conf import settings
from django.db import OperationalError, connections

from tasks_app.db.sqlite3.base import DatabaseWrapper
from tasks_app.plumbing.db_locks import is_lock_timeout

# A database of these tests' own, on this backend whatever the suite runs on
# (SQLite or PostgreSQL), so the backend is checked in both runs. Its
# connections are made here, one per thread, as Django makes them.
ALIAS = "writer_lock_check"
_config: dict[str, Any] = {}
_local = threading.local()


@pytest.fixture(autouse=True)
def _own_sqlite_file(tmp_path: Path, django_db_blocker: Any) -> Iterator[None]:
    database = {
        "ENGINE": "tasks_app.db.sqlite3",
        "NAME": str(tmp_path / "writer-lock.sqlite3"),
        # As lmsp_project/settings.py opens SQLite.
        "OPTIONS": {
            "transaction_mode": "IMMEDIATE",
            "timeout": settings.SQLITE_BUSY_TIMEOUT_SECONDS,
            "init_command": "PRAGMA journal_mode=WAL;",
        },
    }
    _config.update(connections.configure_settings({"default": database})["default"])
    # Not the test database: pytest-django's guard is for that one.
    with django_db_blocker.unblock():
        with _connection().cursor() as cursor:
            cursor.execute("CREATE TABLE kv (key TEXT PRIMARY KEY)")
        try:
            yield
        finally:
            _close()


def _connection() -> DatabaseWrapper:
    """This thread's connection to the test's file."""
    if getattr(_local, "connection", None) is None:
        _local.connection = DatabaseWrapper(dict(_config), ALIAS)
    return _local.connection


def _close() -> None:
    if getattr(_local, "connection", None) is not None:
        _local.connection.close()
        _local.connection = None


@contextmanager
def _transaction() -> Iterator[Any]:
    """A write transaction, begun and ended as ``transaction.atomic`` does."""
    conn = _connection()
    conn.set_autocommit(False, force_begin_transaction_with_broken_autocommit=True)
    try:
        with conn.cursor() as cursor:
            yield cursor
        conn.commit()
    except BaseException:
        if conn.connection is not None:
            conn.rollback()
        raise
    finally:
        if conn.connection is not None:
            conn.set_autocommit(True)


def _keys() -> set[str]:
    with _connection().cursor() as cursor:
        cursor.execute("SELECT key FROM kv")
        return {key for (key,) in cursor.fetchall()}


def _in_thread(fn: Callable[[], object]) -> object:
    """Run ``fn`` on a thread of its own (its own connection, closed after)."""

    def run() -> object:
        try:
            return fn()
        finally:
            _close()

    with ThreadPoolExecutor(1) as pool:
        return pool.submit(run).result(timeout=60)


def _write(key: str) -> None:
    with _transaction() as cursor:
        cursor.execute("INSERT INTO kv (key) VALUES (%s)", [key])


@contextmanager
def _transaction_held_elsewhere(key: str) -> Iterator[None]:
    """Within the block, another thread is inside a write transaction (it commits at the end)."""
    holding, release = threading.Event(), threading.Event()

    def hold() -> None:
        with _transaction() as cursor:
            cursor.execute("INSERT INTO kv (key) VALUES (%s)", [key])
            holding.set()
            release.wait(30)

    with ThreadPoolExecutor(1) as pool:
        holder = pool.submit(lambda: _in_thread(hold))
        holding.wait(30)
        try:
            yield
        finally:
            release.set()
            holder.result(timeout=60)


def test_a_writer_waits_for_the_transaction_ahead_of_it_and_then_commits():
    with ThreadPoolExecutor(1) as pool:
        with _transaction_held_elsewhere("first"):
            second = pool.submit(lambda: _in_thread(lambda: _write("second")))
        second.result(timeout=60)

    assert _keys() == {"first", "second"}


def test_a_writer_whose_wait_runs_out_fails_as_sqlite_would_and_writes_nothing():
    def impatient() -> BaseException | None:
        # What tasks_app.plumbing.db_locks.lock_wait does on SQLite.
        with _connection().cursor() as cursor:
            cursor.execute("PRAGMA busy_timeout = 200")
        try:
            _write("impatient")
        except OperationalError as error:
            return error
        return None

    with _transaction_held_elsewhere("holder"):
        error = _in_thread(impatient)

    assert error is not None and is_lock_timeout(error), error
    assert "impatient" not in _keys()
    _write("after")  # the lock was not kept by the failed attempt


def test_a_transaction_abandoned_with_its_connection_does_not_keep_the_lock():
    def abandon() -> None:
        # A transaction begun and never ended; the thread ends without closing.
        conn = DatabaseWrapper(dict(_config), ALIAS)
        conn.set_autocommit(False, force_begin_transaction_with_broken_autocommit=True)
        conn.cursor().execute("INSERT INTO kv (key) VALUES ('lost')")

    thread = threading.Thread(target=abandon)
    thread.start()
    thread.join()
    gc.collect()

    _in_thread(lambda: _write("next"))
    assert _keys() == {"next"}


def test_closing_a_connection_inside_a_transaction_lets_the_next_writer_in():
    def close_midway() -> None:
        with _transaction() as cursor:
            cursor.execute("INSERT INTO kv (key) VALUES ('closed')")
            _close()

    _in_thread(close_midway)
    _in_thread(lambda: _write("after-close"))
    assert _keys() == {"after-close"}


def test_a_commit_lets_the_next_writer_in_while_its_connection_stays_open():
    committed, finish = threading.Event(), threading.Event()

    def first() -> None:
        _write("first")
        committed.set()
        finish.wait(30)  # the connection stays open, as a web thread's does between requests

    with ThreadPoolExecutor(1) as pool:
        holder = pool.submit(lambda: _in_thread(first))
        committed.wait(30)
        try:
            with _connection().cursor() as cursor:
                cursor.execute("PRAGMA busy_timeout = 200")  # a free lock needs no wait at all
            _write("second")
        finally:
            finish.set()
            holder.result(timeout=60)

    assert _keys() == {"first", "second"}
