"""Probe django-eventstream 5.3.4 against the stream contract of issue 4, over real HTTP.

Starts a private redis-server and the library's ``events`` view under uvicorn
(scratch settings in this directory, SQLite in a temp dir), sends events from
separate processes with ``send_event`` (send.py), reads the streams with a
plain HTTP client and prints what it observed. Nothing of the project is
imported; see docs/decisions/0001-event-streams-without-django-eventstream.md.

    .venv/bin/python bench/eventstream_probe/run.py [--keep] [--json PATH]
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

PROBE_DIR = Path(__file__).resolve().parent
PYTHON = sys.executable
REDIS_SERVER = shutil.which("redis-server") or "/usr/bin/redis-server"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_port(port: int, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"nothing listens on port {port}")


def wait_until(predicate: Callable[[], bool], timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return predicate()


class RedisProcess:
    """A private, non-persistent redis-server that the probe may kill and restart."""

    def __init__(self, port: int, workdir: Path) -> None:
        self.port = port
        self.workdir = workdir
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        cmd = [REDIS_SERVER, "--port", str(self.port), "--save", "", "--appendonly", "no", "--dir", str(self.workdir)]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_port(self.port)

    def kill(self) -> None:
        # SIGKILL: a crash, not a polite shutdown; clients see their sockets reset.
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait()


class ServerProcess:
    """uvicorn serving probe asgi.py; its stderr goes to a log file the probe greps."""

    def __init__(self, port: int, env: dict[str, str], log_path: Path) -> None:
        self.port = port
        self.env = env
        self.log_path = log_path
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        cmd = [PYTHON, "-m", "uvicorn", "asgi:application", "--app-dir", str(PROBE_DIR)]
        cmd += ["--host", "127.0.0.1", "--port", str(self.port), "--lifespan", "off", "--log-level", "warning"]
        with self.log_path.open("ab") as log:
            self.proc = subprocess.Popen(cmd, env=self.env, cwd=PROBE_DIR, stdout=log, stderr=log)
        wait_port(self.port)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")


@dataclass
class Frame:
    at: float
    comment: str | None = None
    event: str | None = None
    id: str | None = None
    data: str | None = None


@dataclass
class SseStream:
    """One SSE request read on a thread, so that several can stay open at once."""

    port: int
    path: str
    headers: dict[str, str] = field(default_factory=dict)
    status: int | None = None
    content_type: str | None = None
    first_chunk: bytes = b""
    frames: list[Frame] = field(default_factory=list)
    closed_by_server_at: float | None = None
    opened_at: float = 0.0
    _client_closed: bool = False
    _gate: threading.Event = field(default_factory=threading.Event)
    _conn: http.client.HTTPConnection | None = None
    _thread: threading.Thread | None = None

    def open(self) -> SseStream:
        self._gate.set()
        self.opened_at = time.monotonic()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        wait_until(lambda: self.status is not None, 10)
        return self

    def _run(self) -> None:
        self._conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=120)
        self._conn.request("GET", self.path, headers=self.headers)
        response = self._conn.getresponse()
        self.content_type = response.getheader("Content-Type")
        self.status = response.status
        buffer = b""
        try:
            while True:
                self._gate.wait()
                chunk = response.read1(65536)
                if not chunk:
                    break
                if not self.first_chunk:
                    self.first_chunk = chunk
                buffer += chunk
                while b"\n\n" in buffer:
                    block, buffer = buffer.split(b"\n\n", 1)
                    self.frames.append(self._parse(block.decode()))
        except (OSError, http.client.HTTPException, ValueError):
            pass
        if not self._client_closed:
            self.closed_by_server_at = time.monotonic()

    @staticmethod
    def _parse(block: str) -> Frame:
        frame = Frame(at=time.monotonic())
        for line in block.split("\n"):
            if line.startswith(":"):
                frame.comment = line[1:]
                continue
            name, _, value = line.partition(":")
            value = value.removeprefix(" ")
            if name == "event":
                frame.event = value
            elif name == "id":
                frame.id = value
            elif name == "data":
                frame.data = value if frame.data is None else frame.data + "\n" + value
        return frame

    def events(self) -> list[Frame]:
        return [f for f in self.frames if f.event is not None or f.data is not None]

    def types(self) -> list[str | None]:
        return [f.event for f in self.events()]

    def has(self, event_type: str) -> bool:
        return event_type in self.types()

    def pause(self) -> None:
        """Stop reading (a slow client); the server's writes back up."""
        self._gate.clear()

    def resume(self) -> None:
        self._gate.set()

    def close(self) -> None:
        self._gate.set()
        self._client_closed = self.closed_by_server_at is None
        if self._conn is not None and self._conn.sock is not None:
            try:
                self._conn.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        if self._thread is not None:
            self._thread.join(5)

    @property
    def server_closed(self) -> bool:
        return self.closed_by_server_at is not None


