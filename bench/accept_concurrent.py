"""Accepting tasks under concurrency: ``POST /lmsp/v1/tasks`` against one real web process, N clients at once.

Starts the web process exactly as the Procfile's ``web:`` line does, on a
fresh scratch database (SQLite file, or a new PostgreSQL database created
next to ``--database-url`` and dropped afterwards), with no worker: the run
messages go to a queue nobody consumes. Then, for each client count, every
client sends ``POST /tasks`` back to back on its own keep-alive connection for
``--duration`` seconds and the run prints creations/s and latency
percentiles. The load generator writes raw HTTP/1.1 on asyncio sockets, so it
takes little of the CPU the web process needs. Needs Redis on REDIS_URL.

    .venv/bin/python bench/accept_concurrent.py [--clients 1,4,16] [--duration 10] [--database-url URL]

Set ``LMSP_SQLITE_SYNCHRONOUS`` (and any other ``LMSP_*``) in the environment:
it reaches the web process unchanged.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import subprocess
import sys
import time
import urllib.parse
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from scratch import REPO, demo_model_register, django_in_scratch

BODY = json.dumps({"type": "response", "input": {"model": "demo", "input": "Hello", "max_output_tokens": 16}}).encode()
WARMUP_SECONDS = 1.0


def procfile_web_command() -> str:
    """The shell command of the Procfile's ``web:`` line."""
    for line in (REPO / "Procfile").read_text().splitlines():
        if line.startswith("web:"):
            return line.split(":", 1)[1].strip()
    raise SystemExit("Procfile has no web: line")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextmanager
def fresh_postgres(url: str):
    """A new database on ``url``'s server, dropped afterwards; yields its URL."""
    import psycopg

    parts = urllib.parse.urlsplit(url)
    name = f"{parts.path.lstrip('/') or 'lmsp'}_accept_{os.getpid()}"
    admin = psycopg.connect(urllib.parse.urlunsplit(parts._replace(path="/postgres")), autocommit=True)
    admin.execute(f'CREATE DATABASE "{name}"')
    try:
        yield urllib.parse.urlunsplit(parts._replace(path=f"/{name}"))
    finally:
        admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        admin.close()


@contextmanager
def web_process(port: int, log_path: Path, extra_args: str):
    env = {**os.environ, "LMSP_HOST": "127.0.0.1", "LMSP_PORT": str(port)}
    command = f"{procfile_web_command()} {extra_args}".strip()
    with log_path.open("wb") as log:
        proc = subprocess.Popen(["bash", "-c", command], cwd=REPO, env=env, stdout=log, stderr=log)
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise SystemExit(f"the web process did not start:\n{log_path.read_text()[-3000:]}") from None
                time.sleep(0.1)
        yield proc
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@dataclass
class Tally:
    latencies_ms: list[float] = field(default_factory=list)
    statuses: dict[int, int] = field(default_factory=dict)
    answered: int = 0
    """Every response, the warm-up's too (for the web process's CPU per request)."""


