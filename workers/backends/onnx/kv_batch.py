"""Rows of KV cache in one batch: step them together, let rows join and leave, the cache left on the device.

A :class:`KVBatch` holds, per cache tensor, one ``[rows, kv_heads, length,
head_dim]`` value where the session computed it. Rows have their own lengths;
a row shorter than the batch is padded on the right and the attention mask
hides the padding, so every row sees exactly its own past:

- Graphs with GroupQueryAttention (the genai builder's) read each row's
  length from the mask (``seqlens_k``) and write its new key/value right
  after it: the mask of a row is ``length + 1`` ones, then zeros. Rows stay
  right-aligned (two rows gave their logits alone bit for bit).
- The other graphs (Optimum's, the demo models) append every step's
  key/value at the end of the cache: a row shorter than another keeps a hole
  of padding between its older tokens and its newer ones. The mask hides the
  hole (masked scores add exact zeros), but the reductions over the longer
  axis group their terms otherwise, so logits differ from a row run alone in
  the last bits (docs/workers.md has the measured differences).

Joins and leaves never bring the cache to the host: three graphs of our own
(Gather on the batch axis, Gather on the sequence axis, Pad + Concat) run on
the session's own execution provider, bound with IOBinding like the model.
Only logits rows come back: one per row of a decode step, the last one of a
prefill call.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import numpy as np
import onnxruntime as ort

from workers.backends.errors import GenerationError
from workers.backends.onnx import graph_proto as g
from workers.backends.onnx.error_text import one_line
from workers.backends.onnx.runtime import ModelRuntime
from workers.backends.onnx.session import open_helper_session
from workers.backends.onnx.step_picks import StepLogits

log = logging.getLogger(__name__)

# Opset 13 and IR 8, as the last-row graph: old enough for every onnxruntime this project pins.
_OPSET = 13
_IR_VERSION = 8
_ELEMENT = {np.float32: g.FLOAT, np.float16: g.FLOAT16}


def _cache(name: str, element: int, tag: str) -> bytes:
    # Distinct dimension names per tensor: onnxruntime takes equal names for equal sizes (and reuses buffers so).
    return g.tensor_value(name, element, [f"{tag}_rows", "heads", f"{tag}_length", "head_dim"])


def _model(nodes: list[g.Node], inputs: list[bytes], outputs: list[bytes], name: str) -> bytes:
    return g.model(nodes, name, inputs, outputs, opset=_OPSET, ir_version=_IR_VERSION)


def take_graph(tensors: int, element: int, axis: int) -> bytes:
    """``cache_i`` -> ``Gather(cache_i, index, axis)`` for every cache tensor at once."""
    index = g.tensor_value("index", g.INT64, ["kept"])
    inputs = [_cache(f"cache_{i}", element, "in") for i in range(tensors)]
    outputs = [_cache(f"out_{i}", element, "out") for i in range(tensors)]
    nodes = [g.node("Gather", [f"cache_{i}", "index"], [f"out_{i}"], axis=axis) for i in range(tensors)]
    return _model(nodes, [*inputs, index], outputs, f"take_axis_{axis}")


def merge_graph(tensors: int, element: int) -> bytes:
    """``(a_i, b_i)`` -> ``Concat(Pad(a_i, pad_a), Pad(b_i, pad_b), axis=0)``: zeros on the right of the length axis."""
    pads = [g.tensor_value(name, g.INT64, [8]) for name in ("pad_a", "pad_b")]
    inputs: list[bytes] = []
    outputs: list[bytes] = []
    nodes: list[g.Node] = []
    for i in range(tensors):
        inputs += [_cache(f"a_{i}", element, "a"), _cache(f"b_{i}", element, "b")]
        outputs.append(_cache(f"out_{i}", element, "out"))
        nodes.append(g.node("Pad", [f"a_{i}", "pad_a"], [f"pa_{i}"]))
        nodes.append(g.node("Pad", [f"b_{i}", "pad_b"], [f"pb_{i}"]))
        nodes.append(g.node("Concat", [f"pa_{i}", f"pb_{i}"], [f"out_{i}"], axis=0))
    return _model(nodes, [*inputs, *pads], outputs, "merge_rows")


class CacheOps:
    """The join/leave graphs of one loaded model, in small sessions on the model's device."""

    def __init__(self, runtime: ModelRuntime) -> None:
        graph = runtime.graph
        tensors = len(graph.past_names)
        element = _ELEMENT[graph.kv_dtype]
        where = runtime.where
        self.device, self.device_id = runtime.device_type, runtime.device_id

        limit = runtime.gpu_mem_limit

        def session(data: bytes, what: str) -> ort.InferenceSession:
            named = f"the {what} graph for {where}"
            return open_helper_session(data, self.device, self.device_id, where=named, gpu_mem_limit=limit)

        self._rows = session(take_graph(tensors, element, 0), "cache row")
        self._columns = session(take_graph(tensors, element, 2), "cache column")
        self._merge = session(merge_graph(tensors, element), "cache merge")
        self.tensors = tensors

    def _run(self, session: ort.InferenceSession, feeds: dict[str, ort.OrtValue | np.ndarray]) -> list[ort.OrtValue]:
        binding = session.io_binding()
        for name, value in feeds.items():
            if isinstance(value, np.ndarray):
                binding.bind_cpu_input(name, value)
            else:
                binding.bind_ortvalue_input(name, value)
        for i in range(self.tensors):
            binding.bind_output(f"out_{i}", self.device, self.device_id)
        session.run_with_iobinding(binding)
        return binding.get_outputs()

    def take(self, cache: Sequence[ort.OrtValue], index: np.ndarray, *, axis: int) -> list[ort.OrtValue]:
        """The cache with only the rows (axis 0) or the positions (axis 2) in ``index``."""
        session = self._rows if axis == 0 else self._columns
        feeds: dict[str, ort.OrtValue | np.ndarray] = {f"cache_{i}": value for i, value in enumerate(cache)}
        feeds["index"] = index.astype(np.int64, copy=False)
        return self._run(session, feeds)

    def merge(self, a: Sequence[ort.OrtValue], b: Sequence[ort.OrtValue], length: int) -> list[ort.OrtValue]:
        """``a``'s rows then ``b``'s, both padded with zeros on the right to ``length`` positions."""
        feeds: dict[str, ort.OrtValue | np.ndarray] = {}
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            feeds[f"a_{i}"], feeds[f"b_{i}"] = x, y
        feeds["pad_a"] = np.array([0, 0, 0, 0, 0, 0, length - a[0].shape()[2], 0], dtype=np.int64)
        feeds["pad_b"] = np.array([0, 0, 0, 0, 0, 0, length - b[0].shape()[2], 0], dtype=np.int64)
        return self._run(self._merge, feeds)


