"""SQLite durability as configured: what a fresh process really gets from the file."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

# No database of the pass here: the PostgreSQL pass of scripts/test leaves these out (tests/conftest.py).
pytestmark = pytest.mark.database_free

ROOT = Path(__file__).resolve().parent.parent
PROBE = "from django.db import connection; print(connection.cursor().execute('PRAGMA synchronous').fetchone()[0])"


def run_probe(tmp_path: Path, synchronous: str | None) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("DATABASE_URL", "LMSP_SQLITE_SYNCHRONOUS")}
    env["DATABASE_URL"] = f"sqlite:///{tmp_path / 'probe.sqlite3'}"
    if synchronous is not None:
        env["LMSP_SQLITE_SYNCHRONOUS"] = synchronous
    return subprocess.run(
        [sys.executable, "manage.py", "shell", "-c", PROBE],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.mark.parametrize(("configured", "pragma"), [(None, "2"), ("normal", "1"), ("FULL", "2")])
def test_the_synchronous_setting_reaches_every_connection(tmp_path: Path, configured: str | None, pragma: str):
    done = run_probe(tmp_path, configured)

    assert done.returncode == 0, done.stderr
    # SQLite: 1 is NORMAL, 2 is FULL; unset is FULL, so that a 202 survives a power loss.
    assert done.stdout.strip().splitlines()[-1] == pragma


def test_an_unknown_synchronous_mode_stops_the_start_with_a_clear_message(tmp_path: Path):
    done = run_probe(tmp_path, "OFF")

    assert done.returncode != 0
    assert "LMSP_SQLITE_SYNCHRONOUS must be NORMAL or FULL, got 'OFF'" in done.stderr
