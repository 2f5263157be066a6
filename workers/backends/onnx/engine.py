"""The batch engine: up to ``max_batch`` generations of one model stepping together in one session.

One model thread per engine runs every session call; task threads submit a
generation and the worker's run loop reads its :class:`Chunk` s from a
:class:`RowStream` (told by :meth:`RowStream.notify` when one is ready). The
model thread never waits on the database, Redis or the network: it only
computes, samples, and hands chunks over a queue.

Each iteration of the model thread:

1. admits waiting rows in order, while the batch has room and the KV budget
   (a bound on the padded cache: rows x longest reserved length) allows;
2. runs one decode step for the rows decoding (one call per group of rows
   of similar width; one per row where the graph must not batch, below);
3. runs one prefill call for the first joining row: its whole prompt (or
   ``prefill_chunk``) when nothing decodes, else a slice sized to take
   ``prefill_share`` decode steps, so running rows never stall for a whole prompt.

A joining row is prefilled alone, in a batch of one row, exactly as a
generation runs alone; once it has its first token it merges into a
decoding group (its cache padded to the group's width, on the device), the
one it pads least, or starts a group of its own when padding would cost the
group more than running apart: a step costs about rows x width, and a
2,000-token row merged among 300-token rows made their steps 8x dearer. A
finished, cancelled or stopped row leaves between steps and its cache rows
are dropped.

Rows of a graph whose result depends on its batch never share a call:
graphs that quantize activations per call (one scale over all rows' tokens)
and graphs without ``position_ids`` that are not right-aligned by
GroupQueryAttention (they would place padded rows at the wrong positions).
Their rows still interleave in the one thread, and their prompts are split
exactly as alone (``prefill_chunk``), so their tokens stay the exporting
tool's.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, Any

import numpy as np

from workers.backends.base import Chunk, EngineObserver, Step
from workers.backends.constraints import MaskPlanner
from workers.backends.errors import GenerationError
from workers.backends.onnx.kv_batch import CacheOps, KVBatch
from workers.backends.onnx.kv_decoder import prompt_calls
from workers.backends.onnx.prefix_cache import PrefixCache
from workers.backends.onnx.session import cuda_free_bytes
from workers.backends.onnx.step_picks import StepLogits
from workers.backends.sampling import SamplingPool

if TYPE_CHECKING:
    from workers.backends.onnx.generation import OnnxGeneration
    from workers.backends.onnx.model import OnnxModel

log = logging.getLogger(__name__)

# A prefill slice beside running rows aims at ``prefill_share`` decode steps' time (LMSP_PREFILL_SHARE;
# 3 measured best on a CPU, docs/workers.md), and takes at least _MIN_SLICE ids: on a model whose
# one-token call costs about a step (weights read once per call), smaller slices would barely move the
# prompt on while doubling the rows' gaps anyway.
DEFAULT_PREFILL_SHARE = 3.0
_MIN_SLICE = 16
# A joining row shares a group's calls while the padded group costs at most this much more
# (rows x width) than the two apart.
_MERGE_SLACK = 1.3


class RowStream:
    """What a task thread holds of its row: iterate it for chunks; :meth:`stop` ends the row."""

    def __init__(self, engine: BatchEngine, generation: OnnxGeneration) -> None:
        self.generation = generation
        self._engine = engine
        self._queue: queue.SimpleQueue[Chunk] = queue.SimpleQueue()
        self._arrived = threading.Event()
        self.stopped = threading.Event()
        self._notify: Callable[[], None] | None = None

    def stop(self) -> None:
        """End the row before its next model call (a lost compare-and-set, a task thread leaving)."""
        self.stopped.set()
        self._engine.wake()

    def put(self, chunk: Chunk) -> None:
        self._queue.put(chunk)
        if not self._arrived.is_set():  # the first chunk only: set() takes a lock and wakes every waiter
            self._arrived.set()
        notify = self._notify
        if notify is not None:
            notify()

    def notify(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` (on the model thread: it must only hand over) whenever a chunk comes."""
        self._notify = callback
        if not self._queue.empty():
            callback()

    def take(self) -> Chunk | None:
        """What came since the last read, as one chunk (an error chunk as it is), or None: never waits."""
        try:
            chunk = self._queue.get_nowait()
        except queue.Empty:
            return None
        while not chunk.final:
            try:
                chunk = chunk.then(self._queue.get_nowait())
            except queue.Empty:
                break
        return chunk

    def ready(self, timeout: float) -> bool:
        """Whether a chunk has come, waiting at most ``timeout`` seconds for the first."""
        return self._arrived.wait(timeout)

    def __iter__(self) -> Iterator[Chunk]:
        """Chunks as they come; what queued meanwhile is merged, so a slow reader commits fewer, larger batches."""
        while True:
            chunk = self._queue.get()
            while not chunk.final:
                try:
                    chunk = chunk.then(self._queue.get_nowait())
                except queue.Empty:
                    break
            if chunk.error is not None:
                raise chunk.error
            yield chunk
            if chunk.final:
                return


