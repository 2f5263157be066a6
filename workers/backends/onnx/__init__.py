"""ONNX Runtime backend for decoder-only models exported the Hugging Face Optimum way.

A model folder holds ``model.onnx`` (+ ``model.onnx_data``), ``config.json``,
optionally ``generation_config.json``, ``tokenizer.json`` and a chat template
(``chat_template.jinja`` or ``tokenizer_config.json``'s ``chat_template``).
The graph takes ``input_ids``, ``attention_mask``, maybe ``position_ids`` and
``past_key_values.{i}.key/value`` and returns ``logits`` and
``present.{i}.key/value``; names, cache dtype and shapes are read from the
session, nothing is specific to one model.

The KV-cache loop uses IOBinding on every device: the small int64 inputs are
bound from host arrays, the ``present.*`` outputs stay where the session
computed them and are fed back as the next step's past, and only the logits
come back to the host. On CUDA that means no per-step copies of the cache; on
CPU the same code runs, so the CPU tests cover the binding logic CUDA uses.

The modules, in the order a load and a generation use them:

- ``model_folder``: reading the folder's configs, tokenizer and template source;
- ``chat_template``: compiling and rendering the chat template;
- ``session``: the device, execution providers and threads of the session;
- ``graph``: what the graph's inputs and outputs say (KV cache layout);
- ``model``: :class:`OnnxModel`, the loaded model;
- ``kv_decoder``: :class:`KVDecoder`, feeding ids through the session;
- ``generation``: :class:`OnnxGeneration`, the decode loop, snapshot and resume;
- ``error_text``: how a library's error is quoted in a runtime error.
"""

from __future__ import annotations

from pathlib import Path

from workers.backends.onnx.generation import OnnxGeneration
from workers.backends.onnx.graph import GraphSpec
from workers.backends.onnx.kv_decoder import KVDecoder
from workers.backends.onnx.model import DEFAULT_PREFILL_CHUNK, OnnxModel
from workers.backends.onnx.session import cuda_device_count


class OnnxRuntimeBackend:
    """Loads model folders into :class:`OnnxModel` objects."""

    name = "onnxruntime"

    def __init__(
        self, *, prefill_chunk: int = DEFAULT_PREFILL_CHUNK, intra_op_threads: int | None = None, spinning: bool = False
    ) -> None:
        self.prefill_chunk = prefill_chunk
        self.intra_op_threads = intra_op_threads
        self.spinning = spinning

    def load(
        self,
        folder: Path,
        *,
        device: str = "auto",
        device_id: int = 0,
        prefill_chunk: int | None = None,
        intra_op_threads: int | None = None,
        spinning: bool | None = None,
    ) -> OnnxModel:
        """Load a model folder onto ``device`` ("auto", "cpu" or "cuda").

        Raises ``ModelLoadError`` with a one-line message for anything that
        keeps the model from running: missing or corrupt files, a graph this
        loop cannot drive, or CUDA asked for but not really given.
        """
        return OnnxModel(
            Path(folder),
            device=device,
            device_id=device_id,
            prefill_chunk=prefill_chunk or self.prefill_chunk,
            intra_op_threads=intra_op_threads if intra_op_threads is not None else self.intra_op_threads,
            spinning=spinning if spinning is not None else self.spinning,
        )


__all__ = [
    "DEFAULT_PREFILL_CHUNK",
    "GraphSpec",
    "KVDecoder",
    "OnnxGeneration",
    "OnnxModel",
    "OnnxRuntimeBackend",
    "cuda_device_count",
]
