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
"""

from __future__ import annotations

import ctypes
import ctypes.util
import json
import logging
import sys
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort
from jinja2 import TemplateError
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

from tasks_app.exceptions import BackendError, InvalidRequest, ModelLoadFailed
from workers.backends.base import (
    FINISH_CANCELLED,
    FINISH_EOS,
    FINISH_LENGTH,
    FINISH_STOP,
    SamplingParams,
    Step,
    StopCheck,
    request_messages,
)
from workers.backends.detokenizer import StopFilter, StreamDetokenizer
from workers.backends.sampling import Sampler, SamplingDefaults

log = logging.getLogger("workers.backends.onnx")

MODEL_FILE = "model.onnx"
DEFAULT_PREFILL_CHUNK = 512
SNAPSHOT_VERSION = 1

CPU_PROVIDER = "CPUExecutionProvider"
CUDA_PROVIDER = "CUDAExecutionProvider"
DEVICES = ("auto", "cpu", "cuda")

_KV_DTYPES = {"tensor(float)": np.float32, "tensor(float16)": np.float16}
_PAST_PREFIX = "past_key_values."
_PRESENT_PREFIX = "present."
# ONNX Runtime's own severity scale: 3 = errors only.
_ORT_ERRORS_ONLY = 3


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

        Raises ``ModelLoadFailed`` with a one-line detail for anything that
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


# --------------------------------------------------------------------------- #
# Reading the folder
# --------------------------------------------------------------------------- #


def _one_line(exc: BaseException, limit: int = 300) -> str:
    """An exception's message fit for a problem detail: first line, bounded."""
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _read_json(path: Path, *, required: bool) -> dict[str, Any]:
    # exists(), not is_file(): a named pipe or a file on a special mount is read like any file.
    if not path.exists() or path.is_dir():
        if required:
            raise ModelLoadFailed(f"model folder {path.parent.name!r} has no {path.name}")
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise ModelLoadFailed(
            f"{path.name} of model {path.parent.name!r} is not readable JSON: {_one_line(exc)}"
        ) from None
    if not isinstance(data, dict):
        raise ModelLoadFailed(f"{path.name} of model {path.parent.name!r} is not a JSON object")
    return data


def _token_text(value: Any) -> str | None:
    """A special token from tokenizer_config.json: a string or a serialised AddedToken."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def _read_template(folder: Path, tokenizer_config: Mapping[str, Any]) -> str | None:
    """The chat template source: ``chat_template.jinja`` first (newer exports), then the config."""
    path = folder / "chat_template.jinja"
    if path.is_file():
        try:
            return path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise ModelLoadFailed(
                f"chat_template.jinja of model {folder.name!r} is not readable: {_one_line(exc)}"
            ) from None
    template = tokenizer_config.get("chat_template")
    if isinstance(template, list):
        # Several named templates: the one called "default" is the chat template.
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    return template if isinstance(template, str) and template else None


def _eos_ids(
    generation_config: Mapping[str, Any],
    config: Mapping[str, Any],
    tokenizer_config: Mapping[str, Any],
    tokenizer: Tokenizer,
) -> frozenset[int]:
    """End-of-sequence ids: generation_config.json, else config.json, else the tokenizer's eos_token."""
    for source in (generation_config, config):
        value = source.get("eos_token_id")
        if isinstance(value, int):
            return frozenset({value})
        if isinstance(value, list) and value and all(isinstance(v, int) for v in value):
            return frozenset(value)
    text = _token_text(tokenizer_config.get("eos_token"))
    token_id = tokenizer.token_to_id(text) if text else None
    return frozenset() if token_id is None else frozenset({token_id})


def _context_length(config: Mapping[str, Any], folder: Path) -> int:
    for key in ("max_position_embeddings", "n_positions", "max_sequence_length"):
        value = config.get(key)
        if isinstance(value, int) and value > 0:
            return value
    raise ModelLoadFailed(f"config.json of model {folder.name!r} has no max_position_embeddings")


