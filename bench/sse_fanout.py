"""SSE fan-out benchmark: many event streams on one uvicorn process.

Starts a private LMSP installation (SQLite in a temp dir, its own Redis
prefix and Celery queue, one uvicorn process, one Celery worker), opens many
``GET /lmsp/v1/tasks/{id}/events`` streams with a raw asyncio HTTP/1.1 client
(a Protocol that only keeps what it reads and when; every body is decoded and
checked after the run, so the client costs little while it measures) and
measures

* delivery latency from the worker's commit to the client, twice: from the
  arrival of the worker's Redis wake-up in a separate subscriber process
  (published after the commit, so this errs low: a lower bound), and from
  ``task_events.created_at`` (stamped before the commit's statements run, so
  this errs high: an upper bound);
* the web process's resident memory per open stream, idle and while
  generating;
* the integrity of every stream (contiguous sequence numbers, exactly one
  terminal event, a clean end of the chunked body).

Run ``.venv/bin/python bench/sse_fanout.py --help``; bench/README.md explains
the output. Nothing here asserts timings: the numbers are printed and, with
``--json``, written out.
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import contextlib
import datetime as dt
import json
import math
import os
import platform
import resource
import shutil
import signal
import socket
import sqlite3
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from array import array
from collections import defaultdict
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
HOST = "127.0.0.1"
TERMINAL_TYPES = frozenset({b"response.completed", b"response.incomplete", b"response.failed", b"response.cancelled"})
CLK_TCK = os.sysconf("SC_CLK_TCK")
TARGETS = {"p50_ms": 20.0, "p99_ms": 100.0, "kib_per_stream": 2048.0, "streams": 500}


# --------------------------------------------------------------------------
# Small helpers
# --------------------------------------------------------------------------


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def proc_status(pid: int, key: str) -> int:
    """A numeric field of /proc/<pid>/status (0 once the process is gone)."""
    try:
        with open(f"/proc/{pid}/status") as status:
            for line in status:
                if line.startswith(key):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def rss_kib(pid: int) -> int:
    """VmRSS of ``pid`` in KiB."""
    return proc_status(pid, "VmRSS:")


def thread_count(pid: int) -> int:
    return proc_status(pid, "Threads:")


def group_processes(pgid: int) -> Iterator[tuple[int, list[str]]]:
    """The live processes of a process group: each pid with its ``/proc/<pid>/stat`` fields from the state on
    (field 3 at index 0)."""
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as stat:
                text = stat.read()
        except OSError:
            continue
        rest = text[text.rfind(")") + 2 :].split()
        if int(rest[2]) == pgid:
            yield int(entry), rest


def cpu_seconds_of_group(pgid: int) -> float:
    """User+system CPU of the live processes of a process group.

    The worker is a prefork parent plus a child that does the work (and, since issue 44, each worker process's
    engine process), so the group (each service runs in its own session) is the honest unit.
    """
    return sum(int(rest[11]) + int(rest[12]) for _, rest in group_processes(pgid)) / CLK_TCK


def rss_of_group(pgid: int) -> dict[str, float]:
    """Resident memory (MiB) of a worker's processes: its engine processes (since issue 44) and the rest."""
    found: dict[str, float] = {"worker": 0.0, "engine": 0.0}
    for pid, rest in group_processes(pgid):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as cmdline:
                command = cmdline.read()
        except OSError:
            continue
        kind = "engine" if b"workers.engine_process.host" in command else "worker"
        found[kind] += int(rest[21]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    return {kind: round(mib, 1) for kind, mib in found.items()}


def cpu_pressure_seconds() -> float:
    """Seconds since boot in which some runnable task waited for a CPU (PSI, /proc/pressure/cpu; NaN without it)."""
    try:
        with open("/proc/pressure/cpu") as pressure:
            some = pressure.readline().split()
    except OSError:
        return float("nan")
    return int(some[-1].partition("=")[2]) / 1e6


def machine_cpu_seconds() -> tuple[float, float]:
    """(busy, steal): CPU seconds of all cores outside idle and iowait, and of them taken by the hypervisor."""
    try:
        with open("/proc/stat") as stat:
            fields = [int(value) for value in stat.readline().split()[1:9]]
    except (OSError, ValueError):
        return float("nan"), float("nan")
    # user nice system idle iowait irq softirq steal
    return (sum(fields) - fields[3] - fields[4]) / CLK_TCK, fields[7] / CLK_TCK


def percentile(sorted_values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile of an already sorted sequence."""
    if not sorted_values:
        return float("nan")
    rank = max(1, min(len(sorted_values), math.ceil(q / 100 * len(sorted_values))))
    return sorted_values[rank - 1]


def summarize_ms(values: list[float]) -> dict[str, Any]:
    """p50/p90/p99/max (and count, min, mean) of seconds, in milliseconds."""
    values.sort()
    if not values:
        return {"count": 0}
    return {
        "count": len(values),
        "min_ms": round(values[0] * 1000, 3),
        "mean_ms": round(sum(values) / len(values) * 1000, 3),
        "p50_ms": round(percentile(values, 50) * 1000, 3),
        "p90_ms": round(percentile(values, 90) * 1000, 3),
        "p99_ms": round(percentile(values, 99) * 1000, 3),
        "max_ms": round(values[-1] * 1000, 3),
    }


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind((HOST, 0))
        return sock.getsockname()[1]


# --------------------------------------------------------------------------
# The Redis subscriber (a separate process, so that its clock readings are not
# delayed by the client's event loop or its GIL)
# --------------------------------------------------------------------------


def subscriber_main(redis_url: str, channel: str, out_path: str) -> None:
    import redis

    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    client = redis.Redis.from_url(redis_url)
    pubsub = client.pubsub()
    pubsub.subscribe(channel)
    lines: list[str] = []
    announced = False
    while not stop.is_set():
        message = pubsub.get_message(timeout=0.2)
        arrived = time.time()
        if message is None:
            continue
        if message["type"] == "subscribe" and not announced:
            # The parent waits for this line: no publish is missed after it.
            print("subscribed", flush=True)
            announced = True
        elif message["type"] == "message":
            data = message["data"].decode() if isinstance(message["data"], bytes) else message["data"]
            lines.append(f"{arrived:.6f} {data}\n")
    with open(out_path, "w") as out:
        out.writelines(lines)


def instrumented_web_main(port: str, profile_path: str, gc_path: str) -> None:
    """uvicorn as the CLI runs it, optionally under cProfile and with its GC pauses logged ("-": off)."""
    import cProfile
    import gc

    import uvicorn

    # uvicorn re-raises the SIGTERM it caught once it has shut down, which
    # would kill the process before the files are written: exit instead.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    sys.path.insert(0, str(REPO))
    pauses: list[tuple[float, int, float, int]] = []
    tracked: list[tuple[float, int]] = []
    started: list[float] = [0.0]

    def on_gc(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            started[0] = time.perf_counter()
        else:
            pauses.append((time.time(), info["generation"], time.perf_counter() - started[0], info["collected"]))
            if info["generation"] == 2:
                # What a full collection had to walk (counted after it, outside the timed pause).
                tracked.append((time.time(), len(gc.get_objects())))

    if gc_path != "-":
        gc.callbacks.append(on_gc)
    profile = cProfile.Profile() if profile_path != "-" else None
    if profile is not None:
        profile.enable()
    try:
        uvicorn.run("lmsp_project.asgi:application", host=HOST, port=int(port), access_log=False, backlog=4096)
    finally:
        if profile is not None:
            profile.disable()
            profile.dump_stats(profile_path)
        if gc_path != "-":
            with open(gc_path, "w") as out:
                out.writelines(f"{at:.6f} {gen} {secs:.6f} {collected}\n" for at, gen, secs, collected in pauses)
            with open(gc_path + ".objects", "w") as out:
                out.writelines(f"{at:.6f} {count}\n" for at, count in tracked)


def paced_worker_main(rate: str, celery_args: list[str]) -> None:
    """The project's Celery worker, unchanged except that each generation's tokens come at a fixed rate.

    The demo model makes ~2000 tokens/s on this CPU, some 20-100 times what a
    real model streams; pacing it shows the fan-out at realistic wake-up
    rates and frees the CPU the generation would take from the web process.
    The batch engine moves every row on by its sampled token through
    ``OnnxGeneration.take``, on the model thread, so that is where a token
    waits for its turn (as a slower model would make it wait).
    """
    import django

    sys.path.insert(0, str(REPO))
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "lmsp_project.settings")
    django.setup()
    from lmsp_project.celery import app
    from workers.backends.onnx.generation import OnnxGeneration

    real_take = OnnxGeneration.take
    interval = 1.0 / float(rate)

    def paced_take(self: OnnxGeneration, token: int) -> Any:
        due = getattr(self, "_paced_due", time.monotonic()) + interval
        self._paced_due = due  # type: ignore[attr-defined]
        delay = due - time.monotonic()
        if delay > 0:
            time.sleep(delay)
        return real_take(self, token)

    # Patched before the prefork pool forks, so its child inherits it.
    OnnxGeneration.take = paced_take  # type: ignore[method-assign]
    app.worker_main(["worker", *celery_args])


@dataclass
class Publishes:
    """The wake-ups of one task in arrival order, with the running maximum of last_sequence."""

    arrivals: list[float] = field(default_factory=list)
    last_sequences: list[int] = field(default_factory=list)
    running_max: list[int] = field(default_factory=list)

    def add(self, arrived: float, last_sequence: int) -> None:
        self.arrivals.append(arrived)
        self.last_sequences.append(last_sequence)
        top = max(last_sequence, self.running_max[-1]) if self.running_max else last_sequence
        self.running_max.append(top)

    def first_covering(self, sequence_number: int) -> float | None:
        """Arrival time of the first wake-up that announced ``sequence_number`` (or later)."""
        index = bisect.bisect_left(self.running_max, sequence_number)
        return self.arrivals[index] if index < len(self.arrivals) else None


def load_publishes(path: Path) -> dict[str, Publishes]:
    found: dict[str, Publishes] = defaultdict(Publishes)
    if not path.exists():
        return found
    for line in path.read_text().splitlines():
        arrived, _, data = line.partition(" ")
        try:
            message = json.loads(data)
            found[str(message["task_id"])].add(float(arrived), int(message["last_sequence"]))
        except (ValueError, KeyError, TypeError):
            continue
    return found


# --------------------------------------------------------------------------
# The private installation
# --------------------------------------------------------------------------


class Installation:
    """A temp dir with its own database, models, Redis prefix, web process and worker."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.tmp = Path(tempfile.mkdtemp(prefix="lmsp-bench-"))
        self.prefix = f"lmsp-bench-{os.getpid()}"
        self.port = args.port or free_port()
        self.base_url = f"http://{HOST}:{self.port}"
        self.redis_url = os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0")
        self.env = dict(os.environ)
        self.env.update(
            {
                "DATABASE_URL": f"sqlite:///{self.tmp}/db.sqlite3",
                "LMSP_MODELS_DIR": str(self.tmp / "models"),
                "LMSP_REDIS_PREFIX": self.prefix,
                "LMSP_TASK_QUEUE": self.prefix,
                "LMSP_DATA_DIR": str(self.tmp),
                "PYTHONUNBUFFERED": "1",
                # One token opens every stream of the bench: lift the per-client and per-process stream limits.
                "LMSP_MAX_STREAMS_PER_CLIENT": "100000",
                "LMSP_MAX_STREAMS_PER_PROCESS": "100000",
                "LMSP_HTTP_MAX_CONNECTIONS": "100000",
            }
        )
        # A DJANGO_SETTINGS_MODULE of the caller's shell must not leak in.
        self.env.pop("DJANGO_SETTINGS_MODULE", None)
        if args.batch_tokens is not None:
            self.env["LMSP_DELTA_BATCH_TOKENS"] = str(args.batch_tokens)
        if args.batch_ms is not None:
            self.env["LMSP_DELTA_BATCH_MS"] = str(args.batch_ms)
        self.token = ""
        self.model = "demo"
        self.web: subprocess.Popen[bytes] | None = None
        self.worker: subprocess.Popen[bytes] | None = None
        self.subscriber: subprocess.Popen[str] | None = None
        self.worker_starts = 0
        self._logs: list[Any] = []

    @property
    def db_path(self) -> Path:
        return self.tmp / "db.sqlite3"

    def manage(self, *argv: str) -> str:
        done = subprocess.run(
            [sys.executable, "manage.py", *argv], cwd=REPO, env=self.env, capture_output=True, text=True
        )
        if done.returncode != 0:
            raise RuntimeError(f"manage.py {' '.join(argv)} failed:\n{done.stdout}\n{done.stderr}")
        return done.stdout

    def prepare(self) -> None:
        log(f"temp dir {self.tmp}, redis prefix {self.prefix}, port {self.port}")
        self.manage("migrate", "-v0")
        # The benches need generations that run to max_output_tokens: the demo
        # model that never ends by itself (older commits have only that one).
        try:
            self.manage("lmsp_build_demo_model", "--if-missing", "--endless")
            self.model = "demo:endless"
        except RuntimeError:
            self.manage("lmsp_build_demo_model", "--if-missing")
            self.model = "demo"
        self.token = self.manage("lmsp_client", "create", "bench", "--scopes", "responses,read").strip()

    def _spawn(self, argv: list[str], log_name: str) -> subprocess.Popen[bytes]:
        out = open(self.tmp / log_name, "ab")  # closed in stop_all
        self._logs.append(out)
        # A session of its own: a Ctrl-C in the terminal reaches only the
        # bench, which stops the services in order; a forced stop is one killpg.
        return subprocess.Popen(
            argv, cwd=REPO, env=self.env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )

    def start_subscriber(self) -> None:
        self.subscriber = subprocess.Popen(
            [
                sys.executable,
                str(Path(__file__).resolve()),
                "--subscriber-mode",
                self.redis_url,
                f"{self.prefix}:tasks",
                str(self.tmp / "publishes.txt"),
            ],
            cwd=REPO,
            stdout=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        assert self.subscriber.stdout is not None
        if self.subscriber.stdout.readline().strip() != "subscribed":
            raise RuntimeError("the Redis subscriber did not start")

    def web_argv(self, label: str) -> list[str]:
        """The web process's command; ``label`` names its profile and GC log."""
        if self.args.profile_web or self.args.web_gc:
            profile = f"{Path(self.args.profile_web).resolve()}.{label}" if self.args.profile_web else "-"
            argv = [sys.executable, str(Path(__file__).resolve()), "--web-wrapper-mode", str(self.port)]
            return [*argv, profile, str(self.tmp / f"web-gc-{label}.txt") if self.args.web_gc else "-"]
        argv = [sys.executable, "-m", "uvicorn", "lmsp_project.asgi:application", "--host", HOST]
        return [*argv, "--port", str(self.port), "--no-access-log", "--backlog", "4096"]

    def start_web(self, label: str) -> None:
        """A fresh web process, once it listens."""
        self.web = self._spawn(self.web_argv(label), "web.log")
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if self.web.poll() is not None:
                raise RuntimeError(f"uvicorn exited:\n{self.tail('web.log')}")
            with contextlib.suppress(OSError), socket.create_connection((HOST, self.port), timeout=0.5):
                return
            time.sleep(0.1)
        raise RuntimeError("uvicorn did not start listening within 60 s")

    def start_worker(self) -> None:
        self.worker_starts += 1
        worker_args = ["--pool", "prefork", "--concurrency", "1", "--loglevel", "INFO", "-Q", self.prefix]
        worker_args += ["--hostname", f"bench{self.worker_starts}-{os.getpid()}@%h"]
        # Mingle and gossip would talk to other workers on this Redis and
        # add a second to every start.
        worker_args += ["--without-mingle", "--without-gossip", "--without-heartbeat"]
        if self.args.tokens_per_second:
            argv = [sys.executable, str(Path(__file__).resolve())]
            argv += ["--paced-worker-mode", str(self.args.tokens_per_second), "--", *worker_args]
        else:
            argv = [sys.executable, "-m", "celery", "-A", "lmsp_project", "worker", *worker_args]
        self.worker = self._spawn(argv, "worker.log")

    def _stop(self, proc: subprocess.Popen[Any] | None, sig: int = signal.SIGTERM, grace: float = 15) -> None:
        if proc is None or proc.poll() is not None:
            return
        # The main process only: a SIGTERM to the whole group would also hit
        # Celery's pool child, which then dies mid-task (WorkerLostError) and
        # its message is acked and lost; the parent's warm shutdown lets it finish.
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(sig)
        try:
            proc.wait(grace)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(5)
        # The prefork child may outlive its parent for a moment.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)

    def stop_web(self) -> None:
        self._stop(self.web)
        self.web = None

    def stop_worker(self) -> None:
        self._stop(self.worker)
        self.worker = None

    def stop_all(self) -> None:
        self._stop(self.worker)
        self._stop(self.web)
        self._stop(self.subscriber, grace=5)
        for out in self._logs:
            out.close()
        self._logs.clear()

    def cleanup_redis(self) -> None:
        try:
            import redis

            client = redis.Redis.from_url(self.redis_url)
            # "<prefix>:*" and exact names only: "<prefix>*" would also match
            # the keys of a concurrent run whose pid starts with ours.
            keys = list(client.scan_iter(match=f"{self.prefix}:*", count=1000))
            keys += [self.prefix, f"_kombu.binding.{self.prefix}", f"_kombu.binding_permanent.{self.prefix}"]
            client.delete(*keys)
        except Exception as exc:  # cleanup must not hide the results
            log(f"could not clean Redis keys of {self.prefix}: {exc}")

    def tail(self, name: str, lines: int = 30) -> str:
        path = self.tmp / name
        if not path.exists():
            return ""
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])

    def create_task(self, max_output_tokens: int, seed: int = 1) -> str:
        body = {
            "type": "response",
            "input": {"model": self.model, "input": "Hello", "max_output_tokens": max_output_tokens, "seed": seed},
        }
        request = urllib.request.Request(
            f"{self.base_url}/lmsp/v1/tasks",
            data=json.dumps(body).encode(),
            headers={"Authorization": f"Bearer {self.token}", "Content-Type": "application/json"},
            method="POST",
        )
        try:
            with urllib.request.urlopen(request, timeout=30) as reply:
                if reply.status != 202:
                    raise RuntimeError(f"POST /tasks answered {reply.status}")
                return str(json.load(reply)["id"])
        except urllib.error.HTTPError as error:
            raise RuntimeError(f"POST /tasks answered {error.code}: {error.read()[:500]!r}") from None


# --------------------------------------------------------------------------
# The SSE client
# --------------------------------------------------------------------------
#
# The client must cost far less per event than the server, or the bench
# measures itself: on 2 cores, parsing ~500 000 events/s in Python while they
# arrive starved the web process and the worker and let the socket buffers
# fill. So, while a scenario runs, each stream only appends what the socket
# gave to one bytearray and notes, per read, the buffer's length and
# ``time.time()`` (an asyncio.Protocol: no task switch, no StreamReader, no
# per-event Python). After every stream has ended, the body is decoded
# (chunked framing, then SSE) and each event gets the time of the read that
# completed it: the same stamp a parse-as-it-arrives client would take, for
# every event of every stream, and the same full integrity check.

CHUNKED_END = b"\r\n0\r\n\r\n"  # the zero-size chunk after the last data chunk's CRLF


@dataclass
class StreamResult:
    """What one client saw on one stream."""

    index: int
    task_id: str
    status: int = 0
    connect_started: float = 0.0
    ready_at: float = 0.0  # the first event arrived
    closed_at: float = 0.0  # the end of the chunked body arrived (or the stream failed)
    # While running: every read as the loop handed it over (kept, not copied), the bytes so far after
    # each read, and when each read came.
    pieces: list[bytes] = field(default_factory=list)
    length: int = 0
    tail: bytes = b""  # the last few bytes, to spot the end of the chunked body across reads
    body_start: int = 0
    read_ends: array = field(default_factory=lambda: array("q"))
    read_times: array = field(default_factory=lambda: array("d"))
    # After parse(): the events in order and when each one's last byte arrived.
    sequences: array = field(default_factory=lambda: array("q"))
    received: array = field(default_factory=lambda: array("d"))
    terminal_count: int = 0
    terminal_sequence: int | None = None
    events_after_terminal: int = 0
    id_data_mismatch: int = 0
    comments: int = 0
    reads: int = 0  # socket reads that carried data: at most how often the server wrote
    clean_end: bool = False
    error: str | None = None
    parsed: bool = False


@dataclass(frozen=True)
class ParsedBody:
    """The SSE content of one decoded body, independent of how it was read (shared by identical bodies)."""

    sequences: array  # id of each event
    ends: array  # decoded offset of the last byte of each event's blank line
    terminal_count: int
    terminal_sequence: int | None
    events_after_terminal: int
    id_data_mismatch: int
    comments: int
    remainder: int  # bytes after the last complete block


def parse_sse(body: bytes) -> ParsedBody:
    sequences, ends = array("q"), array("q")
    terminal_count = events_after_terminal = id_data_mismatch = comments = 0
    terminal_sequence = None
    start = 0
    while True:
        end = body.find(b"\n\n", start)
        if end < 0:
            break
        block = body[start:end]
        start = end + 2
        if block.startswith(b":"):
            comments += 1
            continue
        sequence_number = -1
        kind = b""
        data_line = b""
        for line in block.split(b"\n"):
            if line.startswith(b"id: "):
                try:
                    sequence_number = int(line[4:])
                except ValueError:
                    sequence_number = -1
            elif line.startswith(b"event: "):
                kind = line[7:]
            elif line.startswith(b"data: "):
                data_line = line
        if b'"sequence_number":%d' % sequence_number not in data_line:
            id_data_mismatch += 1
        if terminal_count:
            events_after_terminal += 1
        if kind in TERMINAL_TYPES:
            terminal_count += 1
            terminal_sequence = sequence_number
        sequences.append(sequence_number)
        ends.append(end + 1)
    return ParsedBody(
        sequences,
        ends,
        terminal_count,
        terminal_sequence,
        events_after_terminal,
        id_data_mismatch,
        comments,
        len(body) - start,
    )


def decode_chunked(raw: bytes, start: int) -> tuple[bytes, array, array, int | None, str | None]:
    """The chunked body in ``raw[start:]``: (data, decoded start and raw start of each chunk, end offset, error).

    The end offset is where the terminating zero-size chunk (and its empty
    trailer) ends; None when the body did not end.
    """
    pieces: list[bytes] = []
    decoded_starts, raw_starts = array("q"), array("q")
    decoded = 0
    pos = start
    while True:
        eol = raw.find(b"\r\n", pos)
        if eol < 0:
            return b"".join(pieces), decoded_starts, raw_starts, None, None
        try:
            size = int(raw[pos:eol].split(b";")[0], 16)
        except ValueError:
            return (
                b"".join(pieces),
                decoded_starts,
                raw_starts,
                None,
                f"bad chunk size line {raw[pos:eol][:40]!r}",
            )
        pos = eol + 2
        if size == 0:
            if raw[pos : pos + 2] == b"\r\n":
                return b"".join(pieces), decoded_starts, raw_starts, pos + 2, None
            return b"".join(pieces), decoded_starts, raw_starts, None, None
        if len(raw) < pos + size + 2:
            pieces.append(raw[pos : pos + size])  # a partial chunk: its complete events count
            decoded_starts.append(decoded)
            raw_starts.append(pos)
            return b"".join(pieces), decoded_starts, raw_starts, None, None
        if raw[pos + size : pos + size + 2] != b"\r\n":
            return b"".join(pieces), decoded_starts, raw_starts, None, "bad chunk end"
        pieces.append(raw[pos : pos + size])
        decoded_starts.append(decoded)
        raw_starts.append(pos)
        decoded += size
        pos += size + 2


def parse_stream(result: StreamResult, cache: dict[bytes, ParsedBody]) -> None:
    """Fills the events of ``result`` from what it read, then drops the raw bytes."""
    if result.parsed:
        return
    result.parsed = True
    raw = b"".join(result.pieces)
    result.pieces = []
    result.reads = len(result.read_ends)
    if not result.body_start:
        return
    body, decoded_starts, raw_starts, end, error = decode_chunked(raw, result.body_start)
    parsed = cache.get(body)
    if parsed is None:
        parsed = cache[body] = parse_sse(body)
    result.sequences = parsed.sequences
    result.terminal_count = parsed.terminal_count
    result.terminal_sequence = parsed.terminal_sequence
    result.events_after_terminal = parsed.events_after_terminal
    result.id_data_mismatch = parsed.id_data_mismatch
    result.comments = parsed.comments
    if error and not result.error:
        result.error = error
    trailing = len(raw) - end if end is not None else 0
    if trailing and not result.error:
        result.error = f"{trailing} bytes after the end of the chunked body"
    result.clean_end = end is not None and not trailing and not parsed.remainder and not error
    # Each event's receive time: the read that brought its last byte.
    received = array("d")
    read_ends, read_times = result.read_ends, result.read_times
    chunk, read = 0, 0
    chunks = len(decoded_starts)
    for at in parsed.ends:
        chunk = bisect.bisect_right(decoded_starts, at, chunk, chunks) - 1
        read = bisect.bisect_right(read_ends, raw_starts[chunk] + at - decoded_starts[chunk], read)
        received.append(read_times[read])
    result.received = received


class StreamProtocol(asyncio.Protocol):
    """One stream: collects the raw response and stamps each read; parses only what it must to know its state."""

    def __init__(self, result: StreamResult, request: bytes, on_ready: Any) -> None:
        self.result = result
        self.request = request
        self.on_ready = on_ready
        self.transport: Any = None
        self.done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.waiting = True  # for the headers and the first complete event

    def connection_made(self, transport: Any) -> None:
        # uvloop's transports are not asyncio.Transport subclasses, but behave as one.
        self.transport = transport
        transport.write(self.request)

    def data_received(self, data: bytes) -> None:
        now = time.time()
        result = self.result
        result.pieces.append(data)
        result.length += len(data)
        result.read_ends.append(result.length)
        result.read_times.append(now)
        if self.waiting and not self._early():
            return
        if len(data) >= len(CHUNKED_END):
            result.tail = data  # a reference, not a copy
        else:
            result.tail = result.tail[-len(CHUNKED_END) :] + data
        if result.tail.endswith(CHUNKED_END):
            self.finish(None)

    def _early(self) -> bool:
        """Headers and the first event; False once the stream failed."""
        result = self.result
        # Only until the first event: the pieces are few and short.
        raw = result.pieces[0] if len(result.pieces) == 1 else b"".join(result.pieces)
        if not result.body_start:
            head_end = raw.find(b"\r\n\r\n")
            if head_end < 0:
                return True
            status_line, *header_lines = raw[:head_end].decode("latin-1").split("\r\n")
            result.body_start = head_end + 4
            try:
                result.status = int(status_line.split()[1])
            except (IndexError, ValueError):
                self.finish(f"bad status line {status_line[:80]!r}")
                return False
            headers = {k.strip().lower(): v.strip() for k, _, v in (h.partition(":") for h in header_lines if h)}
            if result.status != 200:
                self.finish(f"HTTP {result.status}: {raw[result.body_start :][:300]!r}")
                return False
            if headers.get("transfer-encoding", "").lower() != "chunked":
                self.finish(f"expected a chunked body, got headers {headers}")
                return False
        first = raw.find(b"\nid: ", result.body_start)
        if first >= 0 and raw.find(b"\n\n", first) >= 0:
            self.waiting = False
            self.on_ready(result)
        return True

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.done.done():
            self.finish(f"the server closed the connection before the end of the chunked body ({exc})")

    def finish(self, error: str | None) -> None:
        if self.done.done():
            return
        self.result.closed_at = time.time()
        if error and not self.result.error:
            self.result.error = error
        self.done.set_result(None)
        if self.transport is not None:
            self.transport.close()


class StreamGroup:
    """Opens and follows many streams; knows when all are open and when the first ends."""

    def __init__(self, install: Installation, task_ids: list[str]) -> None:
        self.install = install
        self.results = [StreamResult(index=i, task_id=task_id) for i, task_id in enumerate(task_ids)]
        self.settled = 0  # streams that got their first event, or failed before
        self.all_settled = asyncio.Event()
        self.first_closed_at: float | None = None

    def _settle(self, result: StreamResult) -> None:
        if not result.ready_at:
            result.ready_at = time.time()
            self.settled += 1
            if self.settled == len(self.results):
                self.all_settled.set()

    async def follow(self, result: StreamResult) -> None:
        request = (
            f"GET /lmsp/v1/tasks/{result.task_id}/events HTTP/1.1\r\n"
            f"Host: {HOST}:{self.install.port}\r\n"
            f"Authorization: Bearer {self.install.token}\r\n"
            "Accept: text/event-stream\r\n"
            "Cache-Control: no-cache\r\n\r\n"
        ).encode()
        result.connect_started = time.time()
        protocol = StreamProtocol(result, request, self._settle)
        try:
            await asyncio.get_running_loop().create_connection(lambda: protocol, HOST, self.install.port)
            await protocol.done
        except OSError as exc:
            result.error = f"{type(exc).__name__}: {exc}"
        finally:
            if protocol.transport is not None:
                protocol.transport.close()
            if not result.closed_at:
                result.closed_at = time.time()
            if self.first_closed_at is None or result.closed_at < self.first_closed_at:
                self.first_closed_at = result.closed_at
            self._settle(result)

    def parse_all(self) -> None:
        """Decodes every stream's body (after the run: it costs nothing while streams are followed)."""
        cache: dict[bytes, ParsedBody] = {}
        for result in self.results:
            parse_stream(result, cache)


async def loop_lag_monitor(samples: list[tuple[float, float]], period: float = 0.01) -> None:
    """Records how late the client's own loop wakes: a busy client inflates every latency."""
    # perf_counter, not loop.time(): uvloop's clock ticks in whole milliseconds.
    while True:
        expected = time.perf_counter() + period
        await asyncio.sleep(period)
        samples.append((time.time(), time.perf_counter() - expected))


class RssSampler(threading.Thread):
    """Samples the web process's RSS every ``period`` seconds (a thread: the loop may be busy)."""

    def __init__(self, pid: int, period: float = 0.05) -> None:
        super().__init__(daemon=True, name="rss-sampler")
        self.pid = pid
        self.period = period
        self.samples: list[tuple[float, int]] = []
        self._stop_event = threading.Event()

    def run(self) -> None:
        while not self._stop_event.is_set():
            self.samples.append((time.time(), rss_kib(self.pid)))
            self._stop_event.wait(self.period)

    def stop(self) -> None:
        self._stop_event.set()
        self.join()


# --------------------------------------------------------------------------
# Scenarios
# --------------------------------------------------------------------------


@dataclass
class ScenarioRun:
    """The raw observations of one scenario, analysed after the services stop."""

    name: str
    task_ids: list[str]
    group: StreamGroup
    all_open_at: float = 0.0
    open_seconds: float = 0.0
    worker_started_at: float = 0.0
    finished_at: float = 0.0
    rss_before_kib: int = 0
    rss_idle_kib: int = 0
    rss_running_max_kib: int = 0
    rss_after_close_kib: int = 0
    threads: dict[str, int] = field(default_factory=dict)
    cpu: dict[str, float] = field(default_factory=dict)
    loop_lag: list[tuple[float, float]] = field(default_factory=list)
    timed_out: bool = False


async def run_scenario(
    install: Installation, name: str, stream_task_ids: list[str], task_ids: list[str], timeout: float
) -> ScenarioRun:
    """Open every stream on queued tasks, then start the worker and follow all streams to their end."""
    assert install.web is not None
    web_pid = install.web.pid
    # Let the previous scenario's garbage and closed sockets settle first.
    await asyncio.sleep(1.0)
    run = ScenarioRun(name=name, task_ids=task_ids, group=StreamGroup(install, stream_task_ids))
    run.rss_before_kib = rss_kib(web_pid)
    run.threads["before"] = thread_count(web_pid)
    lag_task = asyncio.create_task(loop_lag_monitor(run.loop_lag))
    started = time.time()
    followers = [asyncio.create_task(run.group.follow(result)) for result in run.group.results]
    try:
        await asyncio.wait_for(run.group.all_settled.wait(), timeout)
    except TimeoutError:
        run.timed_out = True
        log(f"{name}: only {run.group.settled} of {len(followers)} streams opened within {timeout:.0f} s")
    run.all_open_at = time.time()
    run.open_seconds = run.all_open_at - started
    log(f"{name}: {run.group.settled} streams open in {run.open_seconds:.2f} s")

    # Idle: every stream open on a queued task, no worker.
    await asyncio.sleep(1.0)
    idle = []
    for _ in range(5):
        idle.append(rss_kib(web_pid))
        await asyncio.sleep(0.1)
    run.rss_idle_kib = max(idle)
    run.threads["idle"] = thread_count(web_pid)

    sampler = RssSampler(web_pid)
    sampler.start()
    cpu_web = cpu_seconds_of_group(web_pid)
    client_usage = resource.getrusage(resource.RUSAGE_SELF)
    machine_busy, steal = machine_cpu_seconds()
    pressure = cpu_pressure_seconds()
    run.worker_started_at = time.time()
    install.start_worker()
    worker_pgid = install.worker.pid if install.worker else 0
    _, pending = await asyncio.wait(followers, timeout=timeout)
    run.finished_at = time.time()
    # Read the worker's CPU before it is stopped: its processes vanish with it.
    cpu_worker = cpu_seconds_of_group(worker_pgid)
    cpu_web = cpu_seconds_of_group(web_pid) - cpu_web
    client_after = resource.getrusage(resource.RUSAGE_SELF)
    busy_after, steal_after = machine_cpu_seconds()
    machine_busy, steal = busy_after - machine_busy, steal_after - steal
    pressure = cpu_pressure_seconds() - pressure
    sampler.stop()
    if pending:
        run.timed_out = True
        log(f"{name}: {len(pending)} streams still open after {timeout:.0f} s; cancelling them")
        for follower in pending:
            follower.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
    lag_task.cancel()
    await asyncio.gather(lag_task, return_exceptions=True)
    elapsed = max(1e-9, run.finished_at - run.worker_started_at)
    client_user = client_after.ru_utime - client_usage.ru_utime
    client_sys = client_after.ru_stime - client_usage.ru_stime
    run.cpu = {
        "seconds": round(elapsed, 3),
        "web_cpu_s": round(cpu_web, 3),
        "worker_cpu_s": round(cpu_worker, 3),
        "client_cpu_s": round(client_user + client_sys, 3),
        "client_sys_cpu_s": round(client_sys, 3),
        # Every core's non-idle time: the three above plus Redis, the subscriber, the kernel and anything else.
        "machine_busy_s": round(machine_busy, 3),
        "steal_s": round(steal, 3),
        "cores": os.cpu_count() or 1,
        # Wall time in which at least one runnable task (of any process) waited for a core.
        "cpu_pressure_s": round(pressure, 3),
    }
    first_closed = run.group.first_closed_at or run.finished_at
    running = [kib for at, kib in sampler.samples if run.worker_started_at <= at < first_closed]
    run.rss_running_max_kib = max(running, default=0)
    await asyncio.to_thread(install.stop_worker)
    await asyncio.sleep(1.0)
    run.rss_after_close_kib = rss_kib(web_pid)
    run.threads["after_close"] = thread_count(web_pid)
    log(f"{name}: all streams ended {run.finished_at - run.worker_started_at:.2f} s after the worker started")
    parse_started = time.perf_counter()
    run.group.parse_all()
    log(f"{name}: parsed the streams' bodies in {time.perf_counter() - parse_started:.2f} s (after the run)")
    return run


async def warm_up(install: Installation) -> None:
    """One short task end to end: loads Django's views, the hub's subscription and proves the pipeline."""
    task_id = install.create_task(16)
    group = StreamGroup(install, [task_id])
    install.start_worker()
    await asyncio.wait_for(group.follow(group.results[0]), 120)
    await asyncio.to_thread(install.stop_worker)
    group.parse_all()
    result = group.results[0]
    if result.error or result.terminal_count != 1:
        raise RuntimeError(
            f"warm-up stream failed: {result.error or 'no terminal event'}\n"
            f"web log:\n{install.tail('web.log')}\nworker log:\n{install.tail('worker.log')}"
        )
    log(f"warm-up: {len(result.sequences)} events on {task_id}")


async def light_warm_up(install: Installation, task_id: str) -> None:
    """One stream opened and dropped, so that a fresh web process has imported its views and subscribed."""
    group = StreamGroup(install, [task_id])
    follower = asyncio.create_task(group.follow(group.results[0]))
    await asyncio.wait_for(group.all_settled.wait(), 60)
    follower.cancel()
    await asyncio.gather(follower, return_exceptions=True)
    group.parse_all()
    if group.results[0].error or not group.results[0].sequences:
        raise RuntimeError(f"warm-up stream failed: {group.results[0].error or 'no event'}")


# --------------------------------------------------------------------------
# Analysis
# --------------------------------------------------------------------------


def load_gc_pauses(folder: Path) -> list[tuple[float, float, int]] | None:
    """(start, end, generation) of each collection in the web processes; None when not logged."""
    paths = sorted(folder.glob("web-gc-*.txt"))
    if not paths:
        return None
    pauses = []
    for path in paths:
        for line in path.read_text().splitlines():
            ended, generation, seconds, _ = line.split()
            pauses.append((float(ended) - float(seconds), float(ended), int(generation)))
    return pauses


def load_gc_objects(folder: Path) -> list[tuple[float, int]]:
    """(time, tracked objects) after each full collection of the web processes."""
    found = []
    for path in sorted(folder.glob("web-gc-*.txt.objects")):
        found += [(float(at), int(count)) for at, count in (line.split() for line in path.read_text().splitlines())]
    return found


def gc_overlap(pauses: list[tuple[float, float, int]], start: float, end: float) -> float:
    return sum(max(0.0, min(end, p_end) - max(start, p_start)) for p_start, p_end, _ in pauses)


def parse_db_time(text: str) -> float:
    # Django stores UTC without an offset on SQLite.
    moment = dt.datetime.fromisoformat(text)
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=dt.UTC)
    return moment.timestamp()