class Probe:
    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.redis = RedisProcess(free_port(), workdir)
        self.env = dict(os.environ)
        self.env.update(
            DJANGO_SETTINGS_MODULE="probe_settings",
            PYTHONPATH=str(PROBE_DIR),
            PROBE_DB=str(workdir / "probe.sqlite3"),
            PROBE_REDIS_PORT=str(self.redis.port),
        )
        self.server = ServerProcess(free_port(), self.env, workdir / "uvicorn.log")
        self.results: dict[str, dict[str, Any]] = {}

    # -- plumbing -----------------------------------------------------------

    def setup(self) -> None:
        self.redis.start()
        subprocess.run(
            [PYTHON, "-m", "django", "migrate", "--noinput", "-v", "0"], env=self.env, cwd=PROBE_DIR, check=True
        )
        self.server.start()

    def teardown(self) -> None:
        self.server.stop()
        self.redis.kill()

    def helper(self, *args: str) -> dict[str, Any]:
        """Run send.py in its own process (another process, as a worker would be)."""
        done = subprocess.run(
            [PYTHON, str(PROBE_DIR / "send.py"), *args], env=self.env, cwd=PROBE_DIR, capture_output=True, text=True
        )
        if done.returncode != 0:
            raise RuntimeError(f"send.py {args} failed: {done.stderr[-2000:]}")
        return json.loads(done.stdout.strip().splitlines()[-1])

    def send(self, channel: str, event_type: str, count: int = 1, pad: int = 0) -> dict[str, Any]:
        return self.helper("send", channel, event_type, str(count), str(pad))

    def stream(self, channel: str, query: str = "", headers: dict[str, str] | None = None) -> SseStream:
        return SseStream(self.server.port, f"/events/{channel}/{query}", headers or {}).open()

    def sample(self, channel: str, query: str = "", headers: dict[str, str] | None = None) -> SseStream:
        """Open a stream, read what arrives within 2 s, close it."""
        stream = self.stream(channel, query, headers)
        time.sleep(2)
        stream.close()
        return stream

    def report(self, name: str, facts: dict[str, Any]) -> None:
        self.results[name] = facts
        print(f"\n[{name}]")
        for key, value in facts.items():
            print(f"  {key}: {value}")

    def listener_state(self) -> dict[str, Any]:
        conn = http.client.HTTPConnection("127.0.0.1", self.server.port, timeout=10)
        conn.request("GET", "/probe/listener/")
        state = json.loads(conn.getresponse().read())
        conn.close()
        return state

    def subscribers(self) -> int:
        import redis  # the probe's own client, only to ask Redis who listens

        client = redis.Redis(host="127.0.0.1", port=self.redis.port)
        try:
            return dict(client.pubsub_numsub("events_channel")).get(b"events_channel", 0)
        finally:
            client.close()

    @staticmethod
    def ids(stream: SseStream) -> list[tuple[str | None, str | None]]:
        return [(f.event, f.id) for f in stream.events()]

    # -- checks -------------------------------------------------------------

    def check_a_history(self) -> None:
        self.send("a", "response.created")
        self.send("a", "response.output_text.delta", 4)
        plain = self.stream("a")
        time.sleep(3)
        plain.close()
        pad = plain.first_chunk.split(b"\n\n", 1)[0]
        self.report(
            "a) no cursor after 5 events",
            {
                "http_status": plain.status,
                "content_type": plain.content_type,
                "first_block": f"':' + {len(pad) - 1} bytes of padding (a comment)",
                "events_received(type,id)": self.ids(plain),
                "got_the_5_earlier_events": sum(t != "stream-open" for t in plain.types()) == 5,
            },
        )

    def check_b_ids(self) -> None:
        composite = self.sample("a", headers={"Last-Event-ID": "a:0"})
        plain_int = self.sample("a", headers={"Last-Event-ID": "3"})
        query = self.sample("a", query="?starting_after=2")
        error = [f.data for f in plain_int.events() if f.event == "stream-error"]
        self.report(
            "b) ids and Last-Event-ID",
            {
                "Last-Event-ID a:0 -> (type,id)": self.ids(composite),
                "Last-Event-ID 3 -> http_status": plain_int.status,
                "Last-Event-ID 3 -> (type,id)": self.ids(plain_int),
                "Last-Event-ID 3 -> stream-error data": error,
                "Last-Event-ID 3 -> closed by server": plain_int.server_closed,
                "?starting_after=2 -> (type,id)": self.ids(query),
            },
        )

    def check_c_no_close(self, hold: float) -> None:
        s = self.stream("c")
        self.send("c", "response.created")
        self.send("c", "response.completed")
        got = wait_until(lambda: s.has("response.completed"), 5)
        completed_at = time.monotonic()
        time.sleep(hold)
        after = [f for f in s.frames if f.at > completed_at]
        keepalive_raw = [f"event: {f.event} / data: {f.data!r}" for f in after if f.event == "keep-alive"]
        closed = s.server_closed
        last_id = next((f.id for f in s.events() if f.event == "response.completed"), None)
        s.close()
        # A browser's reconnect after the terminal event sends its id back.
        again = self.sample("c", headers={"Last-Event-ID": last_id or ""})
        self.report(
            "c) close after the terminal event",
            {
                "terminal_event_received": got,
                "seconds_read_after_it": hold,
                "closed_by_server": closed,
                "frames_after_terminal(type,id)": [(f.event, f.id) for f in after],
                "keep_alive_frame": keepalive_raw[:1],
                f"reconnect with Last-Event-ID {last_id} -> http_status": again.status,
                "reconnect -> (type,id)": self.ids(again),
                "reconnect -> closed by server": again.server_closed,
            },
        )

    def check_d_reset(self) -> None:
        sent = self.send("d", "response.output_text.delta", 6)
        trimmed = self.helper("trim", "d", "3")
        old = self.sample("d", headers={"Last-Event-ID": "d:2"})
        past = self.sample("d", headers={"Last-Event-ID": "d:99"})
        reset = [(f.id, f.data) for f in old.events() if f.event == "stream-reset"]
        self.report(
            "d) cursor older than the retained events",
            {
                "sent": sent,
                "after library trim (events aged 25 h)": trimmed,
                "Last-Event-ID d:2 -> http_status": old.status,
                "Last-Event-ID d:2 -> (type,id)": self.ids(old),
                "stream-reset (id,data)": reset,
                "Last-Event-ID d:99 (past the end) -> http_status": past.status,
                "Last-Event-ID d:99 -> (type,id)": self.ids(past),
            },
        )

    def _outage(self, label: str, down_seconds: float) -> dict[str, Any]:
        facts: dict[str, Any] = {}
        a = self.stream("e")
        wait_until(lambda: a.has("stream-open"), 5)
        self.send("e", f"{label}.before")
        facts["baseline: open stream got a live event"] = wait_until(lambda: a.has(f"{label}.before"), 5)
        facts["before: subscribers on events_channel"] = self.subscribers()

        killed = time.monotonic()
        self.redis.kill()
        if down_seconds >= 3:
            # A write while Redis is down: stored in the library's table, then publish fails.
            facts["send_event while Redis is down"] = self.send("e", f"{label}.during")
        time.sleep(max(0.0, down_seconds - (time.monotonic() - killed)))
        self.redis.start()
        facts["redis down for (s)"] = round(time.monotonic() - killed, 1)
        time.sleep(2)  # let a surviving subscriber reconnect
        facts["after restart: subscribers on events_channel"] = self.subscribers()
        facts["after restart: library listener state"] = self.listener_state()

        self.send("e", f"{label}.after")
        facts["open stream got the event sent after the restart"] = wait_until(lambda: a.has(f"{label}.after"), 5)
        if down_seconds >= 3:
            facts["open stream ever got the event sent during the outage"] = a.has(f"{label}.during")
        fresh = self.stream("e")
        wait_until(lambda: fresh.has("stream-open"), 5)
        self.send("e", f"{label}.fresh")
        facts["new stream (opened after restart) got a live event"] = wait_until(lambda: fresh.has(f"{label}.fresh"), 5)
        facts["open stream closed by server"] = a.server_closed
        facts["open stream events(type)"] = a.types()
        a.close()
        fresh.close()
        return facts

    def check_e_redis_restart(self) -> None:
        self.report("e1) Redis killed, back after ~1 s", self._outage("short", 1.0))
        # A fresh server process, so the long outage starts from a live subscriber.
        self.server.stop()
        log_before = len(self.server.log())
        self.server.start()
        facts = self._outage("long", 10.0)
        new_log = self.server.log()[log_before:]
        markers = ("Task exception was never retrieved", "Traceback", "ConnectionError", "Connection refused")
        facts["server log after the outage"] = [m for m in markers if m in new_log]
        self.report("e2) Redis killed, back after ~10 s", facts)

    def check_f_append_cost(self) -> None:
        self.report("f) append cost of DjangoModelStorage (SQLite, indicative)", self.helper("bench"))

    def check_g_burst(self, count: int) -> None:
        s = self.stream("g")
        wait_until(lambda: s.has("stream-open"), 5)
        log_before = len(self.server.log())
        self.send("g", "burst", count)
        wait_until(lambda: s.types().count("burst") >= count, 10)
        # The same library call inside a transaction, as our worker's lifecycle commit would make it.
        in_txn = self.helper("send-txn", "g", "txn", "30", "commit")
        wait_until(lambda: s.types().count("txn") >= 30, 5)
        rolled_back = self.helper("send-txn", "g", "rolled.back", "1", "rollback")
        time.sleep(1)
        s.close()
        # A slow reader: more than MAX_PENDING events pile up while its writes are blocked.
        slow = self.stream("h")
        wait_until(lambda: slow.has("stream-open"), 5)
        slow.pause()
        self.send("h", "big", 120, 65536)
        time.sleep(1)
        slow.resume()
        wait_until(lambda: slow.types().count("big") >= 120, 15)
        time.sleep(0.5)
        slow.close()
        big = [int(f.id.split(":")[1]) for f in slow.events() if f.event == "big" and f.id]
        bursts = [int(f.id.split(":")[1]) for f in s.events() if f.event == "burst" and f.id]
        self.report(
            "g) bursts, MAX_PENDING=10 and transactions",
            {
                "burst of separate send_event calls: sent": count,
                "burst: received": len(bursts),
                "burst: in order, no gap or duplicate": bursts == list(range(bursts[0], bursts[0] + len(bursts)))
                if bursts
                else False,
                "30 send_event in one transaction: sender": in_txn,
                "30 in one transaction: received by the open stream": s.types().count("txn"),
                "1 send_event in a rolled-back transaction: sender": rolled_back,
                "rolled-back event delivered to the open stream": s.has("rolled.back"),
                "slow reader, 120 events of 64 KiB: received": len(big),
                "slow reader: in order, no gap or duplicate": big == list(range(1, len(big) + 1)),
                "'could not queue event' (MAX_PENDING overflow) log lines": self.server.log()[log_before:].count(
                    "could not queue event"
                ),
            },
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--keep", action="store_true", help="keep the temp dir (database, uvicorn.log)")
    parser.add_argument("--json", type=Path, help="also write the observed facts as JSON here")
    parser.add_argument("--hold", type=float, default=22.0, help="seconds to read after the terminal event")
    args = parser.parse_args()

    workdir = Path(tempfile.mkdtemp(prefix="eventstream-probe-"))
    probe = Probe(workdir)
    print(f"workdir {workdir}; redis :{probe.redis.port}; uvicorn :{probe.server.port}")
    try:
        probe.setup()
        probe.check_a_history()
        probe.check_b_ids()
        probe.check_c_no_close(args.hold)
        probe.check_d_reset()
        probe.check_f_append_cost()
        probe.check_g_burst(100)
        # Last: the long outage leaves this server without live events.
        probe.check_e_redis_restart()
    finally:
        probe.teardown()
        if args.json:
            args.json.write_text(json.dumps(probe.results, indent=2, default=str))
        if not args.keep:
            shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
