"""Crashing real processes on purpose: clients that keep posting while the web server is killed."""

from __future__ import annotations

import http.client
import json
import os
import signal
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit


def post_json(
    base: str, path: str, *, token: str, body: Any, headers: dict[str, str] | None = None, timeout: float = 60
) -> tuple[int, Any]:
    """One JSON POST with extra headers (``sse.call`` sends none); raises if the connection breaks."""
    parts = urlsplit(base)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=timeout)
    sent = {"Authorization": f"Bearer {token}", "Content-Type": "application/json", **(headers or {})}
    try:
        conn.request("POST", path, body=json.dumps(body).encode(), headers=sent)
        response = conn.getresponse()
        raw = response.read()
        return response.status, (json.loads(raw) if raw else None)
    finally:
        conn.close()


@dataclass
class Outcome:
    """What one client request got: a status and body, or the error that broke it."""

    key: str
    status: int | None = None
    body: Any = None
    error: BaseException | None = None


@dataclass
class Barrage:
    """Requests sent by several threads at once; the server is SIGKILLed after ``kill_after`` 202s."""

    outcomes: list[Outcome] = field(default_factory=list)
    killed: threading.Event = field(default_factory=threading.Event)

    @property
    def accepted(self) -> list[Outcome]:
        return [o for o in self.outcomes if o.status == 202]

    @property
    def unanswered(self) -> list[Outcome]:
        return [o for o in self.outcomes if o.error is not None]


def post_until_killed(
    *,
    base: str,
    pid: int,
    token: str,
    threads: int,
    per_thread: int,
    kill_after: int,
    body_for: Callable[[str], Any],
) -> Barrage:
    """``threads`` clients each POST ``per_thread`` tasks (with an Idempotency-Key each).

    The thread that receives the ``kill_after``-th 202 SIGKILLs ``pid`` at
    once, while the other threads' requests are in flight. Every request
    ends as a 202, another status, or the connection error that broke it.
    """
    barrage = Barrage()
    lock = threading.Lock()
    start = threading.Barrier(threads)

    def client(index: int) -> None:
        start.wait()
        for n in range(per_thread):
            outcome = Outcome(key=f"crash-{index}-{n}")
            try:
                outcome.status, outcome.body = post_json(
                    base,
                    "/lmsp/v1/tasks",
                    token=token,
                    body=body_for(outcome.key),
                    headers={"Idempotency-Key": outcome.key},
                )
            except (OSError, http.client.HTTPException) as exc:
                outcome.error = exc
            with lock:
                barrage.outcomes.append(outcome)
                if outcome.status == 202 and len(barrage.accepted) == kill_after:
                    os.kill(pid, signal.SIGKILL)
                    barrage.killed.set()

    workers = [threading.Thread(target=client, args=(i,), name=f"crash-client-{i}") for i in range(threads)]
    for thread in workers:
        thread.start()
    for thread in workers:
        thread.join()
    return barrage
