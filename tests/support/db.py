"""Reach the test database from outside the test's own connection."""

from __future__ import annotations

import sqlite3
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
