"""Concurrent generations: the service against a plain batched ONNX Runtime loop on the same model files.

For each model (``demo`` and ``demo:base`` by default) and each number N of
concurrent tasks (1, 2, 4, 8, 16, 32), in one run:

* **plain loop** (no service): one InferenceSession with the worker's session
  options (one intra-op thread, no spinning), N rows of the same prompt as
  one batch, one ``run_with_iobinding`` per step with per-row
  ``position_ids`` and the attention mask, the KV cache fed back as bound
  OrtValues, greedy; aggregate tokens/s, and the prefill of one prompt
  (batch 1): the baseline;
* **service**: the web process as the Procfile starts it, one Celery worker
  (``--pool prefork --concurrency 1``, today's worker; or ``--pool threads``
  with ``LMSP_MAX_BATCH=N`` and ``--concurrency N``, or ``--worker-threads``
  task threads, the Procfile's 4, that start rows the run loop carries),
  Redis, a SQLite file.
  N clients at once each create a task and stream it, once through
  ``POST /lmsp/v1/tasks`` + ``GET .../events`` and once through
  ``POST /lmsp/v1/responses`` with ``stream: true``: aggregate tokens/s,
  client TTFT and inter-token gaps as the client receives them;
* **TTFT at 1 task**: sequential one-task requests of a few tokens, both ways;
* **a long prompt joins**: 4 rows generate, then a task with a ~2,000-token
  prompt is submitted; the running rows' gaps during its prefill against
  their steady gaps.

A table puts the figures beside the goals of issue 16. Nothing is asserted:
the exit status is 0 unless the bench itself failed (1) or a round broke or
timed out (2). bench/README.md explains every figure.

    .venv/bin/python bench/concurrency.py [--pool prefork|threads] [--quick] [--json PATH]
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import functools
import itertools
import json
import math
import os
import platform
import re
import shutil
import signal
import statistics
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import onnxruntime as ort
from accept_concurrent import procfile_web_command
from plain_loop import PlainLoop
from sse_fanout import (
    HOST,
    REPO,
    Installation,
    StreamProtocol,
    StreamResult,
    cpu_pressure_seconds,
    cpu_seconds_of_group,
    decode_chunked,
    log,
    machine_cpu_seconds,
    parse_stream,
    pick_loop,
    rss_of_group,
    summarize_ms,
)
from tokenizers import Tokenizer

# The names a user gives, and the demo size each builds (fixture_models/demo.py's DEMO_SIZES).
MODEL_SIZES = {"demo": "demo", "demo:small": "small", "demo:base": "base", "demo:wide": "wide"}
DEFAULT_TOKENS = {"demo": 300, "demo:small": 150, "demo:base": 64, "demo:wide": 200}
QUICK_TOKENS = {"demo": 60, "demo:small": 40, "demo:base": 24, "demo:wide": 40}
# demo:wide (151,936 logits a row, as Qwen's) is sampled as agents sample, so the sampler's cost shows;
# the others decode greedily, as the plain loop does. Keyed by the registered (endless) name.
SAMPLING = {"demo:wide-endless": {"temperature": 0.7, "top_p": 0.9}}
PROMPT = "Tell me a story about the lighthouse keeper and the storm."
LONG_PROMPT_WORDS = (
    "The keeper wrote down the weather, the ships he saw and a short poem about the sea, "
    "while the beam swept across the bay and touched the fishing boats returning home. "
)
DELTA = b"response.output_text.delta"
IN_PROGRESS = b"response.in_progress"
TERMINAL = (b"response.completed", b"response.incomplete", b"response.failed", b"response.cancelled")
# Issue 16's goals, per model: (8 tasks aggregate / plain batch 8, 1 task / plain batch 1).
GOAL_RATIOS = {"demo": (0.6, 0.9), "demo:base": (0.8, 0.99)}
TTFT_SLACK_MS = 10.0
JOIN_FACTOR = 2.0


def endless_name(size: str) -> str:
    """The registered name of the endless variant of a demo size (``lmsp_build_demo_model --endless``)."""
    return "demo:endless" if size == "demo" else f"demo:{size}-endless"


def endless_folder(models_dir: Path, size: str) -> Path:
    return models_dir / "demo" / ("endless" if size == "demo" else f"{size}-endless")


def ms(seconds: float | None) -> float | None:
    return None if seconds is None or math.isnan(seconds) else round(seconds * 1000, 3)


# --------------------------------------------------------------------------
# The plain loop
# --------------------------------------------------------------------------


def prompt_ids(folder: Path, text: str) -> list[int]:
    """``text`` as one user message through the model's chat template, tokenised as the worker does it.

    Rendered here (jinja2, add_generation_prompt), not through the backend, so
    the baseline shares nothing with the code it is the baseline of; the
    report compares the count with the service's ``usage.input_tokens``.
    """
    template, tokenizer = _template_and_tokenizer(folder)
    rendered = template.render(messages=[{"role": "user", "content": text}], add_generation_prompt=True)
    return list(tokenizer.encode(rendered, add_special_tokens=False).ids)


@functools.cache
def _template_and_tokenizer(folder: Path) -> tuple[Any, Tokenizer]:
    import jinja2

    template = jinja2.Environment().from_string((folder / "chat_template.jinja").read_text())
    return template, Tokenizer.from_file(str(folder / "tokenizer.json"))


def long_prompt_text(folder: Path, target: int) -> str:
    """A user message whose prompt (template included) has at most ``target`` tokens, and about as many."""
    words = LONG_PROMPT_WORDS.split()
    count = len(prompt_ids(folder, " ".join(words)))
    # Grow by whole copies, then trim word by word: tokens are not additive across words.
    text_words = words * max(1, target // max(1, count))
    while len(prompt_ids(folder, " ".join(text_words))) < target:
        text_words += words
    while len(text_words) > 1 and len(prompt_ids(folder, " ".join(text_words))) > target:
        text_words.pop()
    return " ".join(text_words)


def plain_batch(loop: PlainLoop, prompt: Sequence[int], rows: int, tokens: int) -> dict[str, Any]:
    loop.generate(prompt, rows, 3)  # this batch size's first run
    timing = loop.generate(prompt, rows, tokens)
    figures = {
        "tokens_per_s": round(rows * tokens / timing["seconds"], 1),
        "seconds": round(timing["seconds"], 4),
        "prefill_ms": ms(timing["prefill_s"]),
        "step_ms": ms(timing["step_s"]),
    }
    log(f"  plain batch {rows}: {figures['tokens_per_s']:.0f} tokens/s, step {figures['step_ms']:.2f} ms")
    return figures


def plain_prefill(loop: PlainLoop, prompt: Sequence[int], repeat: int) -> dict[str, Any]:
    times = sorted(loop.prefill_seconds(prompt, repeat))
    return {"tokens": len(prompt), "p50_ms": ms(statistics.median(times)), "min_ms": ms(times[0])}


# --------------------------------------------------------------------------
# The service
# --------------------------------------------------------------------------


class Service(Installation):
    """The installation of bench/sse_fanout.py, with the Procfile's web line and a worker of any pool."""

    def __init__(self, args: argparse.Namespace) -> None:
        super().__init__(
            SimpleNamespace(port=0, batch_tokens=None, batch_ms=None, tokens_per_second=0, profile_web="", web_gc=False)
        )
        self.env.update(
            {
                "LMSP_HOST": HOST,
                "LMSP_PORT": str(self.port),
                "LMSP_INTRA_OP_THREADS": str(args.threads),
                "LMSP_DEVICE": args.device,
            }
        )
        self.worker_config: tuple[str, int, int | None] | None = None
        self.worker_commands: list[str] = []
        self.warm: set[str] = set()

    def prepare_models(self, sizes: Sequence[str]) -> None:
        log(f"temp dir {self.tmp}, redis prefix {self.prefix}, port {self.port}")
        self.manage("migrate", "-v0")
        for size in sizes:
            out = self.manage("lmsp_build_demo_model", "--size", size, "--endless")
            if f"registered {endless_name(size)}" not in out:
                raise RuntimeError(f"lmsp_build_demo_model did not register {endless_name(size)}:\n{out}")
        self.token = self.manage("lmsp_client", "create", "bench", "--scopes", "responses,read").strip()

    @property
    def models_dir(self) -> Path:
        return Path(self.env["LMSP_MODELS_DIR"])

    def web_argv(self, label: str) -> list[str]:
        return ["bash", "-c", procfile_web_command()]

    def use_worker(self, pool: str, concurrency: int, max_batch: int | None) -> None:
        """A worker of this configuration (a new one when it differs from the running one)."""
        if self.worker is not None and self.worker_config == (pool, concurrency, max_batch):
            return
        self.stop_worker()
        self.warm.clear()
        line = next(line for line in (REPO / "Procfile").read_text().splitlines() if line.startswith("worker:"))
        command, found = re.subn(
            r"--pool \S+ --concurrency \S+", f"--pool {pool} --concurrency {concurrency}", line.split(":", 1)[1]
        )
        if found != 1:
            raise RuntimeError(f"the Procfile's worker line has no '--pool P --concurrency C': {line}")
        # Mingle and gossip would talk to the workers of other runs on this Redis.
        command += " --without-mingle --without-gossip --without-heartbeat"
        self.worker_starts += 1
        log_name = f"worker{self.worker_starts}.log"
        if max_batch is None:
            self.env.pop("LMSP_MAX_BATCH", None)
        else:
            self.env["LMSP_MAX_BATCH"] = str(max_batch)
        self.worker = self._spawn(["bash", "-c", command], log_name)
        self.worker_commands.append(command.strip() + (f"  (LMSP_MAX_BATCH={max_batch})" if max_batch else ""))
        self.worker_config = (pool, concurrency, max_batch)
        deadline = time.monotonic() + 120
        while " ready." not in (self.tmp / log_name).read_text(errors="replace"):
            if self.worker.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the worker did not start:\n{self.tail(log_name)}")
            time.sleep(0.1)
        batch = f", LMSP_MAX_BATCH={max_batch}" if max_batch is not None else ""
        log(f"worker: --pool {pool} --concurrency {concurrency}{batch}")

    def group_cpu(self) -> dict[str, float]:
        busy, _ = machine_cpu_seconds()
        return {
            "web": cpu_seconds_of_group(self.web.pid) if self.web else 0.0,
            "worker": cpu_seconds_of_group(self.worker.pid) if self.worker else 0.0,
            "machine": busy,
            "pressure": cpu_pressure_seconds(),
            "wall": time.time(),
        }


