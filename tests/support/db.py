"""Reach the test database from outside the test's own connection."""

from __future__ import annotations

import os
import signal
import sqlite3
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any
from urllib.parse import quote

from django.db import connection


def database_url() -> str:
    """A DATABASE_URL for the test database, for child processes."""
    sd = connection.settings_dict
    if connection.vendor == "sqlite":
        return f"sqlite:///{sd['NAME']}"
    auth = quote(sd.get("USER") or "", safe="")
    if sd.get("PASSWORD"):
        auth += ":" + quote(sd["PASSWORD"], safe="")
    host = sd.get("HOST") or "127.0.0.1"
    port = sd.get("PORT") or 5432
    return f"postgres://{auth}@{host}:{port}/{sd['NAME']}"


def raw_connection() -> Any:
    """A second DB-API connection, independent of Django's."""
    sd = connection.settings_dict
    if connection.vendor == "sqlite":
        return sqlite3.connect(sd["NAME"], timeout=30)
    import psycopg

    return psycopg.connect(
        host=sd.get("HOST") or "127.0.0.1",
        port=sd.get("PORT") or 5432,
        user=sd.get("USER") or None,
        password=sd.get("PASSWORD") or None,
        dbname=sd["NAME"],
        autocommit=True,
    )


def count_rows(sql: str, params: tuple = ()) -> int:
    conn = raw_connection()
    try:
        if connection.vendor != "sqlite":
            sql = sql.replace("?", "%s")
        return conn.execute(sql, params).fetchone()[0]
    finally:
        conn.close()


def open_database_handles(pid: int) -> int:
    """How many database connections process ``pid`` holds open right now (Linux /proc).

    SQLite: file descriptors on the database file itself (one per connection;
    the -wal and -shm files are not counted). PostgreSQL: TCP sockets to the
    server's port.
    """
    fd_dir = f"/proc/{pid}/fd"
    targets = []
    for name in os.listdir(fd_dir):
        try:
            targets.append(os.readlink(os.path.join(fd_dir, name)))
        except OSError:
            continue  # closed while we looked
    sd = connection.settings_dict
    if connection.vendor == "sqlite":
        path = os.path.realpath(sd["NAME"])
        return sum(1 for target in targets if target == path)
    inodes = {target[len("socket:[") : -1] for target in targets if target.startswith("socket:[")}
    return len(_server_connections(inodes))


def _server_connections(inodes: set[str]) -> list[int]:
    """The local ports of the TCP connections to the PostgreSQL server among these socket inodes."""
    server_port = int(connection.settings_dict.get("PORT") or 5432)
    ports = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as lines:
                next(lines)
                for line in lines:
                    fields = line.split()
                    if int(fields[2].rsplit(":", 1)[1], 16) == server_port and fields[9] in inodes:
                        ports.append(int(fields[1].rsplit(":", 1)[1], 16))
        except FileNotFoundError:
            continue
    return ports


def is_postgres() -> bool:
    return connection.vendor == "postgresql"


@contextmanager
def database_write_locked() -> Iterator[None]:
    """Another connection holds the write lock, as a writer frozen inside its transaction would.

    SQLite: ``BEGIN IMMEDIATE`` (one lock for the file). PostgreSQL: the tasks
    and webhook endpoints tables locked against writes (reads go on).
    Released by a rollback.
    """
    raw = raw_connection()
    try:
        if connection.vendor == "sqlite":
            raw.isolation_level = None
            raw.execute("BEGIN IMMEDIATE")
        else:
            raw.execute("BEGIN")
            # The tables a frozen writer would hold: tasks, and the webhook endpoints it may be changing.
            raw.execute("LOCK TABLE tasks, webhook_endpoints IN EXCLUSIVE MODE")
        yield
    finally:
        raw.execute("ROLLBACK")
        raw.close()


def _process_group(pgid: int) -> list[int]:
    """The live processes of process group ``pgid`` (a worker started with a session of its own)."""
    members = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as stat:
                fields = stat.read().rsplit(")", 1)[1].split()
        except OSError:
            continue  # gone while we looked
        if int(fields[2]) == pgid:
            members.append(int(name))
    return members


def _server_connection_ports(pids: list[int]) -> set[int]:
    """The local ports of these processes' TCP connections to the PostgreSQL server."""
    inodes = set()
    for pid in pids:
        try:
            names = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for name in names:
            try:
                target = os.readlink(f"/proc/{pid}/fd/{name}")
            except OSError:
                continue
            if target.startswith("socket:["):
                inodes.add(target[len("socket:[") : -1])
    return set(_server_connections(inodes))


def database_sessions_of_group(pgid: int) -> set[int]:
    """PostgreSQL: the server processes serving process group ``pgid``'s connections (none on SQLite)."""
    if connection.vendor != "postgresql":
        return set()
    ports = _server_connection_ports(_process_group(pgid))
    if not ports:
        return set()
    raw = raw_connection()
    try:
        rows = raw.execute("SELECT pid FROM pg_stat_activity WHERE client_port = ANY(%s)", (sorted(ports),))
        return {row[0] for row in rows.fetchall()}
    finally:
        raw.close()


def wait_for_sessions_to_end(backends: set[int], timeout: float = 60) -> None:
    """Until the server has ended these sessions (rolled back what a killed client left open, locks included)."""
    from tests.support.waiting import wait_until

    if not backends:
        return

    def ended() -> bool:
        raw = raw_connection()
        try:
            left = raw.execute("SELECT 1 FROM pg_stat_activity WHERE pid = ANY(%s)", (sorted(backends),))
            return left.fetchone() is None
        finally:
            raw.close()

    wait_until(ended, what=f"the server kept the killed process's sessions {sorted(backends)}", timeout=timeout)


@contextmanager
def frozen_between_transactions(pid: int, timeout: float = 30) -> Iterator[None]:
    """Process ``pid`` stopped (SIGSTOP) at a moment none of its connections is inside a transaction, so that
    nothing it holds blocks anyone while it stands still; continued (SIGCONT) at the end."""
    deadline = time.monotonic() + timeout
    while True:
        os.kill(pid, signal.SIGSTOP)
        if not _inside_a_transaction(pid):
            break
        os.kill(pid, signal.SIGCONT)
        if time.monotonic() > deadline:
            raise AssertionError(f"process {pid} was inside a transaction at every try for {timeout:g} s")
        time.sleep(0.05)
    try:
        yield
    finally:
        os.kill(pid, signal.SIGCONT)


def _inside_a_transaction(pid: int) -> bool:
    raw = raw_connection()
    try:
        if connection.vendor == "sqlite":
            # One write lock for the file: if it is taken, the stopped process may hold it (or another writer
            # did just then; the caller tries again).
            raw.isolation_level = None
            raw.execute("PRAGMA busy_timeout = 0")
            try:
                raw.execute("BEGIN IMMEDIATE")
            except sqlite3.OperationalError:
                return True
            raw.execute("ROLLBACK")
            return False
        ports = _server_connection_ports([pid])
        if not ports:
            return False
        held = raw.execute(
            "SELECT 1 FROM pg_stat_activity WHERE client_port = ANY(%s) AND state <> 'idle'", (sorted(ports),)
        )
        return held.fetchone() is not None
    finally:
        raw.close()
