"""A real webhook receiver (``http.server`` on 127.0.0.1, in a thread) and helpers of tests/test_webhooks.py."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import openai

from tests.support.server import REPO, free_port


@dataclass(frozen=True)
class Received:
    """One POST the receiver got: path, headers (lower-case names), the body's bytes, and what it answered."""

    path: str
    headers: dict[str, str]
    body: bytes
    answered: int


@dataclass
class Receiver:
    """Answers each POST with the next of ``statuses`` (then ``default``) and keeps what it got."""

    port: int = field(default_factory=free_port)
    statuses: list[int] = field(default_factory=list)
    default: int = 200
    received: list[Received] = field(default_factory=list)
    _server: ThreadingHTTPServer | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/hooks"

    def start(self) -> None:
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                status = receiver.statuses.pop(0) if receiver.statuses else receiver.default
                headers = {name.lower(): value for name, value in self.headers.items()}
                receiver.received.append(Received(self.path, headers, body, status))
                self.send_response(status)
                self.send_header("Content-Length", "2")
                self.end_headers()
                self.wfile.write(b"ok")

            def log_message(self, *args: object) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        threading.Thread(target=self._server.serve_forever, daemon=True).start()

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None


@contextmanager
def receiving(**options: object) -> Iterator[Receiver]:
    receiver = Receiver(**options)  # type: ignore[arg-type]
    receiver.start()
    try:
        yield receiver
    finally:
        receiver.stop()


def sdk(base: str, token: str) -> openai.OpenAI:
    """The openai package's client on this service, as a user configures it."""
    return openai.OpenAI(base_url=f"{base}/lmsp/v1", api_key=token, max_retries=0, timeout=30)


def finish_as_worker(database_url: str, task_id: str, done: object) -> None:
    """A worker process's end of a task (claim, start, succeed), then it waits to be killed (``spawn`` target)."""
    from tests.support.procs import setup_django

    setup_django(database_url)
    import time

    from tasks_app.core import lifecycle

    worker = "webhook-test@host/1"
    assert lifecycle.task_claim(task_id=task_id, worker=worker).won
    assert lifecycle.task_start(task_id=task_id, worker=worker, item_id="msg_wh").won
    ended = lifecycle.task_succeed(
        task_id=task_id, worker=worker, item_id="msg_wh", text="hi", usage=None, output_tokens=1
    )
    assert ended.won
    done.set()  # type: ignore[attr-defined]
    time.sleep(600)


@contextmanager
def deliverer_process(env: dict[str, str], log: Path) -> Iterator[Callable[[], str]]:
    """``manage.py lmsp_webhooks`` as a process of its own, output to ``log``; yields the log's tail.

    On leaving, it is stopped by SIGTERM and must exit cleanly (killed if the block failed first).
    """
    with log.open("wb") as output:
        deliverer = subprocess.Popen(
            [sys.executable, "manage.py", "lmsp_webhooks"],
            cwd=REPO,
            env={**os.environ, "LMSP_WEBHOOK_ALLOW_PRIVATE_TARGETS": "true", **env},
            stdout=output,
            stderr=output,
        )

        def tail() -> str:
            return log.read_text()[-3000:]

        try:
            yield tail
            deliverer.send_signal(signal.SIGTERM)
            assert deliverer.wait(timeout=20) == 0, tail()
        finally:
            if deliverer.poll() is None:
                deliverer.kill()
                deliverer.wait()