def read_database(db_path: Path, task_ids: Iterable[str]) -> tuple[dict[str, list[float]], dict[str, dict[str, Any]]]:
    """created_at of every event (indexed by sequence number) and each task's final state."""
    wanted = list(task_ids)
    created: dict[str, list[float]] = {}
    tasks: dict[str, dict[str, Any]] = {}
    with contextlib.closing(sqlite3.connect(f"file:{db_path}?mode=ro", uri=True)) as db:
        for start in range(0, len(wanted), 500):
            chunk = wanted[start : start + 500]
            marks = ",".join("?" * len(chunk))
            rows = db.execute(
                f"SELECT task_id, sequence_number, created_at FROM task_events WHERE task_id IN ({marks})"
                " ORDER BY task_id, sequence_number",
                chunk,
            ).fetchall()
            for task_id, sequence_number, created_at in rows:
                times = created.setdefault(task_id, [])
                while len(times) < sequence_number:
                    times.append(float("nan"))  # a gap: the integrity check reports it
                times.append(parse_db_time(created_at))
            for task_id, status, last_sequence in db.execute(
                f"SELECT id, status, last_sequence FROM tasks WHERE id IN ({marks})", chunk
            ):
                tasks[task_id] = {"status": status, "last_sequence": last_sequence}
    return created, tasks