@dataclass(eq=False)
class _Group:
    """Decoding rows that share one cache tensor per layer, and so one session call per step."""

    batch: KVBatch
    rows: list[_Row]


@dataclass(eq=False)
class _Row:
    stream: RowStream
    generation: OnnxGeneration
    length_cap: int
    """The most positions this row's cache can reach (prompt + max output)."""
    submitted: float
    batch: KVBatch | None = None
    calls: deque[list[int]] = field(default_factory=deque)
    """Prefill: the ids still to feed, one list per feed (sliced into calls as they run)."""
    steps: list[Step] = field(default_factory=list)
    tokens: int = 0
    since: float = 0.0
    first_at: float = 0.0
    last_at: float = 0.0
    emitted: bool = False
    first_feed: list[int] | None = None
    """The first feed's ids, from the start of its prefill until they are offered to the prefix cache."""
    shared: bool = False
    """Whether the row ever shared a decode call: on a graph that pads rows apart, its cache then
    differs from its alone's in the last bits, and is not offered to the prefix cache."""


class BatchEngine:
    """One model's rows in one model thread; see the module docstring."""

    def __init__(
        self,
        model: OnnxModel,
        *,
        max_batch: int,
        kv_budget_bytes: int,
        delta_tokens: int,
        delta_seconds: float,
        observer: EngineObserver | None = None,
        sampling_threads: int = 1,
        prefill_share: float = DEFAULT_PREFILL_SHARE,
        device_picks: bool = False,
        prefix_cache: bool = True,
    ) -> None:
        self.model = model
        # Greedy rows picked where the logits lie, only the others' rows copied (step_picks.py).
        self.device_picks = device_picks
        if device_picks:
            model.open_step_picks()
        self.prefill_share = prefill_share
        self.max_batch = max(1, max_batch)
        self.kv_budget = kv_budget_bytes
        self.delta_tokens = max(1, delta_tokens)
        self.delta_seconds = delta_seconds
        self.observer = observer or EngineObserver()
        self.batched = model.batchable
        self.exact_splits = model.quantizes_per_call or model.graph.float16
        self.ops = CacheOps(model)
        self.bytes_per_position = model.kv_bytes_per_position
        # Prompts' (and answers') caches for later rows that start with the same ids (prefix_cache.py):
        # under the KV budget, so only with one; never on a graph that quantizes per call.
        self.prefix_cache = (
            PrefixCache(
                ops=self.ops,
                bytes_per_position=self.bytes_per_position,
                block=model.prefill_chunk if self.exact_splits else 1,
            )
            if prefix_cache and kv_budget_bytes and not model.quantizes_per_call
            else None
        )
        self._lock = threading.Condition()
        self._waiting: deque[_Row] = deque()
        self._joining: deque[_Row] = deque()
        # Batchable graphs: rows of similar widths share a group. Others: each row its own.
        self._groups: list[_Group] = []
        self._closed = False
        self._broken: GenerationError | None = None
        self._drain_deadline: float | None = None
        self._step_seconds = 0.0
        self._slice = 16
        self._masks: MaskPlanner | None = None
        self._logits_width = 0
        self._sampling = SamplingPool(threads=sampling_threads)
        self._thread = threading.Thread(target=self._loop, name=f"lmsp-engine-{model.name}", daemon=True)
        self._thread.start()

    # -- task threads ---------------------------------------------------------

    def submit(self, generation: OnnxGeneration) -> RowStream:
        """Queue a generation (fresh or resumed); its chunks come from the returned stream."""
        stream = RowStream(self, generation)
        length_cap = min(self.model.context_length, generation.prompt_tokens + generation.max_output_tokens)
        row = _Row(stream=stream, generation=generation, length_cap=length_cap, submitted=time.monotonic())
        need = length_cap * self.bytes_per_position
        if self.kv_budget and need > self.kv_budget:
            error = GenerationError(
                f"this request can need {need / 2**20:.1f} MiB of KV cache ({length_cap} positions of model "
                f"{self.model.name!r}), more than the worker's whole budget of {self.kv_budget / 2**20:.1f} MiB "
                "(LMSP_KV_CACHE_BYTES); ask for fewer max_output_tokens or raise the budget"
            )
            stream.put(Chunk.failed(error))
            return stream
        with self._lock:
            if self._broken is not None:
                stream.put(Chunk.failed(self._broken))
                return stream
            if self._closed or self._drain_deadline is not None:
                stream.put(Chunk.ending(output_tokens=generation.output_tokens, interrupted=True))
                return stream
            self._waiting.append(row)
            self._lock.notify()
        return stream

    @property
    def waiting(self) -> int:
        """Rows submitted but not admitted yet (the batch is full, or the KV budget spent)."""
        return len(self._waiting)

    def wake(self) -> None:
        with self._lock:
            self._lock.notify()

    def drain(self, *, grace_seconds: float) -> None:
        """Take no new rows; rows still running after ``grace_seconds`` end as interrupted.

        A later call can only bring the deadline nearer (a cold shutdown after a warm one).
        """
        deadline = time.monotonic() + max(0.0, grace_seconds)
        with self._lock:
            if self._drain_deadline is None or deadline < self._drain_deadline:
                self._drain_deadline = deadline
            self._lock.notify()

    def close(self) -> None:
        """Stop the model thread; rows still in it end with an error."""
        with self._lock:
            self._closed = True
            self._lock.notify()
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout=30)

    @property
    def _decoding(self) -> list[_Row]:
        return [row for group in self._groups for row in group.rows]

    def snapshot(self) -> dict[str, Any]:
        """Rows and cache now, for logs and the CUDA proof."""
        with self._lock:
            waiting, joining = len(self._waiting), len(self._joining)
        groups = list(self._groups)
        return {
            "waiting": waiting,
            "joining": joining,
            "decoding": sum(len(group.rows) for group in groups),
            "groups": len(groups),
            "batched": self.batched,
            "cache_bytes": sum(group.batch.device_bytes() for group in groups),
            "cache_on_device": all(group.batch.on_device() for group in groups) if groups else None,
            "cache_width": max((group.batch.width for group in groups), default=0),
            "prefix_cache_bytes": self.prefix_cache.bytes if self.prefix_cache is not None else 0,
        }

    # -- the model thread -----------------------------------------------------

    @property
    def running(self) -> bool:
        """Whether the model thread still takes rows (False once closed or broken)."""
        return self._thread.is_alive() and not self._closed

    def _loop(self) -> None:
        try:
            while self._iterate():
                pass
        except BaseException as exc:  # a bug here must not leave task threads waiting forever
            log.exception("batch engine of %s stopped", self.model.name)
            error = GenerationError(f"the batch engine of {self.model.name!r} failed: {exc}")
            with self._lock:
                # Rows submitted from now on fail at once; the model starts a new engine for the next ones.
                self._closed, self._broken = True, error
            self._fail_all(error)
        finally:
            if self._masks is not None:
                self._masks.close()
            if self.prefix_cache is not None:
                self.prefix_cache.clear()
            self._sampling.close()
            self.observer.close()

    def _iterate(self) -> bool:
        with self._lock:
            while True:
                if self._closed:
                    break
                # Rows leaving admit the next ones themselves (_leave); here only new submissions wait.
                if self._waiting:
                    self._admit()
                if self._groups or self._joining:
                    break
                self._lock.wait()
            closed, deadline = self._closed, self._drain_deadline
        if closed:
            self._fail_all(GenerationError(f"model {self.model.name!r} was unloaded"))
            return False
        if deadline is not None and time.monotonic() >= deadline:
            self._interrupt_all()
        self._decode_step(time.monotonic())
        self._prefill_call()
        return True

    def _reserved(self, rows: list[_Row]) -> int:
        """The bound on the padded cache these rows can reach: rows x the longest, per position."""
        if not rows:
            return 0
        return len(rows) * max(row.length_cap for row in rows) * self.bytes_per_position

    def _admit(self) -> None:
        """Admit waiting rows in order while they fit; called with the lock held."""
        active = [*self._decoding, *self._joining]
        while self._waiting and len(active) < self.max_batch:
            row = self._waiting[0]
            if self.kv_budget:
                need = self._reserved([*active, row])
                if active and need > self.kv_budget:
                    break
                # The cached prefixes give way to a row: least recently used first, as much as it needs.
                self._evict(self.kv_budget - need)
            self._waiting.popleft()
            row.calls.extend(row.generation.feeds())
            self._joining.append(row)
            active.append(row)
            self.observer.queue_wait(time.monotonic() - row.submitted)
            row.emitted = False
            for step in row.generation.begin():
                self._add_step(row, step, time.monotonic())
            if row.generation.finish_reason is not None:
                self._joining.remove(row)
                active.remove(row)
                self._emit(row, final=True)
        self.observer.rows(running=len(active), waiting=len(self._waiting))
        self.observer.kv(in_use=self._reserved(active), budget=self.kv_budget)

    # -- decode ---------------------------------------------------------------

    def _decode_step(self, now: float) -> None:
        """One step of every decoding row: one session call per group."""
        if not self._groups:
            return
        started = time.perf_counter()
        stepped = 0
        for group in list(self._groups):
            stopping = [row for row in group.rows if row.stream.stopped.is_set() or row.generation.stop_requested()]
            if stopping:
                self._leave(group, stopping)
            if group.rows:
                stepped += self._step_group(group, now)
        if not stepped:
            return
        seconds = time.perf_counter() - started
        self._step_seconds = seconds if not self._step_seconds else 0.8 * self._step_seconds + 0.2 * seconds
        self.observer.step(rows=stepped, seconds=seconds)

    def _step_group(self, group: _Group, now: float) -> int:
        """One session call for ``group``'s rows, and their samples; the rows stepped."""
        rows = list(group.rows)
        ids = np.array([[row.generation.generated_ids[-1]] for row in rows], dtype=np.int64)
        # The constrained rows' masks are computed while the session runs (llguidance drops the GIL).
        constrained = [row.generation.constraint for row in rows if row.generation.constraint is not None]
        masks = None
        if constrained:
            self._masks = self._masks or MaskPlanner()
            masks = self._masks.start(constrained)
        # The logits' width is learned from the engine's first step, which comes to the host whole.
        width = self._logits_width
        gathers = self._device_gathers(rows, width) if self.device_picks and width else {}
        full = [index for index in range(len(rows)) if index not in gathers]
        step: StepLogits | None = None
        try:
            if gathers:
                step = self._feed_with_picks(group.batch, ids, len(rows), gathers, full)
                logits = step.rows
            else:
                logits = group.batch.feed(ids, want_logits=True)
        except GenerationError as exc:
            MaskPlanner.wait(masks)
            for row in rows:
                row.stream.put(Chunk.failed(exc))
            self._groups.remove(group)
            self._readmit()
            return 0
        assert logits is not None
        self._logits_width = logits.shape[-1]
        if masks is not None:
            self.observer.masks(rows=len(constrained), seconds=MaskPlanner.wait(masks))
        hosted = [rows[index] for index in full]
        sampled = self._sampling.run(
            [partial(row.generation.pick, row_logits) for row, row_logits in zip(hosted, logits, strict=True)],
            width=logits.shape[-1],
            sampled=[not row.generation.sampler.greedy for row in hosted],
        )
        picks = sampled if step is None else self._merged_picks(group.batch, rows, step, gathers, full, sampled)
        done = [row for row, pick in zip(rows, picks, strict=True) if not self._take(row, pick, now)]
        if done:
            self._leave(group, done, emitted=True)
        return len(rows)

    @staticmethod
    def _feed_with_picks(
        batch: KVBatch, ids: np.ndarray, rows: int, gathers: dict[int, np.ndarray], full: list[int]
    ) -> StepLogits:
        """The step's call with the picks graph: each device row's highest scores, enough that one at
        least is not penalised, and its penalised ids' scores; the ``full`` rows whole."""
        k = max(len(penalised) for penalised in gathers.values()) + 1
        gather = np.zeros((rows, k - 1), dtype=np.int64)
        for index, penalised in gathers.items():
            gather[index, : len(penalised)] = penalised
        return batch.feed_step(ids, full_rows=np.array(full, dtype=np.int64), k=k, gather=gather)

    @staticmethod
    def _merged_picks(
        batch: KVBatch,
        rows: list[_Row],
        step: StepLogits,
        gathers: dict[int, np.ndarray],
        full: list[int],
        sampled: list[int | GenerationError],
    ) -> list[int | GenerationError]:
        """Every row's pick in order: the device rows' from their candidates, the others' from the pool."""
        width = step.width
        by_index: dict[int, int | GenerationError | None] = dict(zip(full, sampled, strict=True))
        for index, penalised in gathers.items():
            by_index[index] = _device_pick(rows[index].generation, step, index, penalised, width)
        again = [index for index, pick in by_index.items() if pick is None]
        if again:
            # The candidates could not tell (a tie past the list): those rows come whole after all.
            try:
                whole = list(zip(again, batch.step_rows(np.array(again, dtype=np.int64)), strict=True))
            except GenerationError as exc:
                whole, by_index = [], {**by_index, **dict.fromkeys(again, exc)}
            for index, row_logits in whole:
                try:
                    by_index[index] = rows[index].generation.pick(row_logits)
                except GenerationError as exc:
                    by_index[index] = exc
        picks: list[int | GenerationError] = []
        for index in range(len(rows)):
            pick = by_index[index]
            assert pick is not None
            picks.append(pick)
        return picks

    @staticmethod
    def _device_gathers(rows: list[_Row], width: int) -> dict[int, np.ndarray]:
        """The rows a step picks on the device (greedy, unconstrained), each with its penalised ids."""
        gathers = {}
        for index, row in enumerate(rows):
            if row.generation.picks_on_device:
                try:
                    gathers[index] = row.generation.sampler.penalised_ids(width)
                except GenerationError:
                    continue  # an id past the row: the host sampler says so, as it would alone
        return gathers

    def _accept(self, row: _Row, logits: np.ndarray, now: float) -> bool:
        """Sample ``row``'s next token; False when the row is over (its last chunk is out)."""
        try:
            pick: int | GenerationError = row.generation.pick(logits)
        except GenerationError as exc:
            pick = exc
        return self._take(row, pick, now)

    def _take(self, row: _Row, pick: int | GenerationError, now: float) -> bool:
        """Move ``row`` on by its picked token; False when the row is over (its last chunk is out)."""
        try:
            if isinstance(pick, GenerationError):
                raise pick
            steps = row.generation.take(pick)
        except GenerationError as exc:
            row.stream.put(Chunk.failed(exc))
            return False
        for step in steps:
            self._add_step(row, step, now)
        if row.generation.finish_reason is not None:
            self._emit(row, final=True)
            return False
        if not row.emitted or row.tokens >= self.delta_tokens or now - row.since >= self.delta_seconds:
            self._emit(row, final=False)
        return True

    def _add_step(self, row: _Row, step: Step, now: float) -> None:
        if not row.steps and not row.tokens:
            row.since = now
        row.steps.append(step)
        if step.token_id is not None:
            row.tokens += 1
            row.first_at = row.first_at or now
            row.last_at = now

    def _emit(self, row: _Row, *, final: bool, interrupted: bool = False) -> None:
        generation = row.generation
        row.stream.put(
            Chunk(
                steps=tuple(row.steps),
                tokens=row.tokens,
                output_tokens=generation.output_tokens,
                state=generation.snapshot_state(),
                final=final,
                interrupted=interrupted,
                first_at=row.first_at,
                last_at=row.last_at,
            )
        )
        row.steps, row.tokens, row.emitted = [], 0, True
        row.first_at = row.last_at = 0.0

    def _leave(self, group: _Group, rows: list[_Row], *, emitted: bool = False) -> None:
        """Drop ``rows`` from ``group``; those not yet told get their last chunk."""
        gone = set(map(id, rows))
        if not emitted:
            for row in rows:
                self._emit(row, final=True)
        self._remember_answers(group, rows)
        kept = [i for i, row in enumerate(group.rows) if id(row) not in gone]
        if kept:
            try:
                group.batch.keep(kept)
            except GenerationError as exc:
                for row in group.rows:
                    if id(row) not in gone:
                        row.stream.put(Chunk.failed(exc))
                kept = []
        group.rows = [group.rows[i] for i in kept]
        if not group.rows:
            self._groups.remove(group)
        self._readmit()

    def _readmit(self) -> None:
        """Rows left: admit waiting ones into the room, and report the new counts."""
        with self._lock:
            self._admit()

    # -- prefill --------------------------------------------------------------

    def _prefill_call(self) -> None:
        if not self._joining:
            return
        row = self._joining[0]
        if row.stream.stopped.is_set() or row.generation.stop_requested():
            self._joining.popleft()
            self._emit(row, final=True)
            self._readmit()
            return
        if row.batch is None:
            row.batch = self._start_batch(row)
        feed = row.calls[0]
        size = self._call_size(len(feed))
        ids, rest = feed[:size], feed[size:]
        last = not rest and len(row.calls) == 1
        started = time.perf_counter()
        try:
            logits = row.batch.feed(np.asarray([ids], dtype=np.int64), want_logits=last)
        except GenerationError as exc:
            self._joining.popleft()
            row.stream.put(Chunk.failed(exc))
            self._readmit()
            return
        self.observer.prefill(tokens=len(ids), seconds=time.perf_counter() - started)
        if rest:
            row.calls[0] = rest
        else:
            row.calls.popleft()
            if row.first_feed is not None:
                self._remember(row.first_feed, row.batch, index=0)
                row.first_feed = None
        if not last:
            self._resize_slice(len(ids), time.perf_counter() - started)
            return
        self._joining.popleft()
        assert logits is not None
        if not self._accept(row, logits[0], time.monotonic()):
            row.batch = None
            self._readmit()
            return
        self._join(row)

    # -- the prefix cache -----------------------------------------------------

    def _start_batch(self, row: _Row) -> KVBatch:
        """A joining row's cache: empty, or the longest cached prefix of its first feed (the rest to feed)."""
        batch = KVBatch(self.model, ops=self.ops)
        cache = self.prefix_cache
        if cache is None:
            return batch
        feed = row.calls[0]
        row.first_feed = list(feed)
        hit = cache.lookup(feed)
        self.observer.prefix_hit(tokens=hit.tokens if hit is not None else 0)
        if hit is not None:
            batch.start_from(hit.past, hit.tokens)
            row.calls[0] = feed[hit.tokens :]
            generation = row.generation
            generation.cached_tokens = min(hit.tokens, generation.prompt_tokens)
        return batch

    def _remember(self, ids: list[int], batch: KVBatch, *, index: int) -> None:
        """Offer row ``index`` of ``batch`` (whose cache holds exactly ``ids``) to the prefix cache, in the
        room the running rows leave it."""
        cache = self.prefix_cache
        assert cache is not None
        if int(batch.lengths[index]) != len(ids) or cache.covers(ids):
            return
        room = self.kv_budget - self._reserved([*self._decoding, *self._joining])
        if room < len(ids) * self.bytes_per_position:
            return
        try:
            past = batch.row_cache(index)
        except GenerationError:
            log.warning("the prefix cache of %s skipped a row it could not copy", self.model.name, exc_info=True)
            return
        cache.store(ids, past, room=room)
        self._cache_changed()

    def _remember_answers(self, group: _Group, rows: list[_Row]) -> None:
        """Rows leaving: offer each one's prompt and answer (what its cache holds) to the prefix cache.

        Only where that cache is the one the same ids fed alone would give: a graph whose numbers do
        not depend on the split (the answer was fed one id a call), and rows that never shared a call
        unless the graph keeps rows exact in a batch (GroupQueryAttention, right-aligned).
        """
        if self.prefix_cache is None or self.exact_splits:
            return
        for row in rows:
            if row.shared and not self.model.group_query_attention:
                continue
            index = next(i for i, member in enumerate(group.rows) if member is row)
            generation = row.generation
            fed = int(group.batch.lengths[index])
            self._remember([*generation.prompt_ids, *generation.generated_ids][:fed], group.batch, index=index)

    def _evict(self, room: int) -> None:
        if self.prefix_cache is not None and self.prefix_cache.bytes > room:
            self.prefix_cache.evict(room)
            self._cache_changed()

    def _cache_changed(self) -> None:
        cache = self.prefix_cache
        assert cache is not None
        self.observer.prefix_cache(cached_bytes=cache.bytes, evicted=cache.take_evicted())

    def _call_size(self, remaining: int) -> int:
        """How many ids of a feed the next call takes."""
        chunk = self.model.prefill_chunk
        whole = prompt_calls(remaining, chunk)[0]
        if self.exact_splits or not self._groups:
            return whole
        return max(1, min(whole, self._slice))

    def _resize_slice(self, tokens: int, seconds: float) -> None:
        """Aim the next slice at ``prefill_share`` decode steps of the running rows."""
        if not self._groups or not self._step_seconds or seconds <= 0:
            return
        target = tokens * self.prefill_share * self._step_seconds / seconds
        self._slice = int(max(_MIN_SLICE, min(self.model.prefill_chunk, 0.5 * self._slice + 0.5 * target)))

    def _join(self, row: _Row) -> None:
        """A prefilled row starts decoding: into the group it pads least (on the device), or a group of its own.

        A step costs about rows x width of the cache, so a row far longer (or
        shorter) than a group's rows would make every one of them pay for its
        width, on every step until one leaves: it joins only where the padded
        group costs at most ``_MERGE_SLACK`` more than the two apart.
        """
        batch, row.batch = row.batch, None
        assert batch is not None
        best: _Group | None = None
        if self.batched:
            width = batch.width
            best_cost = float("inf")
            for group in self._groups:
                apart = len(group.rows) * group.batch.width + width
                together = (len(group.rows) + 1) * max(group.batch.width, width)
                if together <= _MERGE_SLACK * apart and together < best_cost:
                    best, best_cost = group, together
        if best is None:
            self._groups.append(_Group(batch=batch, rows=[row]))
            return
        try:
            best.batch.merge(batch)
        except GenerationError as exc:
            row.stream.put(Chunk.failed(exc))
            return
        best.rows.append(row)
        for member in best.rows:
            member.shared = True

    # -- ends -----------------------------------------------------------------

    def _take_all(self) -> list[_Row]:
        """Every row out of the engine (waiting, joining, decoding), its cache dropped."""
        with self._lock:
            rows = [*self._waiting, *self._joining, *self._decoding]
            self._waiting.clear()
        self._joining.clear()
        self._groups.clear()
        return rows

    def _interrupt_all(self) -> None:
        """The drain ran out: every row ends where it is, its task handed back by its policy."""
        for row in self._take_all():
            self._emit(row, final=True, interrupted=True)

    def _fail_all(self, error: GenerationError) -> None:
        for row in self._take_all():
            row.stream.put(Chunk.failed(error))