class KVBatch:
    """The cache of some rows of one model, and the session calls that extend it.

    :meth:`feed` appends the same number of ids to every row (one each in a
    decode step; a prompt chunk to a batch of one row); :meth:`merge` takes
    another batch's rows in after this one's, :meth:`keep` drops rows.
    """

    def __init__(self, runtime: ModelRuntime, *, ops: CacheOps | None = None) -> None:
        self._session = runtime.require_session()
        self._graph = runtime.graph
        last_row = runtime.last_row
        assert last_row is not None  # set as long as the session is
        self._last_row = last_row
        self._step_picks = runtime.step_picks
        self._step_logits: ort.OrtValue | None = None
        self._where = runtime.where
        self._device = runtime.device_type
        self._device_id = runtime.device_id
        self._right_aligned = runtime.right_aligned
        self._ops = ops
        self._binding = self._session.io_binding()
        empty = [1, self._graph.kv_heads, 0, self._graph.head_dim]
        self.past = [
            ort.OrtValue.ortvalue_from_shape_and_type(empty, self._graph.kv_dtype, self._device, self._device_id)
            for _ in self._graph.past_names
        ]
        self.lengths = np.zeros(1, dtype=np.int64)
        """Each row's tokens in the cache: the position of its next one."""
        # Which cache positions hold a row's tokens (the rest is padding); unused when right-aligned.
        self._valid = np.zeros((1, 0), dtype=bool)

    @property
    def rows(self) -> int:
        return len(self.lengths)

    def start_from(self, past: list[ort.OrtValue], length: int) -> None:
        """Begin this (still empty, one-row) batch with the cache of a row's first ``length`` ids (a prefix
        cache hit: ``[1, heads, length, head_dim]`` per tensor, no padding)."""
        if self.width or self.rows != 1:
            raise ValueError("only an empty batch of one row starts from a cached prefix")
        self.past = list(past)
        self.lengths = np.array([length], dtype=np.int64)
        self._valid = np.ones((1, length), dtype=bool)

    def row_cache(self, index: int) -> list[ort.OrtValue]:
        """Row ``index``'s cache alone and without padding (``[1, heads, length, head_dim]``): the batch's
        own tensors for a lone unpadded row, else a copy made on the device."""
        length = int(self.lengths[index])
        if self.rows == 1 and self.width == length:
            return list(self.past)
        ops = self._require_ops()
        try:
            past = self.past if self.rows == 1 else ops.take(self.past, np.array([index], dtype=np.int64), axis=0)
            if self._right_aligned:
                positions = np.arange(length, dtype=np.int64)
            else:
                positions = np.flatnonzero(self._valid[index]).astype(np.int64)
            return ops.take(past, positions, axis=2)
        except Exception as exc:
            raise GenerationError(f"copying a cache row failed for {self._where}: {one_line(exc)}") from None

    @property
    def width(self) -> int:
        """Positions per row in the cache tensors (the longest row, plus any padding)."""
        return int(self.past[0].shape()[2])

    def _mask(self, new: int) -> np.ndarray:
        if self._right_aligned:
            width = max(self.width, int(self.lengths.max()) + new)
            mask = np.arange(width)[None, :] < (self.lengths + new)[:, None]
        else:
            mask = np.hstack([self._valid, np.ones((self.rows, new), dtype=bool)])
        return mask

    def feed(self, ids: np.ndarray, *, want_logits: bool) -> np.ndarray | None:
        """Append ``ids`` (rows x tokens) to the cache; the logits after each row's last id (rows x vocabulary).

        More than one id per row needs a batch of one row (a prompt chunk):
        its logits stay on the device and only the last row is taken.
        """
        new = self._check(ids)
        # One id per row: its logits rows come straight to the host. More: they
        # stay on the device, where only the last row is taken.
        to_host = want_logits and new == 1
        try:
            logits = self._call(ids, logits_on="cpu" if to_host else self._device)
            if not want_logits:
                return None
            rows = logits.numpy()[:, -1] if to_host else self._last_row.take(logits)[None, :]
        except Exception as exc:  # onnxruntime raises its own pybind exception types
            raise self._failed(ids, exc) from None
        return rows.astype(np.float32, copy=False)

    def feed_step(
        self, ids: np.ndarray, *, full_rows: np.ndarray, k: int = 1, gather: np.ndarray | None = None
    ) -> StepLogits:
        """A decode step (one id a row) whose logits stay on the device (until the next call): every
        row's greedy pick, its ``k`` highest scores and its scores at ``gather`` (rows x ids), and only
        the ``full_rows`` (indices) whole on the host (``step_picks``)."""
        if self._step_picks is None:
            raise ValueError("this model's engine picks on the host: it has no step-picks graph")
        if self._check(ids) != 1:
            raise ValueError(f"a decode step feeds one id a row, not {ids.shape[1]}")
        try:
            self._step_logits = self._call(ids, logits_on=self._device)
            return self._step_picks.take(self._step_logits, full_rows, k=k, gather=gather)
        except Exception as exc:
            raise self._failed(ids, exc) from None

    def step_rows(self, rows: np.ndarray) -> np.ndarray:
        """The whole logits rows ``rows`` (indices) of the last :meth:`feed_step`, as float32 on the host."""
        if self._step_picks is None or self._step_logits is None:
            raise ValueError("no decode step's logits are kept on the device")
        try:
            return self._step_picks.take(self._step_logits, rows).rows
        except Exception as exc:
            raise self._failed(rows[:, None], exc) from None

    def _check(self, ids: np.ndarray) -> int:
        """The ids a row that ``ids`` feeds (rows x tokens), if this batch can take them."""
        rows, new = ids.shape
        if rows != self.rows or (new > 1 and rows > 1):
            raise ValueError(f"feed of {rows}x{new} ids into a batch of {self.rows} rows")
        return int(new)

    def _call(self, ids: np.ndarray, *, logits_on: str) -> ort.OrtValue:
        """One session call: ``ids`` appended to every row's cache; the logits, left on ``logits_on``."""
        new = ids.shape[1]
        self._step_logits = None
        graph, names, binding = self._graph, self._graph.names, self._binding
        mask = self._mask(new)
        binding.clear_binding_inputs()
        binding.clear_binding_outputs()
        binding.bind_cpu_input(names.input_ids, ids.astype(graph.input_ids_dtype, copy=False))
        binding.bind_cpu_input(names.attention_mask, mask.astype(graph.attention_mask_dtype))
        if graph.has_position_ids:
            positions = self.lengths[:, None] + np.arange(new, dtype=np.int64)[None, :]
            binding.bind_cpu_input(names.position_ids, positions.astype(graph.position_ids_dtype, copy=False))
        if graph.use_cache_branch is not None:
            binding.bind_cpu_input(graph.use_cache_branch, np.array([self.width > 0], dtype=np.bool_))
        for name, value in zip(graph.past_names, self.past, strict=True):
            binding.bind_ortvalue_input(name, value)
        binding.bind_output(names.logits, logits_on, self._device_id)
        for name in graph.present_names:
            binding.bind_output(name, self._device, self._device_id)
        self._session.run_with_iobinding(binding)
        outputs = binding.get_outputs()  # in binding order: logits, then the presents
        self.past = outputs[1:]
        self.lengths = self.lengths + new
        if not self._right_aligned:
            self._valid = mask
        return outputs[0]

    def _failed(self, ids: np.ndarray, exc: Exception) -> GenerationError:
        rows, width = ids.shape[0], self.width
        log.error("onnxruntime run failed for %s (%d rows, cache width %d)", self._where, rows, width, exc_info=True)
        return GenerationError(f"inference failed for {self._where}: {one_line(exc)}")

    def _require_ops(self) -> CacheOps:
        if self._ops is None:
            raise ValueError("this batch has no cache graphs: it cannot merge or drop rows")
        return self._ops

    def merge(self, other: KVBatch) -> None:
        """Take ``other``'s rows in after this batch's (``other`` must not be used afterwards)."""
        width = max(self.width, other.width)
        try:
            self.past = self._require_ops().merge(self.past, other.past, width)
        except GenerationError:
            raise
        except Exception as exc:
            raise GenerationError(f"merging cache rows failed for {self._where}: {one_line(exc)}") from None
        if not self._right_aligned:
            pad = np.zeros((self.rows, width - self._valid.shape[1]), dtype=bool)
            pad_other = np.zeros((other.rows, width - other._valid.shape[1]), dtype=bool)
            self._valid = np.vstack([np.hstack([self._valid, pad]), np.hstack([other._valid, pad_other])])
        self.lengths = np.concatenate([self.lengths, other.lengths])

    def keep(self, rows: Sequence[int]) -> None:
        """Keep only ``rows`` (indices, in the new order), then drop positions no kept row uses.

        Dropping positions costs one copy of the cache; it is done when it
        frees a quarter of the width (or 64 positions), so a row leaving
        ends the padding it forced on the others.
        """
        ops = self._require_ops()
        index = np.asarray(rows, dtype=np.int64)
        try:
            self.past = ops.take(self.past, index, axis=0)
            self.lengths = self.lengths[index]
            if self._right_aligned:
                used = np.arange(int(self.lengths.max()) if len(index) else 0)
            else:
                self._valid = self._valid[index]
                used = np.flatnonzero(self._valid.any(axis=0))
            wasted = self.width - len(used)
            if wasted and (wasted >= 64 or wasted * 4 >= self.width):
                self.past = ops.take(self.past, used, axis=2)
                if not self._right_aligned:
                    self._valid = self._valid[:, used]
        except Exception as exc:
            raise GenerationError(f"dropping cache rows failed for {self._where}: {one_line(exc)}") from None

    def device_bytes(self) -> int:
        """Bytes the cache tensors hold now."""
        element = np.dtype(self._graph.kv_dtype).itemsize
        return sum(int(np.prod(value.shape())) for value in self.past) * element

    def on_device(self) -> bool:
        """Whether every cache tensor lies on the model's device (the CUDA proof checks it)."""
        return all(value.device_name().lower() == self._device for value in self.past)
