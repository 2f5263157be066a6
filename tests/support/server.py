"""A real uvicorn server on the test database, in a child process."""

from __future__ import annotations

import itertools
import os
import socket
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from tests.support.preloaded import python_module
from tests.support.waiting import poll_interval

REPO = Path(__file__).resolve().parents[2]
HTTP_PROTOCOL = "lmsp_project.http_server:LmspH11Protocol"


# Ports for the servers a test starts come from a block of this process's own,
# below the kernel's ephemeral range: between the check here and the child's
# bind, no other parallel worker (each has its block) and no outgoing
# connection (those take ephemeral ports) can take the port.
_PORTS_FROM = 20000
_PORTS_PER_PROCESS = 150
# A pass of scripts/test (LMSP_TEST_PORT_SLOT) holds blocks for this many parallel workers.
_WORKERS_PER_SLOT = 40


def _port_block() -> range | None:
    """This process's ports, or None where the ephemeral range starts too low to leave room for them."""
    slot = int(os.environ.get("LMSP_TEST_PORT_SLOT") or 0)
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    # The controller (or a run without xdist) is 0; xdist's gwN is N + 1.
    index = int(worker[2:]) + 1 if worker.startswith("gw") and worker[2:].isdigit() else 0
    start = _PORTS_FROM + (slot * _WORKERS_PER_SLOT + index % _WORKERS_PER_SLOT) * _PORTS_PER_PROCESS
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    if start + _PORTS_PER_PROCESS > low:
        return None
    return range(start, start + _PORTS_PER_PROCESS)


_BLOCK = _port_block()
_next_port = itertools.cycle(_BLOCK) if _BLOCK is not None else None


def _bindable(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port() -> int:
    """A port nothing listens on, for a server a test starts (or for a test that needs a closed port)."""
    if _next_port is not None and _BLOCK is not None:
        for _ in range(len(_BLOCK)):
            port = next(_next_port)
            if _bindable(port):
                return port
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass(frozen=True)
class Server:
    base: str
    pid: int


@contextmanager
def uvicorn_server(database_url: str, extra_env: dict[str, str] | None = None) -> Iterator[str]:
    """Serve the ASGI app on a free port; yields its base URL."""
    with uvicorn_process(database_url, extra_env) as server:
        yield server.base


@contextmanager
def uvicorn_process(
    database_url: str, extra_env: dict[str, str] | None = None, *, log_path: Path | None = None
) -> Iterator[Server]:
    """Serve the ASGI app on a free port; yields its URL and process id.

    Its output goes to the test's own (``capfd`` reads it), or to ``log_path`` (at INFO: access lines too).
    """
    port = free_port()
    log = log_path.open("ab") if log_path is not None else None
    env = {**os.environ, "DATABASE_URL": database_url, **(extra_env or {})}
    # Forked from the test process's starter, which has imported uvicorn, Django and the rest once
    # (tests/support/preloaded.py): the same command line, without the interpreter's start.
    proc = python_module(
        "uvicorn",
        [
            "lmsp_project.asgi:application",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--no-access-log",
            "--log-level",
            "warning" if log is None else "info",
            "--timeout-graceful-shutdown",
            "3",
            # As the Procfile and compose run it: the limits of LMSP_HTTP_* (docs/http.md).
            "--http",
            HTTP_PROTOCOL,
            # uvicorn believes X-Forwarded-For only from the proxies the service trusts (none by default).
            "--forwarded-allow-ips",
            env.get("LMSP_TRUSTED_PROXIES", ""),
        ],
        cwd=REPO,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT if log is not None else None,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        started = time.monotonic()
        while True:
            try:
                with urllib.request.urlopen(base + "/lmsp/v1/capabilities", timeout=2):
                    break
            except OSError:
                if proc.poll() is not None or time.monotonic() > started + 30:
                    raise RuntimeError("uvicorn did not start") from None
                time.sleep(poll_interval(time.monotonic() - started))
        yield Server(base, proc.pid)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        if log is not None:
            log.close()