def _device_pick(
    generation: OnnxGeneration, step: StepLogits, index: int, penalised: np.ndarray, width: int
) -> int | GenerationError | None:
    """A greedy row's pick from what the device sent (None: the row must come whole), or its error, as
    ``SamplingPool.run`` gives them."""
    sampler = generation.sampler
    try:
        if not len(penalised):
            return sampler.best(int(step.best[index]), finite=bool(step.finite[index]))
        return sampler.best_of_candidates(
            ids=penalised,
            raw=step.gathered[index, : len(penalised)],
            top_values=step.top_values[index],
            top_ids=step.top_ids[index],
            nan=bool(step.nan[index]),
            width=width,
        )
    except GenerationError as exc:
        return exc


def automatic_kv_budget(model: OnnxModel, *, share: float) -> int:
    """``share`` of the free memory of the model's device (CUDA) or of the host's physical memory (CPU)."""
    if model.device_type == "cuda":
        free = cuda_free_bytes(model.device_id)
        if free:
            return int(free * share)
    try:
        physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        return 0
    return int(physical * share)


def kv_bytes_per_position(model: OnnxModel) -> int:
    """Cache bytes one position of one row takes: layers x (key + value) x heads x head size x element."""
    graph = model.graph
    return len(graph.past_names) * graph.kv_heads * graph.head_dim * np.dtype(graph.kv_dtype).itemsize