async def _read_response(reader: asyncio.StreamReader) -> int:
    head = await reader.readuntil(b"\r\n\r\n")
    lines = head.split(b"\r\n")
    status = int(lines[0].split(b" ", 2)[1])
    length = 0
    for line in lines[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            length = int(value)
    if length:
        await reader.readexactly(length)
    return status


async def _client(port: int, token: str, start_at: float, stop_at: float, tally: Tally) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    request = (
        b"POST /lmsp/v1/tasks HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer " + token.encode() + b"\r\n"
        b"Content-Type: application/json\r\nContent-Length: " + str(len(BODY)).encode() + b"\r\n\r\n" + BODY
    )
    loop = asyncio.get_running_loop()
    try:
        while (now := loop.time()) < stop_at:
            writer.write(request)
            status = await _read_response(reader)
            done = loop.time()
            tally.answered += 1
            if now >= start_at:
                tally.latencies_ms.append((done - now) * 1000)
                tally.statuses[status] = tally.statuses.get(status, 0) + 1
    finally:
        writer.close()


async def _load(port: int, token: str, clients: int, duration: float) -> Tally:
    tally = Tally()
    loop = asyncio.get_running_loop()
    start_at = loop.time() + WARMUP_SECONDS
    stop_at = start_at + duration
    await asyncio.gather(*(_client(port, token, start_at, stop_at, tally) for _ in range(clients)))
    return tally


def _cpu_seconds(pid: int) -> float:
    """User + system CPU time so far of process ``pid`` and its children (``--workers``); Linux, NaN elsewhere."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        children = [
            int(child)
            for task in Path(f"/proc/{pid}/task").iterdir()
            for child in (task / "children").read_text().split()
        ]
    except OSError:
        return float("nan")
    own = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return own + sum(_cpu_seconds(child) for child in children)


def _percentile(ordered: list[float], q: float) -> float:
    return ordered[min(len(ordered) - 1, int(len(ordered) * q))] if ordered else float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", default="1,4,16", help="comma-separated client counts, one run each")
    parser.add_argument("--duration", type=float, default=10.0, help="seconds measured per client count")
    parser.add_argument("--database-url", default=None, help="a PostgreSQL server to make a fresh database on")
    parser.add_argument("--web-args", default="", help="appended to the Procfile's web command (e.g. '--workers 2')")
    args = parser.parse_args()
    counts = [int(n) for n in args.clients.split(",")]

    if args.database_url and not args.database_url.startswith("sqlite"):
        with fresh_postgres(args.database_url) as url:
            run(counts, args.duration, url, args.web_args)
    else:
        run(counts, args.duration, None, args.web_args)


def run(counts: list[int], duration: float, database_url: str | None, web_args: str) -> None:
    # DJANGO_SETTINGS_MODULE from the environment is kept: a settings module
    # that changes one thing (an ENGINE, say) makes an A/B comparison.
    env = {"LMSP_MAX_QUEUED_TASKS": "10000000", "DJANGO_SETTINGS_MODULE": os.environ.get("DJANGO_SETTINGS_MODULE", "")}
    scratch = django_in_scratch("accept-concurrent", database_url=database_url, env={k: v for k, v in env.items() if v})
    from django.conf import settings
    from django.db import connections

    from tasks_app.services.clients import client_create

    demo_model_register(scratch)
    _, token = client_create(name=f"bench-{time.time_ns()}", scopes="responses,read")
    connections.close_all()  # a PostgreSQL database with a session open cannot be dropped
    engine = settings.DATABASES["default"]["ENGINE"].rsplit(".", 1)[-1]
    sync = os.environ.get("LMSP_SQLITE_SYNCHRONOUS", "default") if "sqlite" in engine else "-"
    print(f"database {engine} (synchronous {sync}); web: the Procfile's web line {web_args}".rstrip())
    print(
        f"{'clients':>7} {'creations/s':>11} {'p50 ms':>8} {'p90 ms':>8} {'p99 ms':>8} {'max ms':>8} "
        f"{'web cpu ms':>10}  statuses"
    )
    port = free_port()
    # The scratch setup removes the bench's Redis keys (its queue of run messages) at exit.
    with web_process(port, scratch / "web.log", web_args) as web:
        print(f"web process {web.pid}, log {scratch / 'web.log'}", flush=True)
        for clients in counts:
            cpu_before = _cpu_seconds(web.pid)
            tally = asyncio.run(_load(port, token, clients, duration))
            cpu_ms = (_cpu_seconds(web.pid) - cpu_before) * 1000
            ordered = sorted(tally.latencies_ms)
            accepted = tally.statuses.get(202, 0)
            per_request = cpu_ms / tally.answered if tally.answered else float("nan")
            print(
                f"{clients:>7} {accepted / duration:>11.1f} {_percentile(ordered, 0.5):>8.1f} "
                f"{_percentile(ordered, 0.9):>8.1f} {_percentile(ordered, 0.99):>8.1f} "
                f"{(ordered[-1] if ordered else float('nan')):>8.1f} {per_request:>10.2f}  "
                f"{dict(sorted(tally.statuses.items()))}",
                flush=True,
            )


if __name__ == "__main__":
    sys.exit(main())