def check_stream(result: StreamResult, task: dict[str, Any] | None) -> list[str]:
    """Everything wrong with one stream, as readable sentences (empty: fine)."""
    problems = []
    if result.error:
        problems.append(result.error)
    sequences = result.sequences
    if not sequences:
        problems.append("no events")
        return problems
    if sequences[0] != 0:
        problems.append(f"first event is {sequences[0]}, not 0")
    for position in range(1, len(sequences)):
        if sequences[position] != sequences[position - 1] + 1:
            problems.append(f"not contiguous: {sequences[position - 1]} then {sequences[position]}")
            break
    if result.terminal_count != 1:
        problems.append(
            f"{result.terminal_count} terminal events (got {len(sequences)} events, {sequences[0]}..{sequences[-1]},"
            f" the task's log ends at {task['last_sequence'] if task else '?'} ({task['status'] if task else '?'}))"
        )
    elif result.terminal_sequence != sequences[-1]:
        problems.append(f"terminal event {result.terminal_sequence} is not the last ({sequences[-1]})")
    if result.events_after_terminal:
        problems.append(f"{result.events_after_terminal} events after the terminal one")
    if result.id_data_mismatch:
        problems.append(f"{result.id_data_mismatch} events whose data sequence_number differs from id")
    if not result.clean_end:
        problems.append("the chunked body did not end cleanly")
    if task is not None and sequences[-1] != task["last_sequence"]:
        problems.append(f"last event {sequences[-1]} but the task's last_sequence is {task['last_sequence']}")
    return problems


