"""A loaded model's session and the small graphs beside it on its device (``ModelRuntime``).

What the session calls need of a model, and nothing else: the KV cache's
batches (``kv_batch``), the single-row decoder (``kv_decoder``) and the batch
engine get this object instead of the model, so none of them imports the
model class (which builds them). The model owns it and closes it.
"""

from __future__ import annotations

import threading

import onnxruntime as ort

from workers.backends.errors import GenerationError
from workers.backends.onnx.graph import GraphSpec
from workers.backends.onnx.last_row import LastRow
from workers.backends.onnx.step_picks import StepPicks


class ModelRuntime:
    """The session, its graph's IO and device, and the last-row and step-picks graphs, until closed.

    ``right_aligned``: the graph reads each row's length from the mask (GroupQueryAttention), so rows of a
    batch stay right-aligned and exact.
    """

    def __init__(
        self,
        session: ort.InferenceSession,
        *,
        name: str,
        graph: GraphSpec,
        where: str,
        device_type: str,
        device_id: int,
        gpu_mem_limit: int | None,
        right_aligned: bool,
    ) -> None:
        self.session: ort.InferenceSession | None = session
        self.name = name
        self.graph = graph
        self.where = where
        self.device_type = device_type
        self.device_id = device_id
        self.gpu_mem_limit = gpu_mem_limit
        self.right_aligned = right_aligned
        self.last_row: LastRow | None = LastRow(
            graph.logits_type, device_type, device_id, where=where, gpu_mem_limit=gpu_mem_limit
        )
        # Opened by the first engine that picks greedy rows on the device (on CUDA, or asked to).
        self.step_picks: StepPicks | None = None
        self._picks_lock = threading.Lock()

    def require_session(self) -> ort.InferenceSession:
        """The session; a ``GenerationError`` once the model is closed."""
        if self.session is None:
            raise GenerationError(f"model {self.name!r} is closed")
        return self.session

    def open_step_picks(self) -> StepPicks:
        """The step-picks graph's session on this model's device (``step_picks``), opened once."""
        self.require_session()
        with self._picks_lock:
            if self.step_picks is None:
                self.step_picks = StepPicks(
                    self.graph.logits_type,
                    self.device_type,
                    self.device_id,
                    where=self.where,
                    gpu_mem_limit=self.gpu_mem_limit,
                )
            return self.step_picks

    def close(self) -> None:
        """Drop the sessions (and with them the weights and device memory)."""
        self.session = None
        self.last_row = None
        self.step_picks = None
