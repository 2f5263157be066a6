"""The worker's side of its engine process: start it, talk to it, watch it, and replace it once lost.

A worker process has one engine process (:func:`engine_process`), started
with the first model it loads. What the worker holds of it implements the
runtime interface (``workers.backends.base``), so ``workers.execution`` and
the run loop use it as they used the in-process engine:

- :class:`RemoteModel` (a ``LoadedModel``): renders and tokenises prompts
  here, with the model folder's tokenizer and template (``PromptText``, no
  session); sets generations up there.
- :class:`RemoteEngine` (an ``Engine``): submits rows, drains, and knows how
  many rows wait for room.
- :class:`RemoteGeneration` (a ``Generation``): the worker's copy of a row's
  ids and snapshot state, brought up to date by each chunk before the chunk
  is put on the row's stream, so a run reads them as it read the engine's.

One thread (:meth:`EngineProcess._receive`) reads the engine process's
messages: replies, batches of chunks, and the observations it replays on
the worker's metrics. It also forwards cancels: after each batch it asks
every row's ``should_stop`` (the cancel watcher's flag) and tells the
engine process of a new one.

**A lost engine process loses no task.** Killed (``-9``, the out-of-memory
killer) or exited, its pipe ends at once; frozen, it says nothing for
``LMSP_ENGINE_SILENCE_SECONDS`` (it speaks at least every
``TICK_SECONDS``), and is killed. Either way every row it held ends
*interrupted*, with the reason, so its task is handed back by its
``on_restart`` policy from the last snapshot the worker committed (a
``resume`` row goes on exactly, here or on another worker), and the next
model lease starts a new engine process.
"""

from __future__ import annotations

import itertools
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path
from typing import TYPE_CHECKING, Any

from workers.backends.base import (
    Chunk,
    EngineObserver,
    Generation,
    Prompt,
    SamplingParams,
    StopCheck,
    ToolPrompt,
)
from workers.backends.errors import GenerationError, ModelLoadError, RuntimeFailure
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
    UNLOAD,
    ModelInfo,
    Observation,
    Opened,
    RowNews,
)

if TYPE_CHECKING:
    from workers.backends.onnx.prompt_text import PromptText

logger = logging.getLogger(__name__)

REPO = Path(__file__).resolve().parent.parent.parent
# How often the watch looks at the clock while the engine process is quiet.
WATCH_SLICE_SECONDS = 0.25
# A look that came this much later than its slice means the worker itself was not running meanwhile.
SELF_STALL_SECONDS = 2.0


class EngineProcessLost(GenerationError):
    """Raised for a call to an engine process that died or froze before it answered."""


@dataclass(eq=False)
class _Pending:
    done: threading.Event = field(default_factory=threading.Event)
    value: Any = None
    error: BaseException | None = None


@dataclass(eq=False)
class _Row:
    generation: RemoteGeneration
    should_stop: StopCheck
    stream: RowStream | None = None
    cancel_sent: bool = False


