"""The engine process: a worker's models and their batch engines, and nothing else.

Started by the worker (``workers.engine_process.client``) as
``python -m workers.engine_process.host FD``, with one end of a socket pair
as ``FD``. It imports no Django, no Celery and no Redis client: its threads
are the engines' model threads, which have its GIL almost to themselves, the
reader of the worker's messages (this module's main thread), a few threads
that load models and set generations up (a compile or a load must not hold
up a cancel), and the sender, which batches what the rows made.

The model thread never waits for the worker: a chunk it puts only marks its
row (:meth:`Host._mark`); the sender takes every marked row's chunks when it
next runs, that is, once the model thread gives the GIL up for its next
session call, and sends them as one message. So messages come per step, not
per row.

The process ends when the worker does: the pipe's end-of-file (the worker
exited, or was killed) stops it at once, without a word to anyone, since
the worker's own end already hands its rows back.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from tasks_app import faults
from workers.backends import get_backend
from workers.backends.base import Chunk, Engine, EngineObserver, Generation, LoadedModel, SamplingParams
from workers.backends.errors import GenerationError, RuntimeFailure
from workers.backends.row_stream import RowStream
from workers.engine_process.messages import (
    BATCH,
    CANCEL,
    DRAIN,
    ENGINE,
    HELLO,
    LOAD,
    OPEN,
    REPLY,
    STOP,
    SUBMIT,
    TICK_SECONDS,
    UNLOAD,
    ModelInfo,
    Observation,
    Opened,
    RowNews,
)

log = logging.getLogger(__name__)

# As the worker had it (workers.engines): a model thread that gave the GIL up for a session call gets it back
# at once from the sender or the reader, instead of after Python's default 5 ms.
SWITCH_INTERVAL_SECONDS = 0.0005
# Loads and set-ups run beside the reader: a model loading must not hold up another model's cancels.
SETUP_THREADS = 4


class RecordingObserver(EngineObserver):
    """An engine's observer here: every call is kept, in order, for the sender to replay on the worker's
    metrics. Appending to a list is all the model thread does."""

    def __init__(self, host: Host, key: str, serial: int) -> None:
        self._host, self._key, self._serial = host, key, serial

    def _keep(self, method: str, **kwargs: Any) -> None:
        self._host.observed.append(Observation(self._key, self._serial, method, kwargs))

    def step(self, *, rows: int, seconds: float) -> None:
        self._keep("step", rows=rows, seconds=seconds)

    def prefill(self, *, tokens: int, seconds: float) -> None:
        self._keep("prefill", tokens=tokens, seconds=seconds)

    def masks(self, *, rows: int, seconds: float) -> None:
        self._keep("masks", rows=rows, seconds=seconds)

    def queue_wait(self, seconds: float) -> None:
        self._keep("queue_wait", seconds=seconds)

    def kv(self, *, in_use: int, budget: int) -> None:
        self._keep("kv", in_use=in_use, budget=budget)

    def prefix_hit(self, *, tokens: int) -> None:
        self._keep("prefix_hit", tokens=tokens)

    def prefix_cache(self, *, cached_bytes: int, evicted: Any) -> None:
        self._keep("prefix_cache", cached_bytes=cached_bytes, evicted=list(evicted))

    def rows(self, *, running: int, waiting: int) -> None:
        self._keep("rows", running=running, waiting=waiting)

    def close(self) -> None:
        self._keep("close")


@dataclass(eq=False)
class HostRow:
    key: str
    generation: Generation
    cancelled: threading.Event
    sent: int
    """Generated ids already sent to the worker."""
    stream: RowStream | None = None


@dataclass(eq=False)
class HostModel:
    model: LoadedModel
    settings: dict[str, Any] | None = None
    engine: Engine | None = None
    engines: int = 0
    drain_deadline: float | None = None
    observers: list[RecordingObserver] = field(default_factory=list)


class Host:
    def __init__(self, conn: Connection) -> None:
        self.conn = conn
        self.models: dict[str, HostModel] = {}
        self.rows: dict[int, HostRow] = {}
        # Appended to by the model threads, emptied by the sender; a deque's append and popleft are atomic.
        self.observed: deque[Observation] = deque()
        self._changed = threading.Condition()
        self._marked: dict[int, None] = {}
        self._replies: list[tuple[Any, ...]] = []
        self._setup = ThreadPoolExecutor(SETUP_THREADS, thread_name_prefix="lmsp-engine-setup")
        self._sender = threading.Thread(target=self._send_loop, name="lmsp-engine-sender", daemon=True)

    # -- the reader (the main thread) -----------------------------------------

    def serve(self) -> None:
        self._sender.start()
        self._reply_raw((HELLO, os.getpid()))
        handlers: dict[str, Callable[..., None]] = {
            LOAD: lambda *a: self._setup.submit(self._answer, a[0], self._load, *a[1:]),
            OPEN: lambda *a: self._setup.submit(self._answer, a[0], self._open, *a[1:]),
            ENGINE: self._engine_settings,
            SUBMIT: self._submit,
            STOP: self._stop,
            CANCEL: self._cancel,
            DRAIN: self._drain,
            UNLOAD: lambda key: self._setup.submit(self._unload, key),
        }
        while True:
            try:
                message = self.conn.recv()
            except (EOFError, OSError):
                return  # the worker is gone: so is the reason to run
            handlers[message[0]](*message[1:])

    def _answer(self, request: int, action: Callable[..., Any], *args: Any) -> None:
        try:
            value, error = action(*args), None
        except RuntimeFailure as exc:
            value, error = None, exc
        except Exception as exc:  # a bug: the worker's call must end, with what it was
            log.exception("engine process: %s failed", getattr(action, "__name__", action))
            value, error = None, GenerationError(f"the engine process failed: {exc}")
        self._reply_raw((REPLY, request, value, error))

    def _load(self, key: str, backend: str, folder: str, load_kwargs: dict[str, Any]) -> ModelInfo:
        model = get_backend(backend).load(Path(folder), **load_kwargs)
        self.models[key] = HostModel(model)
        return ModelInfo(
            provider=model.provider,
            resumable=model.resumable,
            context_length=model.context_length,
            vocab_size=int(getattr(model, "vocab_size", 0)),
            prompt_configs=getattr(model, "prompt_configs", None),
        )

    def _unload(self, key: str) -> None:
        hosted = self.models.pop(key, None)
        if hosted is not None:
            hosted.model.close()

    def _engine_settings(self, key: str, settings: dict[str, Any]) -> None:
        hosted = self.models.get(key)
        if hosted is not None and hosted.settings is None:
            hosted.settings = settings

    def _open(
        self,
        row: int,
        key: str,
        prompt_ids: list[int] | None,
        snapshot: Mapping[str, Any] | None,
        params: SamplingParams,
    ) -> Opened:
        hosted = self.models.get(key)
        if hosted is None:
            raise GenerationError(f"model {key!r} is not loaded in the engine process")
        cancelled = threading.Event()
        # The fault that slows every model call (tasks_app.faults) is armed here, where the calls are.
        should_stop = faults.slowed(cancelled.is_set)
        if snapshot is not None:
            generation = hosted.model.resume(snapshot, params, should_stop=should_stop)
        else:
            assert prompt_ids is not None
            generation = hosted.model.generate(prompt_ids, params, should_stop=should_stop)
        self.rows[row] = HostRow(key, generation, cancelled, sent=generation.output_tokens)
        _, state = generation.snapshot_since(generation.output_tokens, with_prompt=False)
        return Opened(
            seed=generation.seed,
            prompt_tokens=generation.prompt_tokens,
            generated_ids=list(generation.generated_ids),
            state=state,
            finish_reason=generation.finish_reason,
            stop_sequence=generation.stop_sequence,
        )

    def _engine_of(self, hosted: HostModel, key: str) -> Engine:
        settings = dict(hosted.settings or {})
        serial = hosted.engines + 1

        def observer() -> EngineObserver:
            recording = RecordingObserver(self, key, serial)
            hosted.engines = serial
            return recording

        engine = hosted.model.engine(**settings, observer=observer)
        if engine is not hosted.engine:
            hosted.engine = engine
            if hosted.drain_deadline is not None:
                engine.drain(grace_seconds=max(0.0, hosted.drain_deadline - time.monotonic()))
        return engine

    def _submit(self, row: int) -> None:
        held = self.rows.get(row)
        if held is None:
            return
        hosted = self.models.get(held.key)
        if hosted is None:
            self._fail(row, held, GenerationError(f"model {held.key!r} was unloaded"))
            return
        try:
            engine = self._engine_of(hosted, held.key)
            stream = engine.submit(held.generation)
        except RuntimeFailure as exc:
            self._fail(row, held, exc)
            return
        assert isinstance(stream, RowStream)
        held.stream = stream
        stream.notify(lambda: self._mark(row))

    def _fail(self, row: int, held: HostRow, error: RuntimeFailure) -> None:
        held.stream = RowStream(held.generation, wake=lambda: None)
        held.stream.notify(lambda: self._mark(row))
        held.stream.put(Chunk.failed(error))

    def _stop(self, row: int) -> None:
        held = self.rows.get(row)
        if held is None:
            return
        if held.stream is None:
            self.rows.pop(row, None)  # never submitted: nothing runs
        else:
            held.stream.stop()

    def _cancel(self, row: int) -> None:
        held = self.rows.get(row)
        if held is not None:
            # Seen by the row's ``should_stop`` before its next model call: it ends ``cancelled``.
            held.cancelled.set()

    def _drain(self, key: str, grace_seconds: float) -> None:
        hosted = self.models.get(key)
        if hosted is None:
            return
        deadline = time.monotonic() + max(0.0, grace_seconds)
        if hosted.drain_deadline is None or deadline < hosted.drain_deadline:
            hosted.drain_deadline = deadline
        if hosted.engine is not None:
            hosted.engine.drain(grace_seconds=grace_seconds)

    # -- the sender -----------------------------------------------------------

    def _mark(self, row: int) -> None:
        """A chunk came for ``row`` (on a model thread: only mark it)."""
        with self._changed:
            self._marked[row] = None
            self._changed.notify()

    def _reply_raw(self, message: tuple[Any, ...]) -> None:
        with self._changed:
            self._replies.append(message)
            self._changed.notify()

    def _send_loop(self) -> None:
        while True:
            with self._changed:
                self._changed.wait_for(lambda: self._marked or self._replies, TICK_SECONDS)
                marked, self._marked = list(self._marked), {}
                replies, self._replies = self._replies, []
            observed = [self.observed.popleft() for _ in range(len(self.observed))]
            news = [item for item in map(self._news, marked) if item is not None]
            waiting = {key: hosted.engine.waiting for key, hosted in list(self.models.items()) if hosted.engine}
            try:
                for reply in replies:
                    self.conn.send(reply)
                self.conn.send((BATCH, news, observed, waiting))
            except (OSError, ValueError):
                return  # the worker is gone; the reader sees it too and ends the process

    def _news(self, row: int) -> RowNews | None:
        held = self.rows.get(row)
        if held is None or held.stream is None:
            return None
        chunk = held.stream.take()
        if chunk is None:
            return None
        generation = held.generation
        new_ids = generation.generated_ids[held.sent : chunk.output_tokens]
        held.sent = max(held.sent, chunk.output_tokens)
        if chunk.final:
            self.rows.pop(row, None)
        if chunk.error is not None and not isinstance(chunk.error, RuntimeFailure):
            chunk = Chunk.failed(GenerationError(str(chunk.error)))
        return RowNews(
            row,
            chunk,
            list(new_ids),
            generation.finish_reason if chunk.final else None,
            generation.stop_sequence if chunk.final else None,
            generation.cached_tokens,
        )


def main(argv: list[str]) -> None:
    logging.basicConfig(
        level=os.environ.get("LMSP_ENGINE_LOG_LEVEL", "INFO"),
        format="[%(asctime)s: %(levelname)s/engine %(process)d] %(name)s: %(message)s",
        stream=sys.stderr,
    )
    sys.setswitchinterval(SWITCH_INTERVAL_SECONDS)
    # A stop is the worker's to decide: a SIGTERM or Ctrl-C sent to its whole process group (honcho, a
    # terminal, systemd) must let it drain its rows here first; the pipe's end then ends this process.
    for name in ("SIGTERM", "SIGINT", "SIGHUP"):
        signal.signal(getattr(signal, name), signal.SIG_IGN)
    conn = Connection(int(argv[0]))
    Host(conn).serve()
    # Daemon threads (model threads mid-call) must not hold the exit up; the worker has let go of every row.
    logging.shutdown()
    os._exit(0)


if __name__ == "__main__":
    main(sys.argv[1:])
