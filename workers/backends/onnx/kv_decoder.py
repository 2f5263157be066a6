"""The KV-cache loop: token ids through the session with IOBinding, the cache left on the device.

The small id inputs are bound from host arrays in the dtypes the graph
declares, the present key/value outputs stay where the session computed them
and are fed back as the next step's past, and only one logits row comes back
to the host.

A prompt goes in whole when it fits ``prefill_chunk``, else in chunks of that
size whose last one (whatever remains) is one call. It must not be split
otherwise: a dynamically quantized graph (``onnxruntime.quantization``'s
int8) computes its activation scales over the tokens of each call, so
another split gives other logits, and the tokens would differ from the
exporting tool's own runtime, which feeds the prompt in one call.

Optimum's legacy merged decoder takes ``use_cache_branch``: False on the
first call (with the empty past Optimum itself feeds), True on every call
after, as ``ORTModelForCausalLM.forward`` does.
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

    :meth:`feed` takes any number of ids (a prompt, or one sampled token) and
    returns the logits of the last position as a float32 host array.
    """

    def __init__(self, model: OnnxModel) -> None:
        self._session = model._require_session()
        self._graph = model.graph
        last_row = model.last_row
        assert last_row is not None  # set as long as the session is
        self._last_row = last_row
        self._where = model.where
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
        start = 0
        while len(ids) - start > self._chunk:
            self._run(ids[start : start + self._chunk], want_logits=False)
            start += self._chunk
        logits = self._run(ids[start:], want_logits=True)
        assert logits is not None
        return logits

    def _bind_inputs(self, ids: Sequence[int]) -> None:
        graph, names, binding = self._graph, self._graph.names, self._binding
        total = self.past_length + len(ids)
        binding.bind_cpu_input(names.input_ids, np.asarray([ids], dtype=graph.input_ids_dtype))
        binding.bind_cpu_input(names.attention_mask, np.ones((1, total), dtype=graph.attention_mask_dtype))
        if graph.has_position_ids:
            positions = np.arange(self.past_length, total, dtype=graph.position_ids_dtype)[None, :]
            binding.bind_cpu_input(names.position_ids, positions)
        if graph.use_cache_branch is not None:
            binding.bind_cpu_input(graph.use_cache_branch, np.array([self.past_length > 0], dtype=np.bool_))
        for name, value in zip(graph.past_names, self._past, strict=True):
            binding.bind_ortvalue_input(name, value)

    def _run(self, ids: Sequence[int], *, want_logits: bool) -> np.ndarray | None:
        binding = self._binding
        binding.clear_binding_inputs()
        binding.clear_binding_outputs()
        self._bind_inputs(ids)
        # One token: its single logits row comes straight to the host. More:
        # the logits stay on the device, where only the last row is taken.
        to_host = want_logits and len(ids) == 1
        binding.bind_output(self._graph.names.logits, "cpu" if to_host else self._device, self._device_id)
        for name in self._graph.present_names:
            binding.bind_output(name, self._device, self._device_id)
        try:
            self._session.run_with_iobinding(binding)
            outputs = binding.get_outputs()  # in binding order: logits, then the presents
            self._past = outputs[1:]
            self.past_length += len(ids)
            if not want_logits:
                return None
            row = outputs[0].numpy()[0, -1] if to_host else self._last_row.take(outputs[0])
        except Exception as exc:  # onnxruntime raises its own pybind exception types
            log.error("onnxruntime run failed for %s at past length %d", self._where, self.past_length, exc_info=True)
            raise GenerationError(f"inference failed for {self._where}: {one_line(exc)}") from None
        return row.astype(np.float32, copy=False)