def analyse(
    run: ScenarioRun,
    publishes: dict[str, Publishes],
    db_path: Path,
    gc_pauses: list[tuple[float, float, int]] | None = None,
    gc_objects: list[tuple[float, int]] | None = None,
) -> dict[str, Any]:
    created, tasks = read_database(db_path, run.task_ids)
    results = run.group.results
    violations: list[str] = []
    broken_streams = 0
    for result in results:
        problems = check_stream(result, tasks.get(result.task_id))
        broken_streams += bool(problems)
        violations.extend(f"stream {result.index} (task {result.task_id}): {problem}" for problem in problems)

    from_publish: list[float] = []
    from_created: list[float] = []
    unmatched = 0
    since = run.all_open_at
    # Per wake-up: when its newest event reached the first and the last stream.
    reach: dict[tuple[str, int], list[float]] = {}
    for result in results:
        pubs = publishes.get(result.task_id)
        stamps = created.get(result.task_id, [])
        for sequence_number, received in zip(result.sequences, result.received, strict=True):
            arrived = pubs.first_covering(sequence_number) if pubs is not None else None
            if arrived is None:
                unmatched += 1
            elif arrived >= since:
                from_publish.append(received - arrived)
            if 0 <= sequence_number < len(stamps) and stamps[sequence_number] >= since:
                from_created.append(received - stamps[sequence_number])
        if pubs is not None:
            sequences, count = result.sequences, len(result.sequences)
            for arrived, last in zip(pubs.arrivals, pubs.last_sequences, strict=True):
                # A sound stream holds event n at position n; others are reported, not timed here.
                if arrived >= since and last < count and sequences[last] == last:
                    times = reach.setdefault((result.task_id, last), [arrived, float("inf"), 0.0])
                    times[1] = min(times[1], result.received[last])
                    times[2] = max(times[2], result.received[last])

    slowest = sorted(reach.items(), key=lambda item: item[1][2] - item[1][0], reverse=True)[:5]
    first_stream = [first - arrived for arrived, first, _ in reach.values()]
    last_stream = [last - arrived for arrived, _, last in reach.values()]
    spread = [last - first for _, first, last in reach.values()]
    negatives = sum(1 for value in from_publish if value < 0)
    lags = [lag for at, lag in run.loop_lag if run.worker_started_at <= at <= run.finished_at]
    measured_wakeups = sorted(
        arrived
        for task_id in run.task_ids
        for arrived in publishes.get(task_id, Publishes()).arrivals
        if arrived >= since
    )
    commits = len(measured_wakeups)
    generating = measured_wakeups[-1] - measured_wakeups[0] if commits > 1 else 0.0
    events_delivered = sum(len(result.sequences) for result in results)
    n = len(results)
    return {
        "scenario": run.name,
        "streams": n,
        "tasks": len(run.task_ids),
        "streams_opened": sum(1 for r in results if r.status == 200),
        "streams_clean": n - broken_streams,
        "timed_out": run.timed_out,
        "open_seconds": round(run.open_seconds, 3),
        "run_seconds": round(run.finished_at - run.worker_started_at, 3),
        "events_delivered": events_delivered,
        "events_per_stream_max": max((len(r.sequences) for r in results), default=0),
        "reads_per_stream_mean": round(sum(r.reads for r in results) / max(1, n), 1),
        "wakeups_measured": commits,
        # From the first to the last wake-up: the generation itself, without the worker's start.
        "generation_seconds": round(generating, 3),
        "wakeups_per_second": round(commits / generating, 1) if generating else None,
        "latency_from_publish": summarize_ms(from_publish),
        "latency_from_created_at": summarize_ms(from_created),
        "negative_publish_latencies": negatives,
        "events_without_publish": unmatched,
        "wakeup_to_first_stream": summarize_ms(first_stream),
        "wakeup_to_last_stream": summarize_ms(last_stream),
        "wakeup_fanout_spread": summarize_ms(spread),
        # Where the tail comes from: the wake-ups whose newest event reached its last stream latest.
        "slowest_wakeups": [
            {
                "task_id": task_id,
                "last_sequence": last,
                "after_all_open_s": round(arrived - since, 3),
                "first_stream_ms": round((first - arrived) * 1000, 2),
                "last_stream_ms": round((latest - arrived) * 1000, 2),
                "web_gc_ms_meanwhile": round(gc_overlap(gc_pauses, arrived, latest) * 1000, 2) if gc_pauses else None,
            }
            for (task_id, last), (arrived, first, latest) in slowest
        ],
        "client_loop_lag": summarize_ms(lags),
        # The client's longest stalls, placed like the slowest wake-ups: when each began, after all streams opened.
        "client_loop_stalls": [
            {"after_all_open_s": round(at - lag - since, 3), "ms": round(lag * 1000, 2)}
            for at, lag in sorted(
                ((at, lag) for at, lag in run.loop_lag if run.worker_started_at <= at <= run.finished_at),
                key=lambda sample: sample[1],
                reverse=True,
            )[:3]
        ],
        "memory": {
            "rss_before_kib": run.rss_before_kib,
            "rss_idle_kib": run.rss_idle_kib,
            "rss_running_max_kib": run.rss_running_max_kib,
            "rss_after_close_kib": run.rss_after_close_kib,
            "kib_per_stream_idle": round((run.rss_idle_kib - run.rss_before_kib) / max(1, n), 2),
            "kib_per_stream_running": round((run.rss_running_max_kib - run.rss_before_kib) / max(1, n), 2),
            "web_threads": run.threads,
        },
        "cpu": run.cpu,
        "web_gc": _gc_summary(gc_pauses, gc_objects or [], run.worker_started_at, run.finished_at),
        "violations": len(violations),
        "violation_examples": violations[:20],
    }


