"""The loaded model: one model folder in one ONNX Runtime session (``LoadedModel``)."""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import onnxruntime as ort

from workers.backends.base import SamplingParams, StopCheck, request_messages
from workers.backends.errors import GenerationError, ModelLoadError
from workers.backends.onnx.chat_template import ChatTemplate
from workers.backends.onnx.generation import OnnxGeneration
from workers.backends.onnx.graph import graph_spec
from workers.backends.onnx.kv_decoder import KVDecoder
from workers.backends.onnx.model_folder import (
    MODEL_FILE,
    context_length,
    eos_ids,
    load_tokenizer,
    read_json,
    read_template,
)
from workers.backends.onnx.session import open_session
from workers.backends.sampling import SamplingDefaults

log = logging.getLogger(__name__)

DEFAULT_PREFILL_CHUNK = 512


class OnnxModel:
    """One model folder loaded into an ONNX Runtime session; implements ``LoadedModel``."""

    resumable = True

    def __init__(
        self,
        folder: Path,
        *,
        device: str = "auto",
        device_id: int = 0,
        prefill_chunk: int = DEFAULT_PREFILL_CHUNK,
        intra_op_threads: int | None = None,
        spinning: bool = False,
    ) -> None:
        if prefill_chunk < 1:
            raise ModelLoadError(f"prefill_chunk must be >= 1, got {prefill_chunk}")
        self.folder = folder
        self.name = folder.name
        self.prefill_chunk = prefill_chunk
        self.device_id = device_id
        if not folder.is_dir():
            raise ModelLoadError(f"model folder {str(folder)!r} does not exist")
        model_path = folder / MODEL_FILE
        if not model_path.is_file():
            raise ModelLoadError(f"model folder {folder.name!r} has no {MODEL_FILE}")
        self.config = read_json(folder / "config.json", required=True)
        self.generation_config = read_json(folder / "generation_config.json", required=False)
        tokenizer_config = read_json(folder / "tokenizer_config.json", required=False)
        self.tokenizer = load_tokenizer(folder)
        template = read_template(folder, tokenizer_config)
        self._template = ChatTemplate(template, folder, tokenizer_config) if template else None
        self.eos_token_ids = eos_ids(self.generation_config, self.config, tokenizer_config, self.tokenizer)
        self.context_length = context_length(self.config, folder)
        self.defaults = SamplingDefaults.from_generation_config(self.generation_config)

        self.session, self.device_type = open_session(model_path, device, device_id, intra_op_threads, spinning)
        self.provider: str = self.session.get_providers()[0]
        self.graph = graph_spec(self.session, self.config, folder)
        log.debug("model %s loaded on %s", self.name, self.provider)

    # -- prompts ------------------------------------------------------------

    def render_prompt(self, request: Mapping[str, Any]) -> str:
        """The request as the text the model was trained on (its chat template, add_generation_prompt)."""
        messages = request_messages(request)
        if self._template is None:
            return "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant:"
        return self._template.render(messages)

    def prompt_ids(self, request: Mapping[str, Any]) -> list[int]:
        """Render the request with the chat template and tokenise it.

        The template writes the special tokens itself, so the tokenizer adds
        none (it still maps special-token text to its ids); without a template
        the tokenizer's own post-processor adds what the model expects.
        """
        text = self.render_prompt(request)
        return list(self.tokenizer.encode(text, add_special_tokens=self._template is None).ids)

    # -- generation ---------------------------------------------------------

    def _require_session(self) -> ort.InferenceSession:
        if self.session is None:
            raise GenerationError(f"model {self.name!r} is closed")
        return self.session

    def decoder(self) -> KVDecoder:
        """A fresh KV-cache runner (empty past) on this model's session."""
        return KVDecoder(self)

    def generate(self, prompt_ids: Sequence[int], params: SamplingParams, *, should_stop: StopCheck) -> OnnxGeneration:
        """Start a generation; nothing runs until it is iterated."""
        return OnnxGeneration(self, list(prompt_ids), params, should_stop)

    def resume(self, snapshot: Mapping[str, Any], params: SamplingParams, *, should_stop: StopCheck) -> OnnxGeneration:
        """Continue from :meth:`OnnxGeneration.snapshot`: re-prefill prompt + generated ids and go on."""
        return OnnxGeneration.from_snapshot(self, snapshot, params, should_stop)

    def close(self) -> None:
        """Drop the session (and with it the weights and device memory)."""
        self.session = None
