"""Reach the test database from outside the test's own connection."""

from __future__ import annotations

import os
import sqlite3
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
    port = int(sd.get("PORT") or 5432)
    inodes = {target[len("socket:[") : -1] for target in targets if target.startswith("socket:[")}
    count = 0
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as lines:
                next(lines)
                for line in lines:
                    fields = line.split()
                    remote_port = int(fields[2].rsplit(":", 1)[1], 16)
                    if remote_port == port and fields[9] in inodes:
                        count += 1
        except FileNotFoundError:
            continue
    return count


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