def _gc_summary(
    pauses: list[tuple[float, float, int]] | None, objects: list[tuple[float, int]], start: float, end: float
) -> dict[str, Any] | None:
    if pauses is None:
        return None
    inside = [(p_end - p_start, gen) for p_start, p_end, gen in pauses if start <= p_end <= end]
    by_generation = {
        str(gen): {
            "count": sum(1 for _, g in inside if g == gen),
            "total_ms": round(sum(secs for secs, g in inside if g == gen) * 1000, 2),
            "max_ms": round(max((secs for secs, g in inside if g == gen), default=0.0) * 1000, 2),
        }
        for gen in (0, 1, 2)
    }
    full = [count for at, count in objects if start <= at <= end]
    return {"while_running": by_generation, "objects_after_full_collections": full}


# --------------------------------------------------------------------------
# Reporting
# --------------------------------------------------------------------------


def _fmt(stats: dict[str, Any]) -> str:
    if not stats.get("count"):
        return "(no samples)"
    return "  ".join(f"{stats[k]:8.2f}" for k in ("p50_ms", "p90_ms", "p99_ms", "max_ms")) + f"   n={stats['count']}"


def print_report(report: dict[str, Any]) -> None:
    print()
    print("=" * 96)
    config = report["config"]
    print(
        f"SSE fan-out benchmark  ({config['cpus']} CPUs, batch {config['batch_tokens']} tokens /"
        f" {config['batch_ms']} ms, generation {config['tokens_per_second']} tokens/s,"
        f" client loop {config['client_loop']})"
    )
    for s in report["scenarios"]:
        memory, cpu = s["memory"], s["cpu"]
        print("-" * 96)
        print(
            f"scenario {s['scenario']!r}: {s['streams']} streams over {s['tasks']} task(s);"
            f" opened {s['streams_opened']} in {s['open_seconds']:.2f} s; ran {s['run_seconds']:.2f} s;"
            f" {s['wakeups_measured']} wake-ups in {s['generation_seconds']:.2f} s ({s['wakeups_per_second']}/s);"
            f" {s['events_delivered']} events delivered in {s['reads_per_stream_mean']} reads per stream"
        )
        print(f"  {'latency (ms)':34}{'p50':>8}  {'p90':>8}  {'p99':>8}  {'max':>8}")
        print(f"  {'commit (Redis wake-up) -> client':34}{_fmt(s['latency_from_publish'])}")
        print(f"  {'created_at -> client (upper bound)':34}{_fmt(s['latency_from_created_at'])}")
        print(f"  {'wake-up -> first stream':34}{_fmt(s['wakeup_to_first_stream'])}")
        print(f"  {'wake-up -> last stream':34}{_fmt(s['wakeup_to_last_stream'])}")
        print(f"  {'client loop lag (bench itself)':34}{_fmt(s['client_loop_lag'])}")
        if s["client_loop_stalls"]:
            stalls = ", ".join(f"+{x['after_all_open_s']:.2f} s: {x['ms']:.0f} ms" for x in s["client_loop_stalls"])
            print(f"  {'  longest client stalls (start)':34}{stalls}")
        print(
            f"  memory (web RSS): before {memory['rss_before_kib'] / 1024:.1f} MiB, idle with streams"
            f" {memory['rss_idle_kib'] / 1024:.1f} MiB, running max {memory['rss_running_max_kib'] / 1024:.1f} MiB,"
            f" after close {memory['rss_after_close_kib'] / 1024:.1f} MiB"
        )
        threads = memory["web_threads"]
        print(
            f"  web threads: {threads.get('before')} before, {threads.get('idle')} with the streams open,"
            f" {threads.get('after_close')} after they closed"
        )
        print(
            f"  per stream: {memory['kib_per_stream_idle']:.1f} KiB idle, {memory['kib_per_stream_running']:.1f} KiB"
            " running"
        )
        secs = max(1e-9, cpu["seconds"])
        print(
            f"  CPU over the run: web {cpu['web_cpu_s']:.2f} s ({cpu['web_cpu_s'] / secs:.0%}),"
            f" worker {cpu['worker_cpu_s']:.2f} s ({cpu['worker_cpu_s'] / secs:.0%}),"
            f" bench client {cpu['client_cpu_s']:.2f} s ({cpu['client_cpu_s'] / secs:.0%},"
            f" {cpu['client_sys_cpu_s']:.2f} s of it in the kernel)"
        )
        # Clamped: per-process and whole-machine tick accounting differ by a few ticks.
        rest = max(0.0, cpu["machine_busy_s"] - cpu["web_cpu_s"] - cpu["worker_cpu_s"] - cpu["client_cpu_s"])
        print(
            f"  machine: {cpu['machine_busy_s'] / secs:.2f} of {cpu['cores']} cores busy"
            f" ({cpu['machine_busy_s'] / secs / cpu['cores']:.0%}); Redis, subscriber, kernel, other:"
            f" {rest:.2f} s ({rest / secs:.0%}); some task waiting for a core {cpu['cpu_pressure_s'] / secs:.0%}"
            " of the time" + (f"; hypervisor steal {cpu['steal_s']:.2f} s" if cpu["steal_s"] >= 0.02 else "")
        )
        worst = ", ".join(
            f"#{w['last_sequence']} at +{w['after_all_open_s']:.2f} s: {w['last_stream_ms']:.0f} ms"
            + (f" (web GC {w['web_gc_ms_meanwhile']:.0f} ms)" if w["web_gc_ms_meanwhile"] is not None else "")
            for w in s["slowest_wakeups"][:3]
        )
        print(f"  slowest wake-ups (newest event, time after all open: to last stream): {worst}")
        if s["web_gc"]:
            gcs = s["web_gc"]["while_running"]
            print(
                "  web GC while running: "
                + ", ".join(
                    f"gen{g} {v['count']}x total {v['total_ms']:.0f} ms max {v['max_ms']:.1f} ms"
                    for g, v in gcs.items()
                )
            )
            if gcs["2"]["count"]:
                objects = s["web_gc"]["objects_after_full_collections"]
                print(f"  web objects tracked by the GC after each full collection: {objects}")
        if s["negative_publish_latencies"] or s["events_without_publish"]:
            print(
                f"  note: {s['negative_publish_latencies']} negative commit->client latencies,"
                f" {s['events_without_publish']} events without a matching wake-up"
            )
        if s["violations"] or s["timed_out"]:
            print(f"  !!!!! INTEGRITY VIOLATIONS: {s['violations']} (timed out: {s['timed_out']})")
            for example in s["violation_examples"]:
                print(f"  !!!!!   {example}")
        else:
            print(f"  integrity: all {s['streams']} streams contiguous 0..last, one terminal event, clean end")
        pub = s["latency_from_publish"]
        checks = [
            ("streams open", s["streams_opened"] >= min(TARGETS["streams"], s["streams"]), ""),
            ("p50 <= 20 ms", pub.get("p50_ms", 1e9) <= TARGETS["p50_ms"], f"{pub.get('p50_ms', 'n/a')} ms"),
            ("p99 <= 100 ms", pub.get("p99_ms", 1e9) <= TARGETS["p99_ms"], f"{pub.get('p99_ms', 'n/a')} ms"),
            (
                "< 2 MiB per stream",
                max(memory["kib_per_stream_idle"], memory["kib_per_stream_running"]) < TARGETS["kib_per_stream"],
                f"{max(memory['kib_per_stream_idle'], memory['kib_per_stream_running']):.1f} KiB",
            ),
        ]
        print("  targets: " + ", ".join(f"{label}: {'met' if ok else 'MISSED'} {v}".strip() for label, ok, v in checks))
    print("=" * 96)