# --------------------------------------------------------------------------- #
# The graph's signature
# --------------------------------------------------------------------------- #


@dataclass(frozen=True)
class GraphSpec:
    """What the session's inputs and outputs say about driving it."""

    has_position_ids: bool
    past_names: tuple[str, ...]
    """``past_key_values.{i}.key/value`` in layer order, key before value."""
    present_names: tuple[str, ...]
    """The matching ``present.{i}.key/value`` outputs, same order."""
    kv_dtype: type
    kv_heads: int
    head_dim: int

    @property
    def layers(self) -> int:
        return len(self.past_names) // 2


def _graph_spec(session: ort.InferenceSession, config: Mapping[str, Any], folder: Path) -> GraphSpec:
    inputs = {i.name: i for i in session.get_inputs()}
    outputs = {o.name for o in session.get_outputs()}
    where = f"model.onnx of model {folder.name!r}"
    for needed in ("input_ids", "attention_mask"):
        if needed not in inputs:
            raise ModelLoadFailed(f"{where} has no {needed!r} input")
    if "logits" not in outputs:
        raise ModelLoadFailed(f"{where} has no 'logits' output")
    layers = sorted({int(n.split(".")[1]) for n in inputs if n.startswith(_PAST_PREFIX) and n.count(".") == 2})
    if not layers:
        raise ModelLoadFailed(
            f"{where} has no past_key_values inputs; export it with the KV cache (text-generation-with-past)"
        )
    past_names: list[str] = []
    present_names: list[str] = []
    for layer in layers:
        for kind in ("key", "value"):
            past, present = f"{_PAST_PREFIX}{layer}.{kind}", f"{_PRESENT_PREFIX}{layer}.{kind}"
            if past not in inputs or present not in outputs:
                raise ModelLoadFailed(f"{where} lacks {past!r} or {present!r}")
            past_names.append(past)
            present_names.append(present)
    if layers != list(range(len(layers))):
        raise ModelLoadFailed(f"{where} has past_key_values for layers {layers}, not 0..{len(layers) - 1}")
    known = {"input_ids", "attention_mask", "position_ids", *past_names}
    unknown = sorted(set(inputs) - known)
    if unknown:
        raise ModelLoadFailed(f"{where} needs inputs this backend does not feed: {', '.join(unknown)}")

    first = inputs[past_names[0]]
    kv_dtype = _KV_DTYPES.get(first.type)
    if kv_dtype is None:
        raise ModelLoadFailed(f"{where} has a {first.type} KV cache; float32 and float16 are supported")
    shape = list(first.shape) if first.shape else []
    kv_heads = shape[1] if len(shape) == 4 and isinstance(shape[1], int) else None
    head_dim = shape[3] if len(shape) == 4 and isinstance(shape[3], int) else None
    try:
        if kv_heads is None:
            kv_heads = int(config.get("num_key_value_heads") or config["num_attention_heads"])
        if head_dim is None:
            head_dim = int(config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"])
    except (KeyError, TypeError, ValueError, ZeroDivisionError):
        raise ModelLoadFailed(
            f"cannot tell the KV cache shape of model {folder.name!r}: the graph leaves it open and config.json "
            "lacks num_key_value_heads/num_attention_heads/head_dim/hidden_size"
        ) from None
    return GraphSpec(
        has_position_ids="position_ids" in inputs,
        past_names=tuple(past_names),
        present_names=tuple(present_names),
        kv_dtype=kv_dtype,
        kv_heads=kv_heads,
        head_dim=head_dim,
    )


# --------------------------------------------------------------------------- #
# Devices
# --------------------------------------------------------------------------- #


def cuda_device_count() -> int:
    """How many CUDA devices the driver reports; 0 without a driver.

    Asked before ONNX Runtime ever tries its CUDA provider: onnxruntime-gpu on
    a machine without CUDA prints an error line to stderr and silently falls
    back to CPU, and ``auto`` should stay quiet there. Loading the driver
    library and calling ``cuInit`` costs nothing the CUDA provider would not
    pay anyway.
    """
    names = ["nvcuda.dll"] if sys.platform == "win32" else ["libcuda.so.1", "libcuda.so"]
    found = ctypes.util.find_library("cuda")
    if found:
        names.append(found)
    for name in names:
        try:
            driver = ctypes.CDLL(name)
        except OSError:
            continue
        try:
            if driver.cuInit(0) != 0:
                return 0
            count = ctypes.c_int(0)
            if driver.cuDeviceGetCount(ctypes.byref(count)) != 0:
                return 0
            return count.value
        except AttributeError:
            return 0
    return 0


def _session_options(intra_op_threads: int | None, spinning: bool) -> ort.SessionOptions:
    options = ort.SessionOptions()
    # Errors only: provider-placement warnings would flood the worker log.
    options.log_severity_level = _ORT_ERRORS_ONLY
    if intra_op_threads:
        options.intra_op_num_threads = intra_op_threads
    if not spinning:
        # Spinning intra-op threads keep every core busy between steps; on a
        # host that also serves the web and the database it starved the
        # event streams (docs/streams.md). Off, the demo model runs as fast
        # on half the CPU; large CPU models lose up to a quarter of speed.
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    return options


def _create_session(
    path: Path, providers: list[Any], intra_op_threads: int | None, spinning: bool
) -> ort.InferenceSession:
    try:
        return ort.InferenceSession(str(path), _session_options(intra_op_threads, spinning), providers=providers)
    except Exception as exc:  # onnxruntime raises its own pybind exception types
        log.warning("onnxruntime could not load %s", path, exc_info=True)
        raise ModelLoadFailed(f"onnxruntime could not load {path.parent.name}/{path.name}: {_one_line(exc)}") from None


def _open_session(
    path: Path, device: str, device_id: int, intra_op_threads: int | None, spinning: bool
) -> tuple[ort.InferenceSession, str]:
    """A session on the requested device and the device type its cache lives on ("cpu"/"cuda")."""
    if device not in DEVICES:
        raise ModelLoadFailed(f"unknown device {device!r}; use one of {', '.join(DEVICES)}")
    cuda = [(CUDA_PROVIDER, {"device_id": device_id}), CPU_PROVIDER]
    if device == "cpu":
        return _create_session(path, [CPU_PROVIDER], intra_op_threads, spinning), "cpu"
    cuda_built = CUDA_PROVIDER in ort.get_available_providers()
    if device == "cuda":
        if not cuda_built:
            raise ModelLoadFailed("CUDA requested but this onnxruntime build has no CUDAExecutionProvider")
        count = cuda_device_count()
        if count <= device_id:
            raise ModelLoadFailed(f"CUDA requested but the CUDA driver reports {count} device(s); wanted #{device_id}")
        session = _create_session(path, cuda, intra_op_threads, spinning)
        if session.get_providers()[0] != CUDA_PROVIDER:
            raise ModelLoadFailed(
                f"CUDA requested but onnxruntime fell back to {session.get_providers()[0]} "
                "(CUDA/cuDNN libraries missing or unusable; see the worker's stderr)"
            )
        return session, "cuda"
    # auto: CUDA when it really works, else a clean CPU session.
    if cuda_built and cuda_device_count() > device_id:
        try:
            session = _create_session(path, cuda, intra_op_threads, spinning)
        except ModelLoadFailed:
            session = None
        if session is not None and session.get_providers()[0] == CUDA_PROVIDER:
            return session, "cuda"
        log.warning("CUDA device found but onnxruntime could not use it for %s; using the CPU", path.parent.name)
        if session is not None:
            return session, "cpu"  # it already fell back to the CPU provider alone
    return _create_session(path, [CPU_PROVIDER], intra_op_threads, spinning), "cpu"


# --------------------------------------------------------------------------- #
# Chat template
# --------------------------------------------------------------------------- #


class _TemplateRaised(Exception):
    """``raise_exception(...)`` called by a chat template: the input breaks the template's rules."""


def _raise_exception(message: str) -> None:
    raise _TemplateRaised(message)


def _tojson(
    value: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None, sort_keys: bool = False
) -> str:
    # transformers' tojson: jinja2's built-in one HTML-escapes <, >, & and '.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _compile_template(source: str, folder: Path) -> Any:
    """Compile like transformers does, so templates render the same text they do there."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(source)
    except TemplateError as exc:
        raise ModelLoadFailed(
            f"the chat template of model {folder.name!r} does not compile: {_one_line(exc)}"
        ) from None


# --------------------------------------------------------------------------- #
# The model
# --------------------------------------------------------------------------- #


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
            raise ModelLoadFailed(f"prefill_chunk must be >= 1, got {prefill_chunk}")
        self.folder = folder
        self.name = folder.name
        self.prefill_chunk = prefill_chunk
        self.device_id = device_id
        if not folder.is_dir():
            raise ModelLoadFailed(f"model folder {str(folder)!r} does not exist")
        model_path = folder / MODEL_FILE
        if not model_path.is_file():
            raise ModelLoadFailed(f"model folder {folder.name!r} has no {MODEL_FILE}")
        self.config = _read_json(folder / "config.json", required=True)
        self.generation_config = _read_json(folder / "generation_config.json", required=False)
        tokenizer_config = _read_json(folder / "tokenizer_config.json", required=False)
        self.tokenizer = self._load_tokenizer(folder)
        template = _read_template(folder, tokenizer_config)
        self._template = _compile_template(template, folder) if template else None
        self._special_tokens = self._template_tokens(tokenizer_config)
        self.eos_token_ids = _eos_ids(self.generation_config, self.config, tokenizer_config, self.tokenizer)
        self.context_length = _context_length(self.config, folder)
        self.defaults = SamplingDefaults.from_generation_config(self.generation_config)

        self.session, self.device_type = _open_session(model_path, device, device_id, intra_op_threads, spinning)
        self.provider: str = self.session.get_providers()[0]
        self.graph = _graph_spec(self.session, self.config, folder)
        log.debug("model %s loaded on %s", self.name, self.provider)

    @staticmethod
    def _load_tokenizer(folder: Path) -> Tokenizer:
        path = folder / "tokenizer.json"
        if not path.is_file():
            raise ModelLoadFailed(f"model folder {folder.name!r} has no tokenizer.json")
        try:
            return Tokenizer.from_file(str(path))
        except Exception as exc:  # tokenizers raises plain Exception subclasses from Rust
            raise ModelLoadFailed(f"tokenizer.json of model {folder.name!r} is not usable: {_one_line(exc)}") from None

    @staticmethod
    def _template_tokens(tokenizer_config: Mapping[str, Any]) -> dict[str, Any]:
        """The special-token variables transformers hands a chat template."""
        tokens: dict[str, Any] = {}
        for key in ("bos_token", "eos_token", "pad_token", "unk_token", "sep_token", "cls_token", "mask_token"):
            text = _token_text(tokenizer_config.get(key))
            if text is not None:
                tokens[key] = text
        extra = tokenizer_config.get("additional_special_tokens")
        if isinstance(extra, list):
            tokens["additional_special_tokens"] = [t for t in map(_token_text, extra) if t is not None]
        return tokens

    # -- prompts ------------------------------------------------------------

    def render_prompt(self, request: Mapping[str, Any]) -> str:
        """The request as the text the model was trained on (its chat template, add_generation_prompt)."""
        messages = request_messages(request)
        if self._template is None:
            return "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant:"
        try:
            return self._template.render(
                messages=messages,
                tools=None,
                documents=None,
                add_generation_prompt=True,
                **self._special_tokens,
            )
        except _TemplateRaised as exc:
            raise InvalidRequest(f"the chat template of model {self.name!r} rejects this input: {exc}") from None
        except TemplateError as exc:
            raise BackendError(f"the chat template of model {self.name!r} failed: {_one_line(exc)}") from None

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
            raise BackendError(f"model {self.name!r} is closed")
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
            raise BackendError(f"inference failed: {_one_line(exc)}") from None
        outputs = binding.get_outputs()  # in binding order: logits, then present.*
        self._past = outputs[1:]
        self.past_length = total
        if not want_logits:
            return None
        return outputs[0].numpy()[0, -1]


class OnnxGeneration:
    """A running generation (implements ``Generation``); iterate it once for its steps."""

    def __init__(
        self,
        model: OnnxModel,
        prompt_ids: list[int],
        params: SamplingParams,
        should_stop: StopCheck,
        *,
        seed: int | None = None,
        generated_ids: list[int] | None = None,
        text: str = "",
        held_text: str = "",
        detokenizer_offsets: tuple[int, int] = (0, 0),
    ) -> None:
        model._require_session()
        if not prompt_ids:
            raise BackendError("the prompt is empty")
        if len(prompt_ids) >= model.context_length:
            raise BackendError(
                f"the prompt has {len(prompt_ids)} tokens; model {model.name!r} has a context window of "
                f"{model.context_length}, which leaves no room for output"
            )
        vocab = model.tokenizer.get_vocab_size(with_added_tokens=True)
        self.model = model
        self.prompt_ids = prompt_ids
        self.generated_ids = generated_ids or []
        if any(not 0 <= i < vocab for i in prompt_ids + self.generated_ids):
            raise BackendError(f"token ids must lie in 0..{vocab - 1}")
        temperature, top_p = model.defaults.resolve(params.temperature, params.top_p)
        self.sampler = Sampler(temperature=temperature, top_p=top_p, seed=params.seed if seed is None else seed)
        self.seed = self.sampler.seed
        self.prompt_tokens = len(prompt_ids)
        room = model.context_length - len(prompt_ids)
        self.max_output_tokens = room if params.max_output_tokens is None else min(params.max_output_tokens, room)
        self.finish_reason: str | None = None
        self._should_stop = should_stop
        self._detokenizer = StreamDetokenizer(
            model.tokenizer, prefix_offset=detokenizer_offsets[0], read_offset=detokenizer_offsets[1]
        )
        self._stop_filter = StopFilter(params.stop, held=held_text, released_chars=len(text))
        self._text = [text] if text else []
        self._steps: Iterator[Step] | None = None

    @classmethod
    def from_snapshot(
        cls, model: OnnxModel, snapshot: Mapping[str, Any], params: SamplingParams, should_stop: StopCheck
    ) -> OnnxGeneration:
        """Rebuild the generation a snapshot describes; see :meth:`snapshot`."""
        try:
            if snapshot.get("version") != SNAPSHOT_VERSION:
                raise ValueError(f"version {snapshot.get('version')!r}, expected {SNAPSHOT_VERSION}")
            prompt = [int(i) for i in snapshot["prompt_ids"]]
            generated = [int(i) for i in snapshot["generated_ids"]]
            offsets = snapshot["detokenizer"]
            prefix, read = int(offsets["prefix_offset"]), int(offsets["read_offset"])
            text, held = str(snapshot["text"]), str(snapshot["held_text"])
            if int(snapshot["released_chars"]) != len(text):
                raise ValueError("released_chars does not match the released text")
            if not 0 <= prefix <= read <= len(generated):
                raise ValueError("detokenizer offsets out of range")
            seed = int(snapshot["seed"])
            rng_state = snapshot["rng_state"]
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise BackendError(f"the snapshot is not valid: {_one_line(exc)}") from None
        generation = cls(
            model,
            prompt,
            params,
            should_stop,
            seed=seed,
            generated_ids=generated,
            text=text,
            held_text=held,
            detokenizer_offsets=(prefix, read),
        )
        generation.sampler.set_state(rng_state)
        finished = snapshot.get("finish_reason")
        if finished in (FINISH_EOS, FINISH_STOP, FINISH_LENGTH):
            # Nothing is left to produce; resuming just reports the same end.
            generation.finish_reason = finished
            generation._steps = iter(())
        return generation

    @property
    def output_tokens(self) -> int:
        return len(self.generated_ids)

    def __iter__(self) -> Iterator[Step]:
        if self._steps is None:
            self._steps = self._run()
        return self._steps

    def text(self) -> str:
        """All text released so far; after a resume it includes the text released before the snapshot."""
        return "".join(self._text)

    def snapshot(self) -> dict[str, Any]:
        """The state right after the last step yielded, as JSON-able data.

        ``text``/``released_chars`` are what the stop filter released,
        ``held_text`` what it still keeps back; the RNG state holds its 128-bit
        integers as hex strings.
        """
        new_ids, state = self.snapshot_since(0, with_prompt=True)
        return {**state, "generated_ids": new_ids, "text": self.text()}

    def snapshot_since(self, tokens: int, *, with_prompt: bool) -> tuple[list[int], dict[str, Any]]:
        """:meth:`snapshot` in parts that do not grow with the output: the ids
        generated after the first ``tokens``, and the rest without ``text``
        (and without ``prompt_ids`` unless ``with_prompt``)."""
        state: dict[str, Any] = {
            "version": SNAPSHOT_VERSION,
            "seed": self.seed,
            "rng_state": self.sampler.get_state(),
            "detokenizer": self._detokenizer.state(),
            "released_chars": self._stop_filter.released_chars,
            "held_text": self._stop_filter.held,
            "finish_reason": self.finish_reason,
        }
        if with_prompt:
            state["prompt_ids"] = list(self.prompt_ids)
        return self.generated_ids[tokens:], state

    def _release(self, text: str) -> str:
        if text:
            self._text.append(text)
        return text

    def _flush(self, ids: Sequence[int]) -> str:
        """Release held text at the end; a stop string can still show up in it."""
        text = self._stop_filter.push(self._detokenizer.flush(ids))
        if not self._stop_filter.stopped:
            text += self._stop_filter.flush()
        return self._release(text)

    def _run(self) -> Iterator[Step]:
        decoder = self.model.decoder()
        pending = self.prompt_ids + self.generated_ids
        if self.generated_ids and self.generated_ids[-1] in self.model.eos_token_ids:
            # A snapshot taken right on the end-of-sequence step: only the flush is left.
            yield from self._finish(FINISH_EOS, self.generated_ids[:-1])
            return
        while True:
            if len(self.generated_ids) >= self.max_output_tokens:
                yield from self._finish(FINISH_LENGTH, self.generated_ids)
                return
            if self._should_stop():
                self.finish_reason = FINISH_CANCELLED
                return
            token = self.sampler.sample(decoder.feed(pending))
            self.generated_ids.append(token)
            if token in self.model.eos_token_ids:
                yield Step(token, "")
                yield from self._finish(FINISH_EOS, self.generated_ids[:-1])
                return
            text = self._release(self._stop_filter.push(self._detokenizer.step(self.generated_ids)))
            if self._stop_filter.stopped:
                # Set before the step: a snapshot taken after it must not resume past the stop.
                self.finish_reason = FINISH_STOP
                yield Step(token, text)
                return
            yield Step(token, text)
            pending = [token]

    def _finish(self, reason: str, text_ids: Sequence[int]) -> Iterator[Step]:
        text = self._flush(text_ids)
        if text:
            yield Step(None, text)
        self.finish_reason = FINISH_STOP if self._stop_filter.stopped else reason


__all__ = [
    "DEFAULT_PREFILL_CHUNK",
    "GraphSpec",
    "KVDecoder",
    "OnnxGeneration",
    "OnnxModel",
    "OnnxRuntimeBackend",
    "cuda_device_count",
]
