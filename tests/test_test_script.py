"""scripts/test: a PostgreSQL run it cannot make is said loudly at the very end, and is an error under CI.

Each case runs the real script with pytest arguments that make its SQLite
run a collection of one small file, so that only its PostgreSQL check costs time.
"""

from __future__ import annotations

import os
import subprocess

import pytest

from tests.support.pg_stand_in import postgres_stand_in
from tests.support.server import REPO, free_port

# Its runs use databases of their own, none of the pass's: the PostgreSQL pass leaves it out (tests/conftest.py).
pytestmark = [pytest.mark.slow, pytest.mark.database_free]

SCRIPT = REPO / "scripts" / "test"
# A nested "run" that only collects one small file, without Django or the conftest: about a second.
NOTHING_TO_RUN = [
    "--collect-only",
    "-q",
    "-p",
    "no:cacheprovider",
    "-p",
    "no:django",
    "--noconftest",
    "tests/test_ids.py",
]
BANNER = "WARNING: the PostgreSQL run was SKIPPED; only SQLite was tested."


def run_script(pg_url: str, *, ci: bool = False) -> subprocess.CompletedProcess[str]:
    env = {key: value for key, value in os.environ.items() if key not in ("CI", "DATABASE_URL")}
    env["LMSP_TEST_POSTGRES_URL"] = pg_url
    if ci:
        env["CI"] = "true"
    return subprocess.run(
        [str(SCRIPT), *NOTHING_TO_RUN],
        cwd=REPO,
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=120,
    )


def last_lines(output: str, count: int) -> list[str]:
    return [line for line in output.splitlines() if line.strip()][-count:]


def test_an_unreachable_server_ends_the_output_with_a_banner_and_no_password():
    done = run_script(f"postgres://postgres:s3cret@127.0.0.1:{free_port()}/test")

    assert done.returncode == 0, done.stdout
    assert "3 tests collected" in done.stdout  # the SQLite run did run
    tail = last_lines(done.stdout, 6)
    assert tail[0].startswith("#####") and tail[-1].startswith("#####"), done.stdout
    assert BANNER in tail
    assert any("PostgreSQL not usable" in line and "dbname=test" in line for line in tail), tail
    assert "s3cret" not in done.stdout


def test_under_ci_a_missing_server_fails_the_run():
    done = run_script(f"postgres://postgres@127.0.0.1:{free_port()}/test", ci=True)

    assert done.returncode == 1, done.stdout
    assert last_lines(done.stdout, 1) == ["PostgreSQL is required under CI"]
    assert BANNER not in done.stdout


def test_a_missing_database_on_a_live_server_gets_the_command_that_creates_it():
    # A server that answers but lacks the database: the stand-in has that state on any machine,
    # so the case never depends on (or skips for) a local PostgreSQL.
    with postgres_stand_in() as server:
        name = f"lmsp_missing_{os.getpid()}"
        done = run_script(f"{server}/{name}")

    assert done.returncode == 0, done.stdout
    tail = last_lines(done.stdout, 7)
    assert BANNER in tail and tail[-1].startswith("#####"), done.stdout
    assert any(f'database "{name}" does not exist' in line for line in tail), tail
    [create] = [line for line in tail if line.startswith("To create it:")]
    assert f'CREATE DATABASE "{name}"' in create.replace('\\"', '"')
