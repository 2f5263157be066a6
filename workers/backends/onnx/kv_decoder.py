"""The KV-cache loop: token ids through the session with IOBinding, the cache left on the device.

The small int64 inputs are bound from host arrays, the ``present.*`` outputs
stay where the session computed them and are fed back as the next step's
past, and only the logits come back to the host.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
import onnxruntime as ort

from workers.backends.errors import GenerationError
from workers.backends.onnx.error_text import one_line

if TYPE_CHECKING:
    from workers.backends.onnx.model import OnnxModel

log = logging.getLogger(__name__)


class KVDecoder:
    """Feeds token ids through the session, keeping the KV cache on the device.

    :meth:`feed` takes any number of ids (a prompt, in chunks of
    ``prefill_chunk``, or one sampled token) and returns the logits of the
    last position as a host array.
    """

    def __init__(self, model: OnnxModel) -> None:
        self._session = model._require_session()
        self._graph = model.graph
        self._device = model.device_type
        self._device_id = model.device_id
        self._chunk = model.prefill_chunk
        self._binding = self._session.io_binding()
        empty = [1, self._graph.kv_heads, 0, self._graph.head_dim]
        self._past = [
            ort.OrtValue.ortvalue_from_shape_and_type(empty, self._graph.kv_dtype, self._device, self._device_id)
            for _ in self._graph.past_names
        ]
        self.past_length = 0

    def feed(self, ids: Sequence[int]) -> np.ndarray:
        """Append ``ids`` to the cache; the logits row (vocabulary) after the last one."""
        if not ids:
            raise ValueError("feed needs at least one token id")
        # Everything but the last token in chunks whose logits stay on the
        # device; the last token alone, so only one row of logits (not a
        # chunk x vocabulary block, ~300 MB for 512 x 150k) comes to the host.
        head = ids[:-1]
        for start in range(0, len(head), self._chunk):
            self._run(head[start : start + self._chunk], want_logits=False)
        logits = self._run(ids[-1:], want_logits=True)
        assert logits is not None
        return logits

    def _run(self, ids: Sequence[int], *, want_logits: bool) -> np.ndarray | None:
        count = len(ids)
        total = self.past_length + count
        binding = self._binding
        binding.clear_binding_inputs()
        binding.clear_binding_outputs()
        binding.bind_cpu_input("input_ids", np.asarray([ids], dtype=np.int64))
        binding.bind_cpu_input("attention_mask", np.ones((1, total), dtype=np.int64))
        if self._graph.has_position_ids:
            binding.bind_cpu_input("position_ids", np.arange(self.past_length, total, dtype=np.int64)[None, :])
        for name, value in zip(self._graph.past_names, self._past, strict=True):
            binding.bind_ortvalue_input(name, value)
        # Intermediate prefill chunks leave their logits on the device: nobody reads them.
        binding.bind_output("logits", "cpu" if want_logits else self._device, self._device_id)
        for name in self._graph.present_names:
            binding.bind_output(name, self._device, self._device_id)
        try:
            self._session.run_with_iobinding(binding)
        except Exception as exc:  # onnxruntime raises its own pybind exception types
            log.error("onnxruntime run failed at past length %d", self.past_length, exc_info=True)
            raise GenerationError(f"inference failed: {one_line(exc)}") from None
        outputs = binding.get_outputs()  # in binding order: logits, then present.*
        self._past = outputs[1:]
        self.past_length = total
        if not want_logits:
            return None
        return outputs[0].numpy()[0, -1]