def cpu_delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """Cores busy on average over a round (web, worker, whole machine) and the share of it some task waited for one."""
    wall = max(1e-9, after["wall"] - before["wall"])
    return {
        "wall_s": round(wall, 3),
        "web_cores": round((after["web"] - before["web"]) / wall, 2),
        "worker_cores": round((after["worker"] - before["worker"]) / wall, 2),
        "machine_cores": round((after["machine"] - before["machine"]) / wall, 2),
        "cpu_waiting_share": round((after["pressure"] - before["pressure"]) / wall, 2),
    }


# --------------------------------------------------------------------------
# The client
# --------------------------------------------------------------------------


@dataclass
class Stream:
    """One task as a client saw it: when it asked, and every event with the time of the read that completed it."""

    kind: str  # "tasks" (POST /tasks + GET events) or "responses" (POST /responses, stream: true)
    sent_at: float = 0.0
    task_id: str = ""
    result: StreamResult | None = None
    error: str | None = None
    scanned: int = 0
    delta_seen: bool = False
    # After analyse():
    in_progress_at: float | None = None
    delta_times: list[float] = field(default_factory=list)
    terminal: str = ""
    terminal_at: float | None = None
    output_tokens: int = 0
    input_tokens: int = 0

    def saw_delta(self) -> bool:
        """Whether a delta arrived yet (looks only at the reads since the last call)."""
        if not self.delta_seen and self.result is not None:
            pieces = self.result.pieces
            self.delta_seen = DELTA in b"".join(pieces[max(0, self.scanned - 1) :])
            self.scanned = len(pieces)
        return self.delta_seen

    @property
    def first_delta_at(self) -> float | None:
        return self.delta_times[0] if self.delta_times else None

    @property
    def ttft(self) -> float | None:
        return self.first_delta_at - self.sent_at if self.delta_times else None

    def analyse(self) -> None:
        """Decodes what was read (after the run) and takes the times the figures need."""
        result = self.result
        if result is None:
            return
        if not result.body_start:
            self.error = self.error or result.error or "no answer"
            return
        raw = b"".join(result.pieces)
        parse_stream(result, {})
        if result.error and not self.error:
            self.error = result.error
        blocks = [b for b in decode_chunked(raw, result.body_start)[0].split(b"\n\n")[:-1] if not b.startswith(b":")]
        if len(blocks) != len(result.received):
            self.error = self.error or f"{len(blocks)} SSE blocks but {len(result.received)} timed events"
            return
        for block, received in zip(blocks, result.received, strict=True):
            kind = data = b""
            for line in block.split(b"\n"):
                if line.startswith(b"event: "):
                    kind = line[7:]
                elif line.startswith(b"data: "):
                    data = line[6:]
            if kind == DELTA:
                self.delta_times.append(received)
            elif kind == IN_PROGRESS and self.in_progress_at is None:
                self.in_progress_at = received
            elif kind in TERMINAL:
                self.terminal, self.terminal_at = kind.decode(), received
                usage = json.loads(data)["response"].get("usage") or {}
                self.output_tokens = int(usage.get("output_tokens") or 0)
                self.input_tokens = int(usage.get("input_tokens") or 0)
        if not self.output_tokens:
            # A cancelled response may carry no usage: one token per delta, about what today's worker writes.
            self.output_tokens = len(self.delta_times)
        if not self.terminal:
            self.error = self.error or "no terminal event"

    @property
    def tokens_per_event(self) -> float:
        return self.output_tokens / len(self.delta_times) if self.delta_times else float("nan")

    def arrivals(self) -> list[tuple[float, int]]:
        """The reads that brought deltas: (time, deltas in it)."""
        found: list[tuple[float, int]] = []
        for at in self.delta_times:
            if found and found[-1][0] == at:
                found[-1] = (at, found[-1][1] + 1)
            else:
                found.append((at, 1))
        return found

    def token_gaps(self, start: float = -math.inf, end: float = math.inf, overlap: bool = False) -> list[float]:
        """Per-token gaps: each arrival's gap to the previous one over the tokens it carried, once per token.

        Only arrivals after the first (whose gap is the TTFT) and inside
        [start, end], or with ``overlap`` whose interval meets it.
        """
        samples: list[float] = []
        per_event = self.tokens_per_event
        previous = None
        for at, count in self.arrivals():
            if previous is not None:
                inside = (previous <= end and at >= start) if overlap else (start <= at <= end)
                if inside:
                    samples += [(at - previous) / (count * per_event)] * count
            previous = at
        return samples


