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

This module is the model thread's loop and the task threads' entry points;
its parts live beside it: ``workers.backends.row_stream`` (what a task
thread reads), ``engine_rows`` (the rows, their chunks, the group a row joins),
``kv_budget`` (what a row may reserve), ``prefill_slices`` (the size of a
prefill call beside decoding rows), ``device_picks`` (greedy rows picked on
the device) and ``prefix_reuse`` (the engine's use of its prefix cache).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from functools import partial
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from workers.backends.base import Chunk, EngineObserver
from workers.backends.constraints import MaskPlanner
from workers.backends.errors import GenerationError
from workers.backends.onnx.device_picks import device_gathers, feed_with_picks, merged_picks
from workers.backends.onnx.engine_rows import Group, Row, group_to_join
from workers.backends.onnx.graph import GraphSpec
from workers.backends.onnx.kv_batch import CacheOps
from workers.backends.onnx.kv_budget import reserved_bytes
from workers.backends.onnx.prefill_slices import DEFAULT_PREFILL_SHARE, PrefillSlices
from workers.backends.onnx.prefix_cache import PrefixCache
from workers.backends.onnx.prefix_reuse import PrefixReuse
from workers.backends.onnx.runtime import ModelRuntime
from workers.backends.onnx.step_picks import StepLogits
from workers.backends.row_stream import RowStream
from workers.backends.sampling.pool import SamplingPool

if TYPE_CHECKING:
    from workers.backends.onnx.generation import OnnxGeneration

log = logging.getLogger(__name__)


class EngineModel(Protocol):
    """What the batch engine needs of its model (``OnnxModel`` is one), so this module needs no model class."""

    name: str
    context_length: int
    prefill_chunk: int
    quantizes_per_call: bool
    group_query_attention: bool
    kv_bytes_per_position: int
    graph: GraphSpec
    runtime: ModelRuntime

    @property
    def batchable(self) -> bool: ...


class BatchEngine:
    """One model's rows in one model thread; see the module docstring."""

    def __init__(
        self,
        model: EngineModel,
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
            model.runtime.open_step_picks()
        self.prefill_share = prefill_share
        self.max_batch = max(1, max_batch)
        self.kv_budget = kv_budget_bytes
        self.delta_tokens = max(1, delta_tokens)
        self.delta_seconds = delta_seconds
        self.observer = observer or EngineObserver()
        self.batched = model.batchable
        self.exact_splits = model.quantizes_per_call or model.graph.float16
        self.ops = CacheOps(model.runtime)
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
        self._prefix = PrefixReuse(
            self.prefix_cache,
            runtime=model.runtime,
            ops=self.ops,
            observer=self.observer,
            bytes_per_position=self.bytes_per_position,
            room=self._cache_room,
            keeps_answers=not self.exact_splits,
            right_aligned=model.group_query_attention,
        )
        self._lock = threading.Condition()
        self._waiting: deque[Row] = deque()
        self._joining: deque[Row] = deque()
        # Batchable graphs: rows of similar widths share a group. Others: each row its own.
        self._groups: list[Group] = []
        self._closed = False
        self._broken: GenerationError | None = None
        self._drain_deadline: float | None = None
        self._slices = PrefillSlices(
            prefill_chunk=model.prefill_chunk, share=prefill_share, exact_splits=self.exact_splits
        )
        self._masks: MaskPlanner | None = None
        self._logits_width = 0
        self._sampling = SamplingPool(threads=sampling_threads)
        self._thread = threading.Thread(target=self._loop, name=f"lmsp-engine-{model.name}", daemon=True)
        self._thread.start()

    # -- task threads ---------------------------------------------------------

    def submit(self, generation: OnnxGeneration) -> RowStream:
        """Queue a generation (fresh or resumed); its chunks come from the returned stream."""
        stream = RowStream(generation, wake=self.wake)
        length_cap = min(self.model.context_length, generation.prompt_tokens + generation.max_output_tokens)
        row = Row(stream=stream, generation=generation, length_cap=length_cap, submitted=time.monotonic())
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
    def _decoding(self) -> list[Row]:
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
            self._prefix.clear()
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

    def _reserved(self, rows: list[Row]) -> int:
        """The bound on the padded cache these rows can reach: rows x the longest, per position."""
        return reserved_bytes([row.length_cap for row in rows], self.bytes_per_position)

    def _cache_room(self) -> int:
        """What the rows admitted now leave of the KV budget: the prefix cache's room."""
        return self.kv_budget - self._reserved([*self._decoding, *self._joining])

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
                self._prefix.evict(self.kv_budget - need)
            self._waiting.popleft()
            row.calls.extend(row.generation.feeds())
            self._joining.append(row)
            active.append(row)
            self.observer.queue_wait(time.monotonic() - row.submitted)
            row.emitted = False
            for step in row.generation.begin():
                row.add_step(step, time.monotonic())
            if row.generation.finish_reason is not None:
                self._joining.remove(row)
                active.remove(row)
                row.emit(final=True)
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
        self._slices.stepped(seconds)
        self.observer.step(rows=stepped, seconds=seconds)

    def _step_group(self, group: Group, now: float) -> int:
        """One session call for ``group``'s rows, and their samples; the rows stepped."""
        rows = list(group.rows)
        generations = [row.generation for row in rows]
        ids = np.array([[row.generation.generated_ids[-1]] for row in rows], dtype=np.int64)
        # The constrained rows' masks are computed while the session runs (llguidance drops the GIL).
        constrained = [row.generation.constraint for row in rows if row.generation.constraint is not None]
        masks = None
        if constrained:
            self._masks = self._masks or MaskPlanner()
            masks = self._masks.start(constrained)
        # The logits' width is learned from the engine's first step, which comes to the host whole.
        width = self._logits_width
        gathers = device_gathers(generations, width) if self.device_picks and width else {}
        full = [index for index in range(len(rows)) if index not in gathers]
        step: StepLogits | None = None
        try:
            if gathers:
                step = feed_with_picks(group.batch, ids, len(rows), gathers, full)
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
        picks = sampled if step is None else merged_picks(group.batch, generations, step, gathers, full, sampled)
        done = [row for row, pick in zip(rows, picks, strict=True) if not self._take(row, pick, now)]
        if done:
            self._leave(group, done, emitted=True)
        return len(rows)

    def _accept(self, row: Row, logits: np.ndarray, now: float) -> bool:
        """Sample ``row``'s next token; False when the row is over (its last chunk is out)."""
        try:
            pick: int | GenerationError = row.generation.pick(logits)
        except GenerationError as exc:
            pick = exc
        return self._take(row, pick, now)

    def _take(self, row: Row, pick: int | GenerationError, now: float) -> bool:
        """Move ``row`` on by its picked token; False when the row is over (its last chunk is out)."""
        try:
            if isinstance(pick, GenerationError):
                raise pick
            steps = row.generation.take(pick)
        except GenerationError as exc:
            row.stream.put(Chunk.failed(exc))
            return False
        for step in steps:
            row.add_step(step, now)
        if row.generation.finish_reason is not None:
            row.emit(final=True)
            return False
        if not row.emitted or row.tokens >= self.delta_tokens or now - row.since >= self.delta_seconds:
            row.emit(final=False)
        return True

    def _leave(self, group: Group, rows: list[Row], *, emitted: bool = False) -> None:
        """Drop ``rows`` from ``group``; those not yet told get their last chunk."""
        gone = set(map(id, rows))
        if not emitted:
            for row in rows:
                row.emit(final=True)
        self._prefix.remember_answers(group, rows)
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
            row.emit(final=True)
            self._readmit()
            return
        if row.batch is None:
            row.batch = self._prefix.start_batch(row)
        feed = row.calls[0]
        size = self._slices.call_size(len(feed), decoding=bool(self._groups))
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
                self._prefix.remember(row.first_feed, row.batch, index=0)
                row.first_feed = None
        if not last:
            self._slices.resize(len(ids), time.perf_counter() - started, decoding=bool(self._groups))
            return
        self._joining.popleft()
        assert logits is not None
        if not self._accept(row, logits[0], time.monotonic()):
            row.batch = None
            self._readmit()
            return
        self._join(row)

    def _join(self, row: Row) -> None:
        """A prefilled row starts decoding: into the group it pads least (on the device), or a group of its own."""
        batch, row.batch = row.batch, None
        assert batch is not None
        best = group_to_join(self._groups, batch.width) if self.batched else None
        if best is None:
            self._groups.append(Group(batch=batch, rows=[row]))
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

    def _take_all(self) -> list[Row]:
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
            row.emit(final=True, interrupted=True)

    def _fail_all(self, error: GenerationError) -> None:
        for row in self._take_all():
            row.stream.put(Chunk.failed(error))
