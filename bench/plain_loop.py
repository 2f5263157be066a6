"""The plain loop: a batched greedy IOBinding loop over a model folder's graph, with nothing around it.

What the service is measured against (``concurrency.py``, ``first_token.py``) and, on a lent GPU,
the engine process (``cuda_proof.py``): the most one session does with this hardware.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort

# The worker's LMSP_PREFILL_CHUNK default: the plain loop prefills a long prompt in the same chunks.
PREFILL_CHUNK = 512


class PlainLoop:
    """A batched greedy loop over the model files: the most a single session does with this hardware."""

    def __init__(self, folder: Path, *, threads: int, device: str) -> None:
        options = ort.SessionOptions()
        # The worker's options (workers/backends/onnx/session.py): errors only, the
        # intra-op threads it is given, no spinning between steps.
        options.log_severity_level = 3
        options.intra_op_num_threads = threads
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
        providers = ["CUDAExecutionProvider", "CPUExecutionProvider"] if device == "cuda" else ["CPUExecutionProvider"]
        self.session = ort.InferenceSession(str(folder / "model.onnx"), options, providers=providers)
        self.device = device
        config = json.loads((folder / "config.json").read_text())
        self.context = int(config["max_position_embeddings"])
        self.kv_heads = int(config["num_key_value_heads"])
        self.head_dim = int(config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"])
        self.past_names = [i.name for i in self.session.get_inputs() if i.name.startswith("past_key_values.")]
        self.present_names = ["present." + name.removeprefix("past_key_values.") for name in self.past_names]

    def _empty_past(self, rows: int) -> list[ort.OrtValue]:
        shape = [rows, self.kv_heads, 0, self.head_dim]
        return [ort.OrtValue.ortvalue_from_shape_and_type(shape, np.float32, self.device, 0) for _ in self.past_names]

    def step(self, ids: np.ndarray, past: list[ort.OrtValue], past_length: int) -> tuple[np.ndarray, list[Any]]:
        """One call: ``ids`` (rows x length) after ``past``; the greedy next id of each row and the new cache."""
        rows, length = ids.shape
        binding = self.session.io_binding()
        binding.bind_cpu_input("input_ids", ids)
        binding.bind_cpu_input("attention_mask", np.ones((rows, past_length + length), dtype=np.int64))
        positions = np.arange(past_length, past_length + length, dtype=np.int64)
        binding.bind_cpu_input("position_ids", np.repeat(positions[None, :], rows, axis=0))
        for name, value in zip(self.past_names, past, strict=True):
            binding.bind_ortvalue_input(name, value)
        binding.bind_output("logits", "cpu")
        for name in self.present_names:
            binding.bind_output(name, self.device)
        self.session.run_with_iobinding(binding)
        outputs = binding.get_outputs()
        next_ids = outputs[0].numpy()[:, -1].argmax(axis=-1).astype(np.int64)
        return next_ids[:, None], outputs[1:]

    def generate(self, prompt: Sequence[int], rows: int, tokens: int) -> dict[str, float]:
        """``rows`` copies of ``prompt`` to ``tokens`` output tokens each; wall time, prefill and step time."""
        ids = np.repeat(np.asarray([prompt], dtype=np.int64), rows, axis=0)
        started = time.perf_counter()
        next_ids, past = self.step(ids, self._empty_past(rows), 0)
        prefilled = time.perf_counter()
        length = len(prompt)
        for _ in range(tokens - 1):
            next_ids, past = self.step(next_ids, past, length)
            length += 1
        seconds = time.perf_counter() - started
        return {
            "seconds": seconds,
            "prefill_s": prefilled - started,
            "step_s": (seconds - (prefilled - started)) / max(1, tokens - 1),
        }

    def prefill_seconds(self, prompt: Sequence[int], repeat: int) -> list[float]:
        """The time to the first token of one prompt (batch 1), in chunks of PREFILL_CHUNK like the worker."""
        times = []
        for _ in range(repeat + 1):  # the first run of a shape is a warm-up
            started = time.perf_counter()
            past, done = self._empty_past(1), 0
            while done < len(prompt):
                chunk = np.asarray([prompt[done : done + PREFILL_CHUNK]], dtype=np.int64)
                _, past = self.step(chunk, past, done)
                done += chunk.shape[1]
            times.append(time.perf_counter() - started)
        return times[1:]
