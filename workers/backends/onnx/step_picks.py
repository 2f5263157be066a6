"""A decode step's greedy picks, made on the device the logits are on: a few bytes a row to the host.

A decode step's logits are rows x vocabulary (19 MB a step for 32 rows of
Qwen's 151,936 in float32). A greedy row without penalties or an output
constraint needs one number of its row: the id of its first highest score.
This one small graph of our own (in its own session on the same execution
provider, as ``last_row``) takes each row's ArgMax, its peak and whether it
holds a NaN, and gathers the full rows of only the others (sampled,
penalised or constrained rows, which the host sampler reads whole); only
those outputs are bound to the host.

Exact, not close: ONNX's ArgMax with ``select_last_index=0`` returns the
first of equal highest scores, as NumPy's argmax does; a float16 row is cast
to float32 first (exact, as the host path casts it); and the row is refused
exactly when the host sampler refuses it (a NaN anywhere, or a peak that is
not finite: NumPy's argmax returns a NaN's index, and +inf or an all -inf row
is not a distribution). Top_k and top_p rows are not picked here: the host
sampler's float64 total runs over the whole row (docs/decisions/0009). CPU
runs the very same graph in the tests.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnxruntime as ort

from workers.backends.onnx import graph_proto as g
from workers.backends.onnx.session import open_helper_session

_LOGITS = "logits"
_FULL = "full_rows"
_K = "k"
_GATHER = "gather"
_OUTPUTS = ("best", "peak", "nan", "rows", "top_values", "top_ids", "gathered")
# Opset 13 and IR 8, as the last-row graph: old enough for every onnxruntime this project pins.
_OPSET = 13
_IR_VERSION = 8


def picks_graph(logits_type: str) -> bytes:
    """The serialised graph over the last position's row of ``logits[R, S, V]``: ``best[R]`` (int64),
    ``peak[R]`` (float32), ``nan[R]`` (bool); ``rows[N, V]`` (float32) for ``full_rows[N]``; the ``k[1]``
    highest scores of each row, ``top_values[R, k]`` and ``top_ids[R, k]``; and ``gathered[R, M]``, each
    row's scores at ``gather[R, M]`` (a penalised row's penalised ids)."""
    fp16 = logits_type == "tensor(float16)"
    element = g.FLOAT16 if fp16 else g.FLOAT
    last = "last16" if fp16 else "last"
    nodes = [g.node("Gather", [_LOGITS, "minus_one"], [last], axis=1)]
    if fp16:
        nodes.append(g.node("Cast", [last], ["last"], to=g.FLOAT))
    nodes += [
        g.node("ArgMax", ["last"], ["best"], axis=1, keepdims=0, select_last_index=0),
        g.node("ReduceMax", ["last"], ["peak"], axes=[1], keepdims=0),
        g.node("IsNaN", ["last"], ["nan_each"]),
        g.node("Cast", ["nan_each"], ["nan_float"], to=g.FLOAT),
        g.node("ReduceMax", ["nan_float"], ["nan_any"], axes=[1], keepdims=0),
        g.node("Cast", ["nan_any"], ["nan"], to=g.BOOL),
        g.node("Gather", ["last", _FULL], ["rows"], axis=0),
        g.node("TopK", ["last", _K], ["top_values", "top_ids"], axis=1, largest=1, sorted=1),
        g.node("GatherElements", ["last", _GATHER], ["gathered"], axis=1),
    ]
    return g.model(
        nodes,
        "step_picks",
        [
            g.tensor_value(_LOGITS, element, ["rows", "sequence", "vocabulary"]),
            g.tensor_value(_FULL, g.INT64, ["full"]),
            g.tensor_value(_K, g.INT64, [1]),
            g.tensor_value(_GATHER, g.INT64, ["rows", "gathered"]),
        ],
        [
            g.tensor_value("best", g.INT64, ["rows"]),
            g.tensor_value("peak", g.FLOAT, ["rows"]),
            g.tensor_value("nan", g.BOOL, ["rows"]),
            g.tensor_value("rows", g.FLOAT, ["full", "vocabulary"]),
            g.tensor_value("top_values", g.FLOAT, ["rows", "k"]),
            g.tensor_value("top_ids", g.INT64, ["rows", "k"]),
            g.tensor_value("gathered", g.FLOAT, ["rows", "gathered"]),
        ],
        initializers=[g.int64_scalar("minus_one", -1)],
        opset=_OPSET,
        ir_version=_IR_VERSION,
    )


@dataclass(frozen=True)
class StepLogits:
    """What of a decode step's logits reaches the host."""

    best: np.ndarray
    """Each row's first highest score's id (int64)."""
    finite: np.ndarray
    """Each row's pick is a token: no NaN in the row, and a finite peak (bool)."""
    rows: np.ndarray
    """The full float32 rows asked for, in the order asked."""
    top_values: np.ndarray
    """Each row's k highest scores, falling (float32; the order among equal ones is the provider's)."""
    top_ids: np.ndarray
    """Their ids (int64)."""
    gathered: np.ndarray
    """Each row's scores at the ids asked for (float32)."""
    nan: np.ndarray
    """Each row holds a NaN (bool)."""
    width: int
    """The logits' width (the vocabulary)."""

    @property
    def host_bytes(self) -> int:
        arrays = (self.best, self.finite, self.rows, self.top_values, self.top_ids, self.gathered)
        return sum(array.nbytes for array in arrays) + 4 * len(self.best)


class StepPicks:
    """Runs :func:`picks_graph` on a step's logits where they lie; one per loaded model."""

    def __init__(
        self, logits_type: str, device_type: str, device_id: int, *, where: str, gpu_mem_limit: int | None = None
    ) -> None:
        self.session = open_helper_session(
            picks_graph(logits_type),
            device_type,
            device_id,
            where=f"the step-picks graph for {where}",
            gpu_mem_limit=gpu_mem_limit,
        )

    def take(
        self, logits: ort.OrtValue, full_rows: np.ndarray, *, k: int = 1, gather: np.ndarray | None = None
    ) -> StepLogits:
        """The picks of every row of ``logits`` (rows x positions x vocabulary), the ``full_rows`` whole,
        each row's ``k`` highest scores and its scores at ``gather`` (rows x ids)."""
        rows, width = int(logits.shape()[0]), int(logits.shape()[-1])
        # A binding per call: engines of several models may run at once.
        binding = self.session.io_binding()
        binding.bind_ortvalue_input(_LOGITS, logits)
        binding.bind_cpu_input(_FULL, np.ascontiguousarray(full_rows, dtype=np.int64))
        binding.bind_cpu_input(_K, np.array([min(max(1, k), width)], dtype=np.int64))
        ids = np.zeros((rows, 0), dtype=np.int64) if gather is None else np.ascontiguousarray(gather, dtype=np.int64)
        binding.bind_cpu_input(_GATHER, ids)
        for name in _OUTPUTS:
            binding.bind_output(name, "cpu")
        self.session.run_with_iobinding(binding)
        best, peak, nan, whole, top_values, top_ids, gathered = (value.numpy() for value in binding.get_outputs())
        return StepLogits(
            best=best,
            finite=~nan & np.isfinite(peak),
            rows=whole,
            top_values=top_values,
            top_ids=top_ids,
            gathered=gathered,
            nan=nan,
            width=width,
        )