class EngineProcess:
    """One engine process and the worker's watch over it; see the module docstring."""

    def __init__(self, *, silence_seconds: float, start_seconds: float) -> None:
        self.silence_seconds = silence_seconds
        self.start_seconds = start_seconds
        ours, theirs = socket.socketpair()
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
        self.process = subprocess.Popen(
            [sys.executable, "-m", "workers.engine_process.host", str(theirs.fileno())],
            pass_fds=(theirs.fileno(),),
            cwd=REPO,
            env=env,
        )
        theirs.close()
        self.pid = self.process.pid
        self.owner = os.getpid()
        """The worker process that started it (a forked child starts its own)."""
        self.conn = Connection(ours.detach())
        self.lost: str | None = None
        """Why the process is gone (None while it runs)."""
        self.waiting: dict[str, int] = {}
        self._loads = 0
        self._lock = threading.Lock()
        self._send_lock = threading.Lock()
        self._ids = itertools.count(1)
        self._requests: dict[int, _Pending] = {}
        self._rows: dict[int, _Row] = {}
        self._observers: dict[str, Callable[[], EngineObserver] | None] = {}
        self._metrics: dict[tuple[str, int], EngineObserver] = {}
        self._thread = threading.Thread(target=self._receive, name="lmsp-engine-client", daemon=True)
        self._thread.start()
        logger.info("engine process %d started", self.pid)

    # -- calls ----------------------------------------------------------------

    def new_id(self) -> int:
        return next(self._ids)

    def send(self, message: tuple[Any, ...]) -> None:
        """Send at once; a process that is gone is the receiver's to notice (the call is then moot)."""
        try:
            with self._send_lock:
                self.conn.send(message)
        except (OSError, ValueError):
            pass

    def call(self, kind: str, *args: Any) -> Any:
        """A request the engine process answers; raises what it raised, or ``EngineProcessLost``."""
        request, pending = self.new_id(), _Pending()
        with self._lock:
            if self.lost is not None:
                raise EngineProcessLost(self.lost)
            self._requests[request] = pending
        self.send((kind, request, *args))
        pending.done.wait()
        if pending.error is not None:
            raise pending.error
        return pending.value

    def load(self, key: str, backend: str, folder: Path, load_kwargs: dict[str, Any]) -> ModelInfo:
        """Load a model folder there as ``key``."""
        with self._lock:
            self._loads += 1
        try:
            return self.call(LOAD, key, backend, str(folder), load_kwargs)
        finally:
            with self._lock:
                self._loads -= 1

    def expect(self, row: int, generation: RemoteGeneration, should_stop: StopCheck) -> None:
        with self._lock:
            self._rows[row] = _Row(generation, should_stop)

    def attach(self, row: int, stream: RowStream) -> bool:
        """Give ``row`` its stream; False (the stream already ended interrupted) if the process is gone."""
        with self._lock:
            held = self._rows.get(row)
            if held is not None and self.lost is None:
                held.stream = stream
                return True
            reason = self.lost or "the engine process lost the row"
        stream.put(Chunk.ending(output_tokens=stream.generation.output_tokens, interrupted=True, reason=reason))
        return False

    def observe(self, key: str, observer: Callable[[], EngineObserver] | None) -> None:
        """Replay ``key``'s engine observations on what ``observer`` makes (once per engine there)."""
        self._observers[key] = observer

    # -- the receiver ---------------------------------------------------------

    def _receive(self) -> None:
        silent, started = False, False
        last = looked = time.monotonic()
        try:
            while True:
                if not self.conn.poll(WATCH_SLICE_SECONDS):
                    now = time.monotonic()
                    if now - looked > SELF_STALL_SECONDS:
                        # This process itself did not run (stopped with its process group, or starved): the
                        # silence is not the engine process's to answer for.
                        last = now
                    looked = now
                    # A start and a model's load get the longer patience: an import or a session's creation may
                    # hold the process's GIL for seconds, and its sender with it.
                    limit = self.silence_seconds if started and not self._loads else self.start_seconds
                    if now - last > limit:
                        silent = True
                        break
                    continue
                message = self.conn.recv()
                last = looked = time.monotonic()
                started = True
                if message[0] == BATCH:
                    self._batch(*message[1:])
                elif message[0] == REPLY:
                    self._reply(*message[1:])
                elif message[0] != HELLO:
                    logger.warning("engine process %d: unknown message %r", self.pid, message[0])
        except (EOFError, OSError):
            pass
        except Exception:
            logger.exception("engine process %d: a message could not be read", self.pid)
        self._lose(silent=silent, waited=time.monotonic() - last)

    def _reply(self, request: int, value: Any, error: BaseException | None) -> None:
        with self._lock:
            pending = self._requests.pop(request, None)
        if pending is not None:
            pending.value, pending.error = value, error
            pending.done.set()

    def _batch(self, news: list[RowNews], observed: list[Observation], waiting: dict[str, int]) -> None:
        self.waiting = waiting
        for item in news:
            held = self._rows.get(item.row)
            if held is None or held.stream is None:
                continue
            held.generation.took(item)
            if item.chunk.final:
                with self._lock:
                    self._rows.pop(item.row, None)
            held.stream.put(item.chunk)
        for observation in observed:
            self._metrics_of(observation.key, observation.engine).__getattribute__(observation.method)(
                **observation.kwargs
            )
        for row, held in list(self._rows.items()):
            if not held.cancel_sent and held.should_stop():
                held.cancel_sent = True
                self.send((CANCEL, row))

    def _metrics_of(self, key: str, engine: int) -> EngineObserver:
        metrics = self._metrics.get((key, engine))
        if metrics is None:
            make = self._observers.get(key)
            metrics = self._metrics[(key, engine)] = make() if make is not None else EngineObserver()
        return metrics

    def _lose(self, *, silent: bool, waited: float) -> None:
        if silent:
            how = f"stopped answering (nothing for {waited:.0f} s)"
        else:
            how = None
        if self.process.poll() is None:
            # Frozen, or its pipe broke while it runs: it must not hold the device (or a row) any longer.
            try:
                os.kill(self.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        code = self.process.wait()
        if how is None:
            how = f"was killed (signal {-code})" if code < 0 else f"exited with status {code}"
        reason = f"its worker's engine process {how}"
        logger.error("engine process %d %s; its rows are handed back by their on_restart policy", self.pid, how)
        with self._lock:
            self.lost = reason
            requests, self._requests = self._requests, {}
            rows, self._rows = self._rows, {}
        for pending in requests.values():
            pending.error = EngineProcessLost(reason)
            pending.done.set()
        for held in rows.values():
            if held.stream is not None:
                output_tokens = held.generation.output_tokens
                held.stream.put(Chunk.ending(output_tokens=output_tokens, interrupted=True, reason=reason))
        for metrics in self._metrics.values():
            metrics.close()
        self.conn.close()

    def stop(self) -> None:
        """End the process (a worker's exit): its pipe closes, and it ends itself."""
        self.conn.close()


class RemoteGeneration:
    """The worker's copy of a generation that runs in the engine process (a ``Generation``).

    Its ids and state follow the row's chunks (:meth:`took`, on the receiver
    thread, before the chunk is put on the stream); it is never iterated here.
    """

    def __init__(self, row: int, prompt_ids: list[int], opened: Opened) -> None:
        self.row = row
        self.seed = opened.seed
        self.prompt_ids = prompt_ids
        self.generated_ids: list[int] = list(opened.generated_ids)
        self.prompt_tokens = opened.prompt_tokens
        self.cached_tokens = 0
        self.finish_reason: str | None = opened.finish_reason
        self.stop_sequence: str | None = opened.stop_sequence
        self._state: Mapping[str, Any] = opened.state

    @property
    def output_tokens(self) -> int:
        return len(self.generated_ids)

    def took(self, news: RowNews) -> None:
        self.generated_ids.extend(news.new_ids)
        self.cached_tokens = news.cached_tokens
        if news.chunk.state is not None:
            self._state = news.chunk.state
        if news.chunk.final:
            self.finish_reason, self.stop_sequence = news.finish_reason, news.stop_sequence

    def snapshot_since(self, tokens: int, *, with_prompt: bool) -> tuple[list[int], dict[str, Any]]:
        state = dict(self._state)
        if with_prompt:
            state["prompt_ids"] = list(self.prompt_ids)
        return self.generated_ids[tokens:], state

    def __iter__(self) -> Any:
        raise TypeError("a remote generation runs in its engine process; read its chunks from its row stream")


class RemoteEngine:
    """A model's batch engine in the engine process (an ``Engine``)."""

    def __init__(self, model: RemoteModel) -> None:
        self.model = model

    def submit(self, generation: Generation) -> RowStream:
        assert isinstance(generation, RemoteGeneration)
        process, row = self.model.process, generation.row
        stream = RowStream(generation, wake=lambda: process.send((STOP, row)))
        if process.attach(row, stream):
            process.send((SUBMIT, row))
        return stream

    @property
    def waiting(self) -> int:
        return self.model.process.waiting.get(self.model.key, 0)

    def drain(self, *, grace_seconds: float) -> None:
        self.model.process.send((DRAIN, self.model.key, grace_seconds))


class RemoteModel:
    """A model loaded in the engine process (a ``LoadedModel``); its prompts are rendered here."""

    def __init__(self, process: EngineProcess, key: str, info: ModelInfo, prompt_text: PromptText) -> None:
        self.process = process
        self.key = key
        self.provider = info.provider
        self.resumable = info.resumable
        self.context_length = info.context_length
        self.vocab_size = info.vocab_size
        self.prompt_text = prompt_text
        self.chat_template_source = prompt_text.chat_template_source
        self._engine: RemoteEngine | None = None
        self._engine_lock = threading.Lock()

    @property
    def lost(self) -> bool:
        """Whether its engine process is gone (the model must be loaded again, in a new one)."""
        return self.process.lost is not None

    def prompt_ids(self, prompt: Prompt, *, tools: ToolPrompt | None = None) -> list[int]:
        return self.prompt_text.ids(prompt, tools=tools)

    def single_token_ids(self, texts: Sequence[str]) -> dict[str, int]:
        tokenizer = self.prompt_text.tokenizer
        found = {}
        for text in texts:
            token = tokenizer.token_to_id(text) if text else None
            if token is not None and (not self.vocab_size or token < self.vocab_size):
                found[text] = token
        return found

    def generate(self, prompt_ids: Sequence[int], params: SamplingParams, *, should_stop: StopCheck) -> Generation:
        return self._open(list(prompt_ids), None, params, should_stop)

    def resume(self, snapshot: Mapping[str, Any], params: SamplingParams, *, should_stop: StopCheck) -> Generation:
        return self._open(None, snapshot, params, should_stop)

    def _open(
        self,
        prompt_ids: list[int] | None,
        snapshot: Mapping[str, Any] | None,
        params: SamplingParams,
        should_stop: StopCheck,
    ) -> RemoteGeneration:
        row = self.process.new_id()
        opened: Opened = self.process.call(OPEN, row, self.key, prompt_ids, snapshot, params)
        prompt = prompt_ids if prompt_ids is not None else [int(i) for i in (snapshot or {}).get("prompt_ids", ())]
        generation = RemoteGeneration(row, prompt, opened)
        self.process.expect(row, generation, should_stop)
        return generation

    def engine(self, *, observer: Callable[[], EngineObserver] | None = None, **settings: Any) -> RemoteEngine:
        """This model's engine there (its settings are sent once; the engine starts with its first row)."""
        with self._engine_lock:
            if self._engine is None:
                self.process.observe(self.key, observer)
                self.process.send((ENGINE, self.key, settings))
                self._engine = RemoteEngine(self)
            return self._engine

    def close(self) -> None:
        if self.process.lost is None:
            self.process.send((UNLOAD, self.key))


_process: EngineProcess | None = None
_process_lock = threading.Lock()


def engine_process(*, silence_seconds: float, start_seconds: float) -> EngineProcess:
    """This worker's engine process: the running one, or a new one if there is none or it was lost."""
    global _process
    with _process_lock:
        if _process is None or _process.lost is not None or _process.owner != os.getpid():
            _process = EngineProcess(silence_seconds=silence_seconds, start_seconds=start_seconds)
        return _process


def model_load(
    backend: str, folder: Path, *, silence_seconds: float, start_seconds: float, **load_kwargs: Any
) -> RemoteModel:
    """Load ``folder`` in this worker's engine process; raises ``ModelLoadError`` as a load here would."""
    process = engine_process(silence_seconds=silence_seconds, start_seconds=start_seconds)
    key = f"{folder.name}#{process.new_id()}"
    try:
        info = process.load(key, backend, folder, load_kwargs)
    except EngineProcessLost as exc:
        raise ModelLoadError(f"model {folder.name!r} could not be loaded: {exc}") from None
    # Here, not at the top: a worker that never loads a model never imports tokenizers (decision 0003).
    from workers.backends.onnx.prompt_text import PromptText

    try:
        configs = info.prompt_configs
        prompt_text = PromptText(folder, **configs) if configs is not None else PromptText.of_folder(folder)
    except RuntimeFailure:
        process.send((UNLOAD, key))
        raise
    return RemoteModel(process, key, info, prompt_text)
