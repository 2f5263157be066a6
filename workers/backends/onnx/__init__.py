"""ONNX Runtime backend for decoder-only models as people download them.

A model folder holds the side files: ``config.json``, optionally
``generation_config.json``, ``tokenizer.json`` and a chat template
(``chat_template.jinja`` or ``tokenizer_config.json``'s ``chat_template``).
The decoder graph is a path relative to the folder, ``model.onnx`` by
default (+ its external data file), and one of:

- Optimum's export (``model.onnx``), also as the onnx-community layout's
  variants (``onnx/model.onnx``, ``onnx/model_q4.onnx``, ...);
- the onnxruntime-genai builder's graph (GroupQueryAttention, int4
  MatMulNBits), whose folder may have only ``genai_config.json``: context
  length, token ids, cache shape and the IO names come from it, its
  ``search`` section becomes the generation config;
- Optimum's legacy merged decoder (``decoder_model_merged.onnx``, with a
  ``use_cache_branch`` input). The older unmerged pair is refused.

The graph takes ``input_ids``, ``attention_mask``, maybe ``position_ids``
and the past keys/values and returns ``logits`` and the present ones; names
(Optimum's unless genai_config.json gives others), id and cache dtypes and
shapes are read from the session, nothing is specific to one model.

The KV-cache loop uses IOBinding on every device: the small id inputs are
bound from host arrays, the present outputs stay where the session computed
them and are fed back as the next step's past, and only one logits row comes
back to the host (a prompt's logits stay on the device, where a tiny graph
takes the last row). On CUDA that means no per-step copies of the cache; on
CPU the same code runs, so the CPU tests cover the binding logic CUDA uses.

The modules, in the order a load and a generation use them:

- ``model_folder``: reading the folder's configs, tokenizer, template source and graph path;
- ``chat_template``: compiling and rendering the chat template;
- ``session``: the device, execution providers and threads of the session;
- ``graph``: what the graph's inputs and outputs say (names, dtypes, KV cache layout);
- ``last_row``: the last logits row of a prompt, taken on the device;
- ``step_picks``: a decode step's greedy picks, taken on the device;
- ``runtime``: :class:`ModelRuntime`, the session and the graphs beside it: what the
  session calls need of a model (so they need no model class);
- ``model``: :class:`OnnxModel`, the loaded model;
- ``kv_batch``: :class:`KVBatch`, rows of KV cache fed together, joining and leaving on the device;
- ``kv_decoder``: :class:`KVDecoder`, feeding ids through the session;
- ``generation``: :class:`OnnxGeneration`, the decode loop, snapshot and resume;
- ``engine``: :class:`BatchEngine`, many generations stepping together in one model thread,
  with its parts: ``engine_rows`` (the model thread's
  rows and groups), ``kv_budget``, ``prefill_slices``, ``device_picks``, ``prefix_cache`` and
  ``prefix_reuse`` (the engine's use of it);
- ``error_text``: how a library's error is quoted in a runtime error.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from workers.backends.onnx.model_folder import MODEL_FILE

if TYPE_CHECKING:
    from workers.backends.onnx.generation import OnnxGeneration
    from workers.backends.onnx.graph import GraphNames, GraphSpec
    from workers.backends.onnx.kv_decoder import KVDecoder
    from workers.backends.onnx.model import OnnxModel

# What loads ONNX Runtime is imported when first named: a web process counts prompts with this package's
# tokenizer and template (``prompt_text``) and never needs the runtime (docs/decisions/0014).
_LAZY = {
    "OnnxGeneration": "workers.backends.onnx.generation",
    "GraphNames": "workers.backends.onnx.graph",
    "GraphSpec": "workers.backends.onnx.graph",
    "KVDecoder": "workers.backends.onnx.kv_decoder",
    "OnnxModel": "workers.backends.onnx.model",
    "DEFAULT_PREFILL_CHUNK": "workers.backends.onnx.model",
    "cuda_device_count": "workers.backends.onnx.session",
}


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(_LAZY[name]), name)


class OnnxRuntimeBackend:
    """Loads model folders into :class:`OnnxModel` objects."""

    name = "onnxruntime"

    def __init__(
        self, *, prefill_chunk: int | None = None, intra_op_threads: int | None = None, spinning: bool = False
    ) -> None:
        from workers.backends.onnx.model import DEFAULT_PREFILL_CHUNK

        self.prefill_chunk = prefill_chunk or DEFAULT_PREFILL_CHUNK
        self.intra_op_threads = intra_op_threads
        self.spinning = spinning

    def load(
        self,
        folder: Path,
        *,
        graph: str = MODEL_FILE,
        device: str = "auto",
        device_id: int = 0,
        prefill_chunk: int | None = None,
        intra_op_threads: int | None = None,
        spinning: bool | None = None,
        gpu_mem_limit: int | None = None,
    ) -> OnnxModel:
        """Load a model folder onto ``device`` ("auto", "cpu" or "cuda").

        ``folder`` holds the side files (configs, tokenizer, chat template);
        ``graph`` is the decoder graph's path relative to it ("model.onnx",
        "onnx/model_q4.onnx", "decoder_model_merged.onnx", a genai builder's
        file name). Raises ``ModelLoadError`` with a one-line message for anything that
        keeps the model from running: missing or corrupt files, a graph this
        loop cannot drive, or CUDA asked for but not really given.
        ``gpu_mem_limit`` caps each CUDA session's arena (bytes; None or 0: no cap).
        """
        from workers.backends.onnx.model import OnnxModel

        return OnnxModel(
            Path(folder),
            graph=graph,
            device=device,
            device_id=device_id,
            prefill_chunk=prefill_chunk or self.prefill_chunk,
            intra_op_threads=intra_op_threads if intra_op_threads is not None else self.intra_op_threads,
            spinning=spinning if spinning is not None else self.spinning,
            gpu_mem_limit=gpu_mem_limit,
        )


__all__ = [
    "DEFAULT_PREFILL_CHUNK",
    "GraphNames",
    "GraphSpec",
    "KVDecoder",
    "OnnxGeneration",
    "OnnxModel",
    "OnnxRuntimeBackend",
    "cuda_device_count",
]
