"""The loaded model: one model folder in one ONNX Runtime session (``LoadedModel``)."""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import onnxruntime as ort

from workers.backends.base import (
    EngineObserver,
    Prompt,
    SamplingParams,
    StopCheck,
    ToolPrompt,
)
from workers.backends.constraints import ConstraintTokenizer
from workers.backends.errors import ModelLoadError
from workers.backends.onnx.engine import BatchEngine
from workers.backends.onnx.generation import OnnxGeneration
from workers.backends.onnx.graph import graph_spec, quantizes_per_call, uses_group_query_attention
from workers.backends.onnx.kv_budget import automatic_kv_budget, kv_bytes_per_position
from workers.backends.onnx.kv_decoder import KVDecoder
from workers.backends.onnx.model_folder import (
    GENAI_CONFIG,
    MODEL_FILE,
    eos_ids,
    genai_generation_config,
    genai_graph_names,
    graph_file,
    read_json,
    shape_hints,
)
from workers.backends.onnx.prefill_slices import DEFAULT_PREFILL_SHARE
from workers.backends.onnx.prompt_text import PromptText
from workers.backends.onnx.runtime import ModelRuntime
from workers.backends.onnx.session import open_session
from workers.backends.onnx.step_picks import StepPicks
from workers.backends.sampling.settings import SamplingDefaults

log = logging.getLogger(__name__)

DEFAULT_PREFILL_CHUNK = 512


