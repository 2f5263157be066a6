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

import pytest
from django.db import OperationalError, connection, connections, transaction

from tasks_app.db_locks import is_lock_timeout, lock_wait
from tasks_app.models import ServiceConfig

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture(autouse=True)
def _sqlite_only() -> None:
    if connection.vendor != "sqlite":
        pytest.skip("the process lock is the SQLite backend's")


def _in_thread(fn: Callable[[], object]) -> object:
    """Run ``fn`` on a thread of its own (its own connection, closed after)."""

    def run() -> object:
        try:
            return fn()
        finally:
            connections.close_all()

    with ThreadPoolExecutor(1) as pool:
        return pool.submit(run).result(timeout=60)


def _write(key: str) -> None:
    with transaction.atomic():
        ServiceConfig.objects.create(key=key, value=1)


@contextmanager
def _transaction_held_elsewhere(key: str) -> Iterator[None]:
    """Within the block, another thread is inside a write transaction (it commits at the end)."""
    holding, release = threading.Event(), threading.Event()

    def hold() -> None:
        with transaction.atomic():
            ServiceConfig.objects.create(key=key, value=1)
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

    assert set(ServiceConfig.objects.values_list("key", flat=True)) >= {"first", "second"}


def test_a_writer_whose_wait_runs_out_fails_as_sqlite_would_and_writes_nothing():
    def impatient() -> BaseException | None:
        with lock_wait(0.2):
            try:
                _write("impatient")
            except OperationalError as error:
                return error
        return None

    with _transaction_held_elsewhere("holder"):
        error = _in_thread(impatient)

    assert error is not None and is_lock_timeout(error), error
    assert not ServiceConfig.objects.filter(key="impatient").exists()
    _write("after")  # the lock was not kept by the failed attempt


def test_a_transaction_abandoned_with_its_connection_does_not_keep_the_lock():
    def abandon() -> None:
        # A transaction begun and never ended; the thread ends without closing.
        conn = connections.create_connection("default")
        conn.set_autocommit(False, force_begin_transaction_with_broken_autocommit=True)
        conn.cursor().execute("INSERT INTO service_config (key, value, updated_at) VALUES ('lost', '1', '2026-01-01')")

    thread = threading.Thread(target=abandon)
    thread.start()
    thread.join()
    gc.collect()

    _in_thread(lambda: _write("next"))
    assert set(ServiceConfig.objects.values_list("key", flat=True)) == {"next"}


def test_closing_a_connection_inside_a_transaction_lets_the_next_writer_in():
    def close_midway() -> None:
        with transaction.atomic():
            ServiceConfig.objects.create(key="closed", value=1)
            connection.close()

    _in_thread(close_midway)
    _in_thread(lambda: _write("after-close"))
    assert set(ServiceConfig.objects.values_list("key", flat=True)) == {"after-close"}