def _request(method: str, path: str, token: str, port: int, body: Any = None, extra: str = "") -> bytes:
    payload = json.dumps(body).encode() if body is not None else b""
    head = (
        f"{method} {path} HTTP/1.1\r\nHost: {HOST}:{port}\r\nAuthorization: Bearer {token}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(payload)}\r\n{extra}\r\n"
    )
    return head.encode() + payload


async def http_json(svc: Service, method: str, path: str, body: Any = None) -> tuple[int, Any]:
    """One request on its own connection; the status and the decoded JSON body (None when empty)."""
    reader, writer = await asyncio.open_connection(HOST, svc.port)
    try:
        writer.write(_request(method, path, svc.token, svc.port, body, "Connection: close\r\n"))
        head = await reader.readuntil(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        status = int(lines[0].split()[1])
        length = next((int(v) for k, _, v in (h.partition(":") for h in lines[1:]) if k.lower() == "content-length"), 0)
        data = await reader.readexactly(length) if length else b""
        return status, json.loads(data) if data else None
    finally:
        writer.close()


def request_body(model: str, text: str, tokens: int) -> dict[str, Any]:
    return {"model": model, "input": text, "max_output_tokens": tokens, **SAMPLING.get(model, {"temperature": 0})}


async def follow(svc: Service, stream: Stream, request: bytes, timeout: float) -> None:
    stream.result = StreamResult(index=0, task_id=stream.task_id)
    protocol = StreamProtocol(stream.result, request, lambda _result: None)
    try:
        await asyncio.get_running_loop().create_connection(lambda: protocol, HOST, svc.port)
        await asyncio.wait_for(protocol.done, timeout)
    except (OSError, TimeoutError) as exc:
        stream.error = f"{type(exc).__name__}: {exc}"
    finally:
        if protocol.transport is not None:
            protocol.transport.close()


async def run_task_stream(svc: Service, stream: Stream, model: str, text: str, tokens: int, timeout: float) -> None:
    """``POST /tasks``, then its event stream to the end."""
    stream.sent_at = time.time()
    status, body = await http_json(
        svc, "POST", "/lmsp/v1/tasks", {"type": "response", "input": request_body(model, text, tokens)}
    )
    if status != 202:
        stream.error = f"POST /tasks answered {status}: {body}"
        return
    stream.task_id = body["id"]
    request = _request(
        "GET", f"/lmsp/v1/tasks/{stream.task_id}/events", svc.token, svc.port, extra="Accept: text/event-stream\r\n"
    )
    await follow(svc, stream, request, timeout)


async def run_response_stream(svc: Service, stream: Stream, model: str, text: str, tokens: int, timeout: float) -> None:
    """``POST /responses`` with ``stream: true``: the events come on the answer itself."""
    body = {**request_body(model, text, tokens), "stream": True}
    request = _request("POST", "/lmsp/v1/responses", svc.token, svc.port, body, "Accept: text/event-stream\r\n")
    stream.sent_at = time.time()
    await follow(svc, stream, request, timeout)


RUNNERS: dict[str, Callable[..., Awaitable[None]]] = {"tasks": run_task_stream, "responses": run_response_stream}


async def run_round(svc: Service, kind: str, model: str, n: int, tokens: int, timeout: float) -> list[Stream]:
    streams = [Stream(kind) for _ in range(n)]
    await asyncio.gather(*(RUNNERS[kind](svc, s, model, PROMPT, tokens, timeout) for s in streams))
    for stream in streams:
        stream.analyse()
    return streams


async def wait_until(check: Callable[[], bool], timeout: float, period: float = 0.02) -> bool:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(period)
    return True


# --------------------------------------------------------------------------
# Figures
# --------------------------------------------------------------------------


def progress_commits(svc: Service, streams: list[Stream], wall: float | None) -> dict[str, Any]:
    """The worker's transactions that wrote the round's deltas, from the SQLite file the services share.

    One transaction stamps its events with one time (``lifecycle``: the commit's own clock reading), so
    the distinct (time) values among the round's delta events are its commits, whether each task
    committed alone or a commit window wrote many tasks at once; (task, time) pairs are the task-batches.
    """
    import sqlite3

    ids = [s.task_id for s in streams if s.task_id]
    path = svc.env["DATABASE_URL"].removeprefix("sqlite:///")
    if not ids or not wall or not path.startswith("/"):
        return {}
    marks = ",".join("?" * len(ids))
    query = (
        f"SELECT COUNT(DISTINCT created_at), COUNT(DISTINCT task_id || created_at) FROM task_events"
        f" WHERE task_id IN ({marks}) AND type = 'response.output_text.delta'"
    )
    with sqlite3.connect(f"file:{path}?mode=ro", uri=True) as db:
        commits, batches = db.execute(query, ids).fetchone()
    return {
        "commits": commits,
        "task_batches": batches,
        "per_s": round(commits / wall, 1),
        "tasks_per_commit": round(batches / commits, 2) if commits else None,
    }


def round_figures(streams: list[Stream], cpu: dict[str, float]) -> dict[str, Any]:
    done = [s for s in streams if s.terminal_at is not None]
    errors = [s.error for s in streams if s.error]
    tokens = sum(s.output_tokens for s in streams)
    wall = max(s.terminal_at for s in done) - min(s.sent_at for s in streams) if done else None
    event_gaps, arrival_gaps, token_gaps = [], [], []
    for s in streams:
        event_gaps += [b - a for a, b in itertools.pairwise(s.delta_times)]
        arrival_gaps += [b - a for (a, _), (b, _) in itertools.pairwise(s.arrivals())]
        token_gaps += s.token_gaps()
    deltas = sum(len(s.delta_times) for s in streams)
    arrivals = sum(len(s.arrivals()) for s in streams)
    return {
        "tasks": len(streams),
        "completed": len(done),
        "errors": errors[:5],
        "error_count": len(errors),
        "output_tokens": tokens,
        "input_tokens": sorted({s.input_tokens for s in streams}),
        "wall_s": round(wall, 4) if wall else None,
        "tokens_per_s": round(tokens / wall, 1) if wall else None,
        "ttft": summarize_ms([s.ttft for s in streams if s.ttft is not None]),
        "itl_token": summarize_ms(token_gaps),
        "itl_event": summarize_ms(event_gaps),
        "itl_arrival": summarize_ms(arrival_gaps),
        "tokens_per_event": round(tokens / deltas, 3) if deltas else None,
        "events_per_arrival": round(deltas / arrivals, 2) if arrivals else None,
        "cpu": cpu,
    }


def join_figures(rows: list[Stream], long: Stream, submitted: float, steady_s: float) -> dict[str, Any]:
    """The rows' gaps while the long prompt was prefilled, against their steady gaps before it came."""
    start = long.in_progress_at or long.sent_at
    end = long.first_delta_at
    steady = [g for r in rows for g in r.token_gaps(submitted - steady_s, submitted)]
    steady_p50 = summarize_ms(list(steady)).get("p50_ms")
    figures: dict[str, Any] = {
        "long_input_tokens": long.input_tokens,
        "long_ttft_ms": ms(long.ttft),
        "prefill_window_ms": ms(end - start) if end is not None else None,
        "steady": summarize_ms(steady),
        "steady_step_ms": steady_p50,
    }
    if end is None:
        figures.update(joined=False, rows_during_prefill=0, during=summarize_ms([]))
        return figures
    # A row ran through the prefill when it streamed before the window and again after it.
    through = [r for r in rows if r.first_delta_at is not None and r.first_delta_at < start and r.delta_times[-1] > end]
    during = [g for r in through for g in r.token_gaps(start, end, overlap=True)]
    stalls = []
    for r in through:
        stalls += [b - a for (a, _), (b, _) in itertools.pairwise(r.arrivals()) if a <= end and b >= start]
    figures.update(
        joined=bool(through),
        rows_during_prefill=len(through),
        during=summarize_ms(during),
        longest_arrival_gap_ms=ms(max(stalls)) if stalls else None,
    )
    return figures


def goals(report: dict[str, Any]) -> list[dict[str, Any]]:
    """Issue 16's goals beside the figures of this run."""
    found = []

    def add(model: str, goal: str, figure: float | None, target: float | None, note: str = "") -> None:
        # Latencies are goals from above, throughput ratios from below.
        at_most = goal.startswith(("TTFT", "ITL"))
        met = None
        if figure is not None and target is not None:
            met = figure <= target if at_most else figure >= target
        found.append({"model": model, "goal": goal, "figure": figure, "target": target, "met": met, "note": note})

    for model, data in report["models"].items():
        plain, rounds = data["plain"]["sweep"], data["service"]
        eight, one = GOAL_RATIOS.get(model, (None, None))
        for n, target, label in ((8, eight, "8 tasks aggregate / plain batch 8"), (1, one, "1 task / plain batch 1")):
            svc = rounds.get(str(n), {}).get("tasks", {}).get("tokens_per_s")
            base = plain.get(n, {}).get("tokens_per_s")
            add(model, label, round(svc / base, 3) if svc and base else None, target, "tasks + SSE round")
        ttft = data.get("ttft_single", {}).get("responses", {}).get("p50_ms")
        prefill = data["plain"].get("prefill", {}).get("p50_ms")
        add(
            model,
            "TTFT responses stream p50, 1 task (ms)",
            ttft,
            round(prefill + TTFT_SLACK_MS, 3) if prefill is not None else None,
            "plain prefill + 10 ms",
        )
        if data.get("rss_mib"):
            rss = data["rss_mib"]
            print(f"resident memory after the rounds: worker processes {rss['worker']} MiB, engine {rss['engine']} MiB")
        join = data.get("join")
        if join:
            steady = join.get("steady_step_ms")
            figure = join["during"].get("p99_ms") if join["joined"] else None
            note = "" if join["joined"] else "n/a: no row was generating during the long prompt's prefill"
            add(
                model,
                "ITL p99 while a long prompt joins (ms)",
                figure,
                round(JOIN_FACTOR * steady, 3) if steady else None,
                note,
            )
    return found


# --------------------------------------------------------------------------
# The run
# --------------------------------------------------------------------------


def worker_for(args: argparse.Namespace, n: int) -> tuple[str, int, int | None]:
    if args.pool == "prefork":
        return "prefork", 1, None
    size = args.max_batch or n
    return "threads", args.worker_threads or size, size


async def warm_up(svc: Service, model: str) -> None:
    """One short task, so that the model's load is not in the first round."""
    if model in svc.warm:
        return
    stream = Stream("tasks")
    await run_task_stream(svc, stream, model, PROMPT, 4, 180)
    stream.analyse()
    if stream.terminal not in ("response.completed", "response.incomplete"):
        raise RuntimeError(
            f"the warm-up task of {model} ended {stream.terminal or 'without a terminal'}: {stream.error}"
        )
    svc.warm.add(model)


async def measure_service(svc: Service, args: argparse.Namespace, name: str, model: str, plain: Plain) -> dict:
    """The sweep; each N's plain batch runs just before its service rounds, so both see the same machine."""
    rounds: dict[str, dict[str, Any]] = {}
    tokens = args.tokens[name]
    for n in args.concurrency:
        svc.use_worker(*worker_for(args, n))
        await warm_up(svc, model)
        batch = plain.figures["sweep"][n] = plain_batch(plain.loop, plain.prompt, n, tokens)
        # Generous: every task one after the other at ten times the plain loop's step of this batch.
        timeout = 60 + 10 * n * tokens * batch["step_ms"] / 1000
        rounds[str(n)] = {}
        for kind in args.kinds:
            await asyncio.sleep(0.5)
            before = svc.group_cpu()
            streams = await run_round(svc, kind, model, n, tokens, timeout)
            figures = round_figures(streams, cpu_delta(before, svc.group_cpu()))
            figures["commits"] = progress_commits(svc, streams, figures["wall_s"])
            rounds[str(n)][kind] = figures
            ttft, itl = figures["ttft"].get("p50_ms"), figures["itl_token"].get("p99_ms")
            log(
                f"  {name} N={n} {kind}: {figures['tokens_per_s']} tokens/s, TTFT p50 {ttft} ms,"
                f" ITL per token p99 {itl} ms, errors {figures['error_count']},"
                f" {figures['commits'].get('per_s')} progress commits/s"
                f" ({figures['commits'].get('tasks_per_commit')} tasks each)"
            )
    return rounds


async def measure_ttft_single(svc: Service, args: argparse.Namespace, name: str, model: str, plain: Plain) -> dict:
    svc.use_worker(*worker_for(args, 1))
    await warm_up(svc, model)
    prefill = plain.figures["prefill"] = plain_prefill(plain.loop, plain.prompt, args.ttft_repeats)
    log(f"  plain prefill, batch 1: {prefill['p50_ms']} ms")
    found = {}
    for kind in args.kinds:
        ttfts, errors = [], []
        for _ in range(args.ttft_repeats):
            await asyncio.sleep(0.2)
            stream = Stream(kind)
            await RUNNERS[kind](svc, stream, model, PROMPT, 4, 60)
            stream.analyse()
            if stream.ttft is not None:
                ttfts.append(stream.ttft)
            if stream.error:
                errors.append(stream.error)
        found[kind] = {**summarize_ms(ttfts), "errors": errors[:3]}
        log(f"  {name} TTFT at 1 task, {kind}: p50 {found[kind].get('p50_ms')} ms, p99 {found[kind].get('p99_ms')} ms")
    return found


async def measure_join(svc: Service, args: argparse.Namespace, name: str, model: str, plain: Plain) -> dict:
    rows_n = args.join_rows
    svc.use_worker(*worker_for(args, rows_n + 1))
    await warm_up(svc, model)
    prefill = plain.figures["long_prefill"] = plain_prefill(plain.loop, plain.long_prompt, 2)
    log(f"  plain prefill of the long prompt, batch 1: {prefill['p50_ms']} ms")
    # A slow machine must not turn a slow join into "never joined".
    join_timeout = max(args.join_timeout, 3 * prefill["p50_ms"] / 1000)
    # Long enough never to end before the bench cancels them, within the context.
    row_tokens = plain.loop.context - 64
    rows = [Stream("tasks") for _ in range(rows_n)]
    followers = [asyncio.create_task(run_task_stream(svc, r, model, PROMPT, row_tokens, 600)) for r in rows]
    await wait_until(lambda: any(r.saw_delta() for r in rows), 60)
    all_started = await wait_until(lambda: all(r.saw_delta() for r in rows), args.join_wait)
    await asyncio.sleep(args.steady)
    long = Stream("tasks")
    submitted = time.time()
    follower = asyncio.create_task(run_task_stream(svc, long, model, plain.long_text, 8, 600))
    joined = await wait_until(long.saw_delta, join_timeout)
    if joined:
        await asyncio.sleep(args.after)
    for row in rows:
        if row.task_id:
            await http_json(svc, "POST", f"/lmsp/v1/tasks/{row.task_id}/cancel")
    await asyncio.gather(*followers, follower)
    for stream in [*rows, long]:
        stream.analyse()
    figures = join_figures(rows, long, submitted, args.steady)
    figures.update(
        rows=rows_n,
        all_rows_started_before=all_started,
        long_started_within_timeout=joined,
        errors=[s.error for s in [*rows, long] if s.error][:5],
    )
    log(
        f"  {name} join: {figures['rows_during_prefill']} rows through the prefill, steady"
        f" {figures['steady_step_ms']} ms, p99 during it {figures['during'].get('p99_ms')} ms,"
        f" long TTFT {figures['long_ttft_ms']} ms"
    )
    return figures


async def run_service(svc: Service, args: argparse.Namespace, report: dict[str, Any], plains: dict[str, Plain]) -> None:
    for name in args.models:
        model = endless_name(MODEL_SIZES[name])
        data, plain = report["models"][name], plains[name]
        log(f"{name} ({model}), load average {os.getloadavg()[0]:.2f}")
        data["service"] = await measure_service(svc, args, name, model, plain)
        data["ttft_single"] = await measure_ttft_single(svc, args, name, model, plain)
        if args.join:
            data["join"] = await measure_join(svc, args, name, model, plain)
        if svc.worker is not None:
            data["rss_mib"] = rss_of_group(svc.worker.pid)


# --------------------------------------------------------------------------
# Output
# --------------------------------------------------------------------------


def _cell(stats: dict[str, Any], key: str = "p50_ms", other: str = "p99_ms") -> str:
    if not stats or not stats.get("count"):
        return "-"
    return f"{stats[key]:.1f} / {stats[other]:.1f}"


SWEEP_COLUMNS = (
    "N",
    "plain tok/s",
    "tasks tok/s",
    "x plain",
    "responses tok/s",
    "TTFT tasks p50 / p99 ms",
    "TTFT responses p50 / p99",
    "ITL per token p50 / p99",
    "per event p50 / p99",
    "tokens / event",
    "per arrival p50 / p99",
    "events / arrival",
    "worker / machine cores",
)


def _sweep_row(n_key: str, kinds: dict[str, Any], plain: dict[str, Any]) -> list[str]:
    """One row of the sweep table: the tasks round's figures, the responses round's throughput and TTFT."""
    tasks, responses = kinds.get("tasks", {}), kinds.get("responses", {})
    base = plain.get("tokens_per_s")
    ratio = f"{tasks['tokens_per_s'] / base:.2f}" if tasks.get("tokens_per_s") and base else "-"
    cpu = tasks.get("cpu", {})
    return [
        n_key,
        str(base),
        str(tasks.get("tokens_per_s", "-")),
        ratio,
        str(responses.get("tokens_per_s", "-")),
        _cell(tasks.get("ttft", {})),
        _cell(responses.get("ttft", {})),
        _cell(tasks.get("itl_token", {})),
        _cell(tasks.get("itl_event", {})),
        str(tasks.get("tokens_per_event", "-")),
        _cell(tasks.get("itl_arrival", {})),
        str(tasks.get("events_per_arrival", "-")),
        f"{cpu.get('worker_cores', '-')} / {cpu.get('machine_cores', '-')}",
    ]


def print_report(report: dict[str, Any]) -> None:
    config = report["config"]
    print()
    print(
        f"worker --pool {config['pool']}, {config['threads']} intra-op thread(s), device {config['device']}, "
        f"{config['cpus']} cores, load average {config['load_before']} before / {config['load_after']} after"
    )
    for name, data in report["models"].items():
        plain = data["plain"]
        print()
        print(
            f"## {name} (registered as {data['registered']}: the endless variant, so every task runs to its "
            f"{data['tokens']} tokens)"
        )
        print(
            f"prompt {plain['prompt_tokens']} tokens (service: {data.get('service_input_tokens')}); "
            f"plain prefill, batch 1: {plain.get('prefill', {}).get('p50_ms')} ms (p50)"
        )
        print("| " + " | ".join(SWEEP_COLUMNS) + " |")
        print("|" + "---:|" * len(SWEEP_COLUMNS))
        for n_key, kinds in data.get("service", {}).items():
            print("| " + " | ".join(_sweep_row(n_key, kinds, plain["sweep"].get(int(n_key), {}))) + " |")
        single = data.get("ttft_single", {})
        if single:
            parts = [f"{kind} {_cell(stats)} ms (n={stats.get('count', 0)})" for kind, stats in single.items()]
            print(f"TTFT at 1 task, p50 / p99: {'; '.join(parts)}")
        join = data.get("join")
        if join:
            print(
                f"long prompt joins: {join['long_input_tokens']} prompt tokens (asked {data['long_prompt_asked']}), "
                f"{join['rows_during_prefill']} of {join['rows']} rows generating through its prefill; long TTFT "
                f"{join['long_ttft_ms']} ms (plain prefill {plain.get('long_prefill', {}).get('p50_ms')} ms); "
                "rows' per-token gap: "
                f"steady p50 / p99 {_cell(join['steady'])} ms, during the prefill {_cell(join['during'])} ms, "
                f"longest gap between arrivals {join.get('longest_arrival_gap_ms')} ms"
            )
            if data.get("long_prompt_note"):
                print(f"  {data['long_prompt_note']}")
    print()
    print("| model | goal | figure | target | met |")
    print("|---|---|---:|---:|---|")
    for goal in report["goals"]:
        met = {True: "yes", False: "**no**", None: "n/a"}[goal["met"]]
        note = f" ({goal['note']})" if goal["note"] else ""
        print(f"| {goal['model']} | {goal['goal']}{note} | {goal['figure']} | {goal['target']} | {met} |")


# --------------------------------------------------------------------------
# Main
# --------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="demo,demo:base", help=f"comma-separated, of {', '.join(MODEL_SIZES)}")
    parser.add_argument("--concurrency", default=None, help="comma-separated task counts (default 1,2,4,8,16,32)")
    parser.add_argument(
        "--tokens",
        default=None,
        help="output tokens per task: one number for every model, or MODEL=T,... (default demo=300, demo:base=64)",
    )
    parser.add_argument("--pool", choices=("prefork", "threads"), default="prefork", help="the worker's pool")
    parser.add_argument(
        "--max-batch",
        type=int,
        default=None,
        help="threads pool: one worker of --concurrency K and LMSP_MAX_BATCH=K for every N (default: K = N per round)",
    )
    parser.add_argument(
        "--worker-threads",
        type=int,
        default=None,
        help="threads pool: its --concurrency (task threads that start rows, LMSP_WORKER_THREADS); "
        "default: as many as LMSP_MAX_BATCH (a thread per row, as before the run loop)",
    )
    parser.add_argument("--kinds", default="tasks,responses", help="how clients create and stream: tasks, responses")
    parser.add_argument(
        "--ttft-repeats", type=int, default=None, help="one-task requests per kind for TTFT (default 10)"
    )
    parser.add_argument("--no-join", dest="join", action="store_false", help="skip the long-prompt scenario")
    parser.add_argument("--join-rows", type=int, default=4, help="rows generating when the long prompt comes")
    parser.add_argument("--join-prompt-tokens", type=int, default=None, help="the long prompt's tokens (default 2000)")
    parser.add_argument(
        "--steady", type=float, default=None, help="seconds of steady gaps before the long prompt (1.5)"
    )
    parser.add_argument("--after", type=float, default=1.0, help="seconds the rows go on after its first token")
    parser.add_argument("--join-wait", type=float, default=3.0, help="at most this long for every row to start")
    parser.add_argument(
        "--join-timeout", type=float, default=15.0, help="at most this long for the long prompt's first token"
    )
    parser.add_argument("--threads", type=int, default=1, help="intra-op threads, the worker's and the plain loop's")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--quick", action="store_true", help="a smoke run of about a minute")
    parser.add_argument("--json", metavar="PATH", help="also write every figure as JSON")
    parser.add_argument("--keep", action="store_true", help="keep the temp dir (logs, database, models)")
    args = parser.parse_args(argv)
    args.models = [m.strip() for m in args.models.split(",") if m.strip()]
    unknown = [m for m in args.models if m not in MODEL_SIZES]
    if unknown:
        parser.error(f"unknown model(s) {unknown}; choose from {', '.join(MODEL_SIZES)}")
    quick = args.quick
    args.concurrency = [int(n) for n in (args.concurrency or ("1,8" if quick else "1,2,4,8,16,32")).split(",")]
    args.kinds = [k.strip() for k in args.kinds.split(",") if k.strip()]
    if not set(args.kinds) <= set(RUNNERS):
        parser.error("--kinds takes tasks, responses")
    tokens = dict(QUICK_TOKENS if quick else DEFAULT_TOKENS)
    if args.tokens:
        if "=" in args.tokens:
            tokens.update({k.strip(): int(v) for k, _, v in (p.partition("=") for p in args.tokens.split(","))})
        else:
            tokens = dict.fromkeys(MODEL_SIZES, int(args.tokens))
    args.tokens = tokens
    args.ttft_repeats = args.ttft_repeats or (3 if quick else 10)
    args.join_prompt_tokens = args.join_prompt_tokens or (500 if quick else 2000)
    args.steady = args.steady if args.steady is not None else (0.5 if quick else 1.5)
    if quick:
        args.after = min(args.after, 0.5)
        args.join_wait = min(args.join_wait, 1.0)
        args.join_timeout = min(args.join_timeout, 5.0)
    return args


@dataclass
class Plain:
    """A model's plain loop, its prompts, and the figures it gathers as the run goes."""

    loop: PlainLoop
    prompt: list[int]
    long_text: str
    long_prompt: list[int]
    figures: dict[str, Any]


def plain_prepare(folder: Path, args: argparse.Namespace, data: dict[str, Any]) -> Plain:
    """The session and the prompts; the long prompt is shorter than asked when the context does not hold it."""
    loop = PlainLoop(folder, threads=args.threads, device=args.device)
    prompt = prompt_ids(folder, PROMPT)
    loop.generate(prompt, 1, 4)
    room = loop.context - 64
    asked = args.join_prompt_tokens
    if room < asked:
        data["long_prompt_note"] = (
            f"the context ({loop.context}) holds {room} prompt tokens: the long prompt has {room}"
        )
    long_text = long_prompt_text(folder, min(asked, room)) if args.join else ""
    data["long_prompt_asked"] = asked
    figures = {"prompt_tokens": len(prompt), "context": loop.context, "sweep": {}}
    return Plain(loop, prompt, long_text, prompt_ids(folder, long_text) if long_text else [], figures)


def collect(svc: Service, args: argparse.Namespace, report: dict[str, Any]) -> bool:
    """Every measurement into ``report``; False when the bench itself failed (what it measured is still reported)."""
    try:
        svc.prepare_models([MODEL_SIZES[m] for m in args.models])
        plains = {}
        for name in args.models:
            size = MODEL_SIZES[name]
            data = report["models"][name] = {"registered": endless_name(size), "tokens": args.tokens[name]}
            plains[name] = plain_prepare(endless_folder(svc.models_dir, size), args, data)
            data["plain"] = plains[name].figures
        svc.start_web("web")
        asyncio.run(run_service(svc, args, report, plains))
        return True
    except KeyboardInterrupt:
        log("interrupted; stopping the services")
    except Exception as exc:
        worker_log = svc.tail(f"worker{svc.worker_starts}.log")
        log(
            f"benchmark failed: {type(exc).__name__}: {exc}\nweb log:\n{svc.tail('web.log')}\nworker log:\n{worker_log}"
        )
    finally:
        svc.stop_all()
        svc.cleanup_redis()
        if not args.keep:
            shutil.rmtree(svc.tmp, ignore_errors=True)
    return False


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    client_loop = pick_loop("auto")
    # SIGTERM cleans up like Ctrl-C does.
    signal.signal(signal.SIGTERM, _interrupt)
    svc = Service(args)
    report: dict[str, Any] = {
        "config": {
            "pool": args.pool,
            "max_batch": args.max_batch,
            "concurrency": args.concurrency,
            "threads": args.threads,
            "device": args.device,
            "kinds": args.kinds,
            "quick": args.quick,
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "onnxruntime": ort.__version__,
            "client_loop": client_loop,
            "load_before": round(os.getloadavg()[0], 2),
            "started": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        },
        "models": {},
    }
    failed = not collect(svc, args, report)
    if args.keep:
        log(f"kept {svc.tmp}")
    report["config"]["load_after"] = round(os.getloadavg()[0], 2)
    report["config"]["worker_commands"] = sorted(set(svc.worker_commands))
    broken = False
    for data in report["models"].values():
        inputs = {n for kinds in data.get("service", {}).values() for f in kinds.values() for n in f["input_tokens"]}
        data["service_input_tokens"] = sorted(inputs)
        broken |= any(f["error_count"] for kinds in data.get("service", {}).values() for f in kinds.values())
    if all("service" in d for d in report["models"].values()) and report["models"]:
        report["goals"] = goals(report)
        print_report(report)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
        log(f"results written to {args.json}")
    return 1 if failed else 2 if broken else 0


if __name__ == "__main__":
    sys.exit(main())