class OnnxModel:
    """One model folder loaded into an ONNX Runtime session; implements ``LoadedModel``.

    ``folder`` holds the side files (configs, tokenizer, chat template);
    ``graph`` is the decoder graph's path relative to it.
    """

    resumable = True

    def __init__(
        self,
        folder: Path,
        *,
        graph: str = MODEL_FILE,
        device: str = "auto",
        device_id: int = 0,
        prefill_chunk: int = DEFAULT_PREFILL_CHUNK,
        intra_op_threads: int | None = None,
        spinning: bool = False,
        gpu_mem_limit: int | None = None,
    ) -> None:
        if prefill_chunk < 1:
            raise ModelLoadError(f"prefill_chunk must be >= 1, got {prefill_chunk} (loading model {folder.name!r})")
        self.folder = folder
        self.name = folder.name
        self.prefill_chunk = prefill_chunk
        self.device_id = device_id
        self.gpu_mem_limit = gpu_mem_limit or None
        if not folder.is_dir():
            raise ModelLoadError(f"model folder {str(folder)!r} does not exist")
        model_path = graph_file(folder, graph)
        self.graph_file = Path(graph).as_posix()
        self.where = f"{self.graph_file} of model {self.name!r}"
        # A genai builder folder may have only genai_config.json; config.json wins where both exist.
        genai = read_json(folder / GENAI_CONFIG, required=False)
        self.config = read_json(folder / "config.json", required=not genai)
        self.generation_config = read_json(folder / "generation_config.json", required=False) or (
            genai_generation_config(genai)
        )
        tokenizer_config = read_json(folder / "tokenizer_config.json", required=False)
        # As read, for a prompt side built elsewhere (the worker's, beside its engine process): a config may be
        # a pipe that gives its text once.
        self.prompt_configs = {"config": self.config, "genai": genai, "tokenizer_config": tokenizer_config}
        self.prompt_text = PromptText(folder, **self.prompt_configs)
        self.tokenizer = self.prompt_text.tokenizer
        self.chat_template_source = self.prompt_text.chat_template_source
        self.eos_token_ids = eos_ids(self.generation_config, self.config, tokenizer_config, self.tokenizer)
        self.context_length = self.prompt_text.context_length
        self.defaults = SamplingDefaults.from_generation_config(self.generation_config)

        limit = self.gpu_mem_limit
        session, self.device_type = open_session(
            model_path, device, device_id, intra_op_threads, spinning, where=self.where, gpu_mem_limit=limit
        )
        self.provider: str = session.get_providers()[0]
        hints = shape_hints(self.config, genai)
        self.graph = graph_spec(session, genai_graph_names(genai, graph), hints, self.where)
        self.vocab_size = self._vocab_size(session, hints.vocab_size)
        # Resuming replays the generated ids one call each where a different split changes the logits:
        # per-call activation scales, or float16 rounding (one call over the prompt and the generated
        # ids rounds otherwise than the steps did, by a few float16 steps: enough to flip a near tie).
        self.quantizes_per_call = quantizes_per_call(model_path)
        self.replays_steps = self.graph.float16 or self.quantizes_per_call
        # GroupQueryAttention reads each row's length from the mask: rows right-aligned, exact in a batch.
        self.group_query_attention = uses_group_query_attention(model_path)
        self.kv_bytes_per_position = kv_bytes_per_position(self.graph)
        self._engine: BatchEngine | None = None
        self._engine_lock = threading.Lock()
        self._constraint_tokenizer: ConstraintTokenizer | None = None
        # What the session calls need of this model (the KV cache, the decoder, the engine's steps).
        self.runtime = ModelRuntime(
            session,
            name=self.name,
            graph=self.graph,
            where=self.where,
            device_type=self.device_type,
            device_id=device_id,
            gpu_mem_limit=self.gpu_mem_limit,
            right_aligned=self.group_query_attention,
        )
        log.debug("model %s loaded on %s from %s", self.name, self.provider, self.graph_file)

    @property
    def session(self) -> ort.InferenceSession | None:
        """The decoder's session; None once closed."""
        return self.runtime.session

    def open_step_picks(self) -> StepPicks:
        """The step-picks graph's session on this model's device (``step_picks``), opened once."""
        return self.runtime.open_step_picks()

    def _vocab_size(self, session: ort.InferenceSession, configured: int | None) -> int:
        """The logits' width: the graph's static dimension, else the configs, else the tokenizer's size.

        It can exceed the tokenizer's size (embedding tables padded to a multiple of 64 or 128).
        """
        shape = next(o.shape for o in session.get_outputs() if o.name == self.graph.names.logits)
        static = shape[-1] if shape and isinstance(shape[-1], int) else None
        return static or configured or self.tokenizer.get_vocab_size(with_added_tokens=True)

    # -- prompts ------------------------------------------------------------

    def render_prompt(self, prompt: Prompt, *, dropped: int = 0, tools: ToolPrompt | None = None) -> str:
        """The prompt as the text the model was trained on (``PromptText.render``)."""
        return self.prompt_text.render(prompt, dropped=dropped, tools=tools)

    def single_token_ids(self, texts: Sequence[str]) -> dict[str, int]:
        found = {}
        for text in texts:
            token = self.tokenizer.token_to_id(text) if text else None
            if token is not None and token < self.vocab_size:
                found[text] = token
        return found

    def prompt_ids(self, prompt: Prompt, *, tools: ToolPrompt | None = None) -> list[int]:
        """The prompt's token ids, whole turns dropped where it allows until it fits (``PromptText.ids``)."""
        return self.prompt_text.ids(prompt, tools=tools)

    @functools.cached_property
    def special_token_ids(self) -> frozenset[int]:
        """The ids a decode with ``skip_special_tokens`` leaves out."""
        return frozenset(i for i, token in self.tokenizer.get_added_tokens_decoder().items() if token.special)

    def kept_token_ids(self, texts: Sequence[str]) -> frozenset[int]:
        """The ids of the special tokens whose text a generation keeps (``SamplingParams.kept_tokens``)."""
        return frozenset(self.single_token_ids(texts).values())

    def constraint_tokenizer(self) -> ConstraintTokenizer:
        """The tokenizer constrained rows mask with, built on the first constrained request.

        Built on a task thread (tens of ms for a 150k vocabulary), never on the model thread; two
        threads racing to build it both get a usable one.
        """
        if self._constraint_tokenizer is None:
            self._constraint_tokenizer = ConstraintTokenizer(
                self.folder / "tokenizer.json",
                vocab_size=self.vocab_size,
                eos_token_ids=sorted(self.eos_token_ids),
                model=self.name,
            )
        return self._constraint_tokenizer

    # -- generation ---------------------------------------------------------

    def decoder(self) -> KVDecoder:
        """A fresh KV-cache runner (empty past) on this model's session."""
        return KVDecoder(self.runtime, prefill_chunk=self.prefill_chunk)

    def generate(self, prompt_ids: Sequence[int], params: SamplingParams, *, should_stop: StopCheck) -> OnnxGeneration:
        """Start a generation; nothing runs until it is iterated."""
        return OnnxGeneration(self, list(prompt_ids), params, should_stop)

    def resume(self, snapshot: Mapping[str, Any], params: SamplingParams, *, should_stop: StopCheck) -> OnnxGeneration:
        """Continue from :meth:`OnnxGeneration.snapshot`: re-prefill prompt + generated ids and go on."""
        return OnnxGeneration.from_snapshot(self, snapshot, params, should_stop)

    @property
    def batchable(self) -> bool:
        """Whether rows may share a session call and keep their tokens (``engine`` has why not)."""
        return not self.quantizes_per_call and (self.graph.has_position_ids or self.group_query_attention)

    def engine(
        self,
        *,
        max_batch: int,
        kv_budget_bytes: int,
        kv_share: float = 0.5,
        delta_tokens: int,
        delta_seconds: float,
        observer: Callable[[], EngineObserver] | None = None,
        sampling_threads: int = 1,
        prefill_share: float = DEFAULT_PREFILL_SHARE,
        device_picks: bool | None = None,
        prefix_cache: bool = True,
    ) -> BatchEngine:
        """This model's batch engine, started on first use (later calls return it as it is).

        An engine whose model thread broke is replaced: its rows failed, the next ones get a new one.
        """
        with self._engine_lock:
            if self._engine is None or not self._engine.running:
                self.runtime.require_session()
                budget = kv_budget_bytes or automatic_kv_budget(self.device_type, self.device_id, share=kv_share)
                if device_picks is None:
                    device_picks = self.device_type == "cuda"
                self._engine = BatchEngine(
                    self,
                    max_batch=max_batch,
                    kv_budget_bytes=budget,
                    delta_tokens=delta_tokens,
                    delta_seconds=delta_seconds,
                    observer=observer() if observer is not None else None,
                    sampling_threads=sampling_threads,
                    prefill_share=prefill_share,
                    device_picks=device_picks,
                    prefix_cache=prefix_cache,
                )
            return self._engine

    def close(self) -> None:
        """Stop the engine and drop the sessions (and with them the weights and device memory)."""
        with self._engine_lock:
            engine, self._engine = self._engine, None
        if engine is not None:
            engine.close()
        self.runtime.close()