# --------------------------------------------------------------------------
# Main
# --------------------------------------------------------------------------


async def run_all(install: Installation, args: argparse.Namespace) -> list[ScenarioRun]:
    await asyncio.to_thread(install.start_web, "warmup")
    await warm_up(install)
    runs = []
    for name in ("one task", "many tasks"):
        label = name.split()[0]
        if label not in args.scenarios:
            continue
        # A fresh web process per scenario: one that already served 500
        # streams reuses the memory they freed and would look cheaper.
        await asyncio.to_thread(install.stop_web)
        await asyncio.to_thread(install.start_web, label)
        # Tasks are created only now, with no worker running: a worker would
        # otherwise pick the next scenario's first task while shutting down.
        if label == "one":
            task_ids = [install.create_task(args.one_tokens)]
            stream_task_ids = task_ids * args.streams
        else:
            task_ids = [install.create_task(args.many_tokens, seed=i + 1) for i in range(args.tasks)]
            streams = args.many_streams or args.streams
            stream_task_ids = [task_ids[i % len(task_ids)] for i in range(streams)]
        await light_warm_up(install, task_ids[0])
        runs.append(await run_scenario(install, name, stream_task_ids, task_ids, args.timeout))
    return runs


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--streams", type=int, default=500, help="concurrent streams per scenario (default 500)")
    parser.add_argument("--many-streams", type=int, default=0, help="streams in 'many tasks' (default: --streams)")
    parser.add_argument("--tasks", type=int, default=50, help="tasks in the 'many tasks' scenario (default 50)")
    parser.add_argument("--one-tokens", type=int, default=2000, help="max_output_tokens of the 'one task' task")
    parser.add_argument("--many-tokens", type=int, default=200, help="max_output_tokens of each 'many tasks' task")
    parser.add_argument("--scenarios", default="one,many", help="comma-separated subset of: one, many (default both)")
    parser.add_argument("--batch-tokens", type=int, default=None, help="LMSP_DELTA_BATCH_TOKENS for the worker")
    parser.add_argument("--batch-ms", type=int, default=None, help="LMSP_DELTA_BATCH_MS for the worker")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds per phase before giving up")
    parser.add_argument("--port", type=int, default=0, help="web port (default: a free one)")
    parser.add_argument(
        "--client-loop",
        choices=("auto", "asyncio", "uvloop"),
        default="auto",
        help="the bench client's event loop (auto: uvloop when installed, it costs the client less CPU)",
    )
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    parser.add_argument(
        "--profile-web", metavar="PATH", help="run uvicorn under cProfile; stats to PATH.<scenario> per web process"
    )
    parser.add_argument("--keep", action="store_true", help="keep the temp dir (logs, database)")
    parser.add_argument(
        "--tokens-per-second",
        type=float,
        default=0.0,
        help="pace the worker's generation to this many tokens/s (default: the demo model's own speed)",
    )
    parser.add_argument("--subscriber-mode", nargs=3, help=argparse.SUPPRESS)
    parser.add_argument(
        "--web-gc", action="store_true", help="log the web process's garbage-collector pauses and report them"
    )
    parser.add_argument("--web-wrapper-mode", nargs=3, help=argparse.SUPPRESS)
    parser.add_argument("--paced-worker-mode", help=argparse.SUPPRESS)
    parser.add_argument("rest", nargs="*", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.scenarios = {s.strip() for s in args.scenarios.split(",") if s.strip()}
    if not args.scenarios <= {"one", "many"}:
        parser.error("--scenarios takes one, many")
    if args.rest and not args.paced_worker_mode:
        parser.error(f"unexpected arguments: {' '.join(args.rest)}")
    return args


def pick_loop(choice: str) -> str:
    if choice in ("auto", "uvloop"):
        try:
            import uvloop
        except ImportError:
            if choice == "uvloop":
                raise
            return "asyncio"
        asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
        return "uvloop"
    return "asyncio"


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.subscriber_mode:
        subscriber_main(*args.subscriber_mode)
        return 0
    if args.web_wrapper_mode:
        instrumented_web_main(*args.web_wrapper_mode)
        return 0
    if args.paced_worker_mode:
        paced_worker_main(args.paced_worker_mode, args.rest)
        return 0
    client_loop = pick_loop(args.client_loop)
    # SIGTERM should clean up like Ctrl-C does.
    signal.signal(signal.SIGTERM, _interrupt)
    install = Installation(args)
    failed = False
    runs: list[ScenarioRun] = []
    try:
        install.prepare()
        install.start_subscriber()
        runs = asyncio.run(run_all(install, args))
    except KeyboardInterrupt:
        log("interrupted; stopping the services")
        failed = True
    except Exception as exc:
        log(f"benchmark failed: {exc}")
        log(f"web log tail:\n{install.tail('web.log')}")
        log(f"worker log tail:\n{install.tail('worker.log')}")
        failed = True
    finally:
        install.stop_all()
        install.cleanup_redis()
    report: dict[str, Any] = {}
    if runs:
        publishes = load_publishes(install.tmp / "publishes.txt")
        gc_pauses = load_gc_pauses(install.tmp)
        gc_objects = load_gc_objects(install.tmp)
        settings_batch = (
            install.env.get("LMSP_DELTA_BATCH_TOKENS", "16"),
            install.env.get("LMSP_DELTA_BATCH_MS", "50"),
        )
        report = {
            "config": {
                "streams": args.streams,
                "tasks": args.tasks,
                "one_tokens": args.one_tokens,
                "many_tokens": args.many_tokens,
                "batch_tokens": settings_batch[0],
                "batch_ms": settings_batch[1],
                "cpus": os.cpu_count(),
                "python": platform.python_version(),
                "client_loop": client_loop,
                "tokens_per_second": args.tokens_per_second or "unpaced",
                "started": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
            },
            "scenarios": [analyse(run, publishes, install.db_path, gc_pauses, gc_objects) for run in runs],
        }
        print_report(report)
        if args.json:
            Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
            log(f"results written to {args.json}")
    if args.keep:
        log(f"kept {install.tmp}")
    else:
        shutil.rmtree(install.tmp, ignore_errors=True)
    if failed:
        return 1
    # Integrity failures are correctness bugs, not slowness: say so in the exit status.
    return 2 if any(s["violations"] or s["timed_out"] for s in report.get("scenarios", [])) else 0


if __name__ == "__main__":
    sys.exit(main())
