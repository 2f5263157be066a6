"""The last logits row of a multi-token call, taken on the device the session left the logits on.

A prefill call returns sequence x vocabulary logits (300 MB for 512 x 150k
in float32) and only the last row is sampled from. The decoder binds those
logits on the session's device; a one-node graph of our own (Gather at -1 on
the sequence axis, then a Cast to float32 for fp16 graphs) runs in its own
small session on the same execution provider and only its 1 x vocabulary
output is bound to the host. CPU runs the very same path, so the CPU tests
cover what CUDA runs.
"""

from __future__ import annotations

import numpy as np
import onnxruntime as ort

from workers.backends.onnx import graph_proto as g
from workers.backends.onnx.session import open_helper_session

_INPUT = "logits"
_OUTPUT = "row"
# Opset 13 and IR 8: old enough for every onnxruntime this project pins.
_OPSET = 13
_IR_VERSION = 8


def row_graph(logits_type: str) -> bytes:
    """The serialised graph: ``logits[1, S, V]`` -> ``row[1, V]`` (float32) for ``tensor(float|float16)``."""
    fp16 = logits_type == "tensor(float16)"
    element = g.FLOAT16 if fp16 else g.FLOAT
    gathered = "row16" if fp16 else _OUTPUT
    nodes = [g.node("Gather", [_INPUT, "last"], [gathered], axis=1)]
    if fp16:
        # Exact: every float16 is a float32. The sampler then sees one dtype.
        nodes.append(g.node("Cast", [gathered], [_OUTPUT], to=g.FLOAT))
    return g.model(
        nodes,
        "last_logits_row",
        [g.tensor_value(_INPUT, element, [1, "sequence", "vocabulary"])],
        [g.tensor_value(_OUTPUT, g.FLOAT, [1, "vocabulary"])],
        initializers=[g.int64_scalar("last", -1)],
        opset=_OPSET,
        ir_version=_IR_VERSION,
    )


class LastRow:
    """Takes the last row of a logits value where it lies; one per loaded model."""

    def __init__(
        self, logits_type: str, device_type: str, device_id: int, *, where: str, gpu_mem_limit: int | None = None
    ) -> None:
        self.session = open_helper_session(
            row_graph(logits_type),
            device_type,
            device_id,
            where=f"the last-logits-row graph for {where}",
            gpu_mem_limit=gpu_mem_limit,
        )

    def take(self, logits: ort.OrtValue) -> np.ndarray:
        """The vocabulary row after the last position, as a float32 host array."""
        # A binding per call: generations on one model may run in parallel threads.
        binding = self.session.io_binding()
        binding.bind_ortvalue_input(_INPUT, logits)
        binding.bind_output(_OUTPUT, "cpu")
        self.session.run_with_iobinding(binding)
        return binding.get_outputs()[0].numpy()[0]
