"""A real uvicorn server on the test database, in a child process."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
HTTP_PROTOCOL = "lmsp_project.http_server:LmspH11Protocol"


def free_port() -> int:
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
def uvicorn_process(database_url: str, extra_env: dict[str, str] | None = None) -> Iterator[Server]:
    """Serve the ASGI app on a free port; yields its URL and process id."""
    port = free_port()
    env = {**os.environ, "DATABASE_URL": database_url, **(extra_env or {})}
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "uvicorn",
            "lmsp_project.asgi:application",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--no-access-log",
            "--log-level",
            "warning",
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
    )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                with urllib.request.urlopen(base + "/lmsp/v1/capabilities", timeout=2):
                    break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("uvicorn did not start") from None
                time.sleep(0.1)
        yield Server(base, proc.pid)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
