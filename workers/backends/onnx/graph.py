"""The graph's signature: which inputs to feed and how the KV cache is laid out.

The input and output names come from :class:`GraphNames` (Optimum's by
default, a genai builder folder's own from its ``genai_config.json``); the
cache dtype, the id dtypes and the shapes are read from the session, nothing
is specific to one model. A graph this loop cannot drive raises
``ModelLoadError`` naming the model and the graph file.
"""

from __future__ import annotations

import mmap
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort

from workers.backends.errors import ModelLoadError

_KV_DTYPES = {"tensor(float)": np.float32, "tensor(float16)": np.float16}
_ID_DTYPES = {"tensor(int64)": np.int64, "tensor(int32)": np.int32}
_LOGITS_TYPES = ("tensor(float)", "tensor(float16)")
# DynamicQuantizeLinear / DynamicQuantizeMatMul / DynamicQuantizeLSTM
# (onnxruntime.quantization.quantize_dynamic): one scale over all of a call's tokens.
_PER_CALL_SCALE_OPS = b"DynamicQuantize"
_GROUP_QUERY_ATTENTION = b"GroupQueryAttention"
# Optimum's merged decoder (decoder_model_merged.onnx): an If node picks the
# no-past or the with-past subgraph on this flag.
USE_CACHE_BRANCH = "use_cache_branch"


@dataclass(frozen=True)
class GraphNames:
    """The decoder's input and output names; ``%d`` in the cache patterns is the layer."""

    input_ids: str = "input_ids"
    attention_mask: str = "attention_mask"
    position_ids: str = "position_ids"
    logits: str = "logits"
    past_key: str = "past_key_values.%d.key"
    past_value: str = "past_key_values.%d.value"
    present_key: str = "present.%d.key"
    present_value: str = "present.%d.value"


@dataclass(frozen=True)
class ShapeHints:
    """What the folder's configs say about the cache, for dimensions the graph leaves symbolic."""

    kv_heads: int | None = None
    head_dim: int | None = None
    layers: int | None = None
    vocab_size: int | None = None
    source: str = "config.json"


@dataclass(frozen=True)
class GraphSpec:
    """What the session's inputs and outputs say about driving it."""

    names: GraphNames
    has_position_ids: bool
    past_names: tuple[str, ...]
    """The past key/value inputs in layer order, key before value."""
    present_names: tuple[str, ...]
    """The matching present key/value outputs, same order."""
    kv_dtype: type
    kv_heads: int
    head_dim: int
    input_ids_dtype: type = np.int64
    attention_mask_dtype: type = np.int64
    position_ids_dtype: type = np.int64
    logits_type: str = "tensor(float)"
    """``tensor(float)`` or ``tensor(float16)`` (fp16 graphs)."""
    use_cache_branch: str | None = None
    """The merged legacy decoder's boolean branch input, else None."""

    @property
    def layers(self) -> int:
        return len(self.past_names) // 2

    @property
    def float16(self) -> bool:
        """A float16 cache or float16 logits: the graph computes in float16, rounding as it goes."""
        return self.kv_dtype is np.float16 or self.logits_type == "tensor(float16)"


def graph_spec(session: ort.InferenceSession, names: GraphNames, hints: ShapeHints, where: str) -> GraphSpec:
    """Read the session's signature; ``where`` ("<graph> of model '<name>'") opens every error."""
    inputs = {i.name: i for i in session.get_inputs()}
    outputs = {o.name: o for o in session.get_outputs()}
    _check_required_io(inputs, outputs, names, where)
    past_names, present_names = _cache_names(inputs, outputs, names, hints, where)
    branch = USE_CACHE_BRANCH if USE_CACHE_BRANCH in inputs else None
    if branch is not None and inputs[branch].type != "tensor(bool)":
        raise ModelLoadError(f"{where} has a {inputs[branch].type} {branch!r} input; Optimum's merged export has bool")
    _check_no_unfed_inputs(inputs, names, past_names, branch, where)
    first = inputs[past_names[0]]
    logits_type = outputs[names.logits].type
    if logits_type not in _LOGITS_TYPES:
        raise ModelLoadError(f"{where} has {logits_type} logits; float32 and float16 are supported")
    kv_heads, head_dim = _kv_shape(first, hints, where)
    has_position_ids = names.position_ids in inputs
    return GraphSpec(
        names=names,
        has_position_ids=has_position_ids,
        past_names=tuple(past_names),
        present_names=tuple(present_names),
        kv_dtype=_kv_dtype(first, where),
        kv_heads=kv_heads,
        head_dim=head_dim,
        input_ids_dtype=_id_dtype(inputs[names.input_ids], where),
        attention_mask_dtype=_id_dtype(inputs[names.attention_mask], where),
        position_ids_dtype=_id_dtype(inputs[names.position_ids], where) if has_position_ids else np.int64,
        logits_type=logits_type,
        use_cache_branch=branch,
    )


def _check_required_io(
    inputs: Mapping[str, ort.NodeArg], outputs: Mapping[str, ort.NodeArg], names: GraphNames, where: str
) -> None:
    for needed in (names.input_ids, names.attention_mask):
        if needed not in inputs:
            raise ModelLoadError(f"{where} has no {needed!r} input")
    if names.logits not in outputs:
        raise ModelLoadError(f"{where} has no {names.logits!r} output")


def _layer_pattern(pattern: str) -> re.Pattern[str]:
    """``past_key_values.%d.key`` as a regular expression whose one group is the layer."""
    before, _, after = pattern.partition("%d")
    return re.compile(f"{re.escape(before)}([0-9]+){re.escape(after)}")


def _cache_names(
    inputs: Mapping[str, ort.NodeArg],
    outputs: Mapping[str, ort.NodeArg],
    names: GraphNames,
    hints: ShapeHints,
    where: str,
) -> tuple[list[str], list[str]]:
    """The past and present names, layer by layer; the layers must be exactly 0..n-1."""
    pattern = _layer_pattern(names.past_key)
    layers = sorted({int(m.group(1)) for n in inputs if (m := pattern.fullmatch(n))})
    if not layers:
        raise ModelLoadError(
            f"{where} has no {names.past_key.replace('%d', 'N')} inputs; "
            "export it with the KV cache (text-generation-with-past)"
        )
    past_names: list[str] = []
    present_names: list[str] = []
    for layer in layers:
        for past_pattern, present_pattern in (
            (names.past_key, names.present_key),
            (names.past_value, names.present_value),
        ):
            past, present = past_pattern.replace("%d", str(layer)), present_pattern.replace("%d", str(layer))
            if past not in inputs or present not in outputs:
                raise ModelLoadError(f"{where} lacks {past!r} or {present!r}")
            past_names.append(past)
            present_names.append(present)
    # Checked after the pairs so that a layer missing its present output is
    # named as such rather than as a gap in the numbering.
    if layers != list(range(len(layers))):
        raise ModelLoadError(f"{where} has past key/values for layers {layers}, not 0..{len(layers) - 1}")
    if hints.layers is not None and hints.layers != len(layers):
        raise ModelLoadError(f"{where} has {len(layers)} cache layers; {hints.source} says {hints.layers}")
    return past_names, present_names


def _check_no_unfed_inputs(
    inputs: Mapping[str, ort.NodeArg], names: GraphNames, past_names: list[str], branch: str | None, where: str
) -> None:
    known = {names.input_ids, names.attention_mask, names.position_ids, *past_names}
    if branch is not None:
        known.add(branch)
    unknown = sorted(set(inputs) - known)
    if unknown:
        raise ModelLoadError(f"{where} needs inputs this backend does not feed: {', '.join(unknown)}")


def _kv_dtype(first: ort.NodeArg, where: str) -> type:
    kv_dtype = _KV_DTYPES.get(first.type)
    if kv_dtype is None:
        raise ModelLoadError(f"{where} has a {first.type} KV cache; float32 and float16 are supported")
    return kv_dtype


def _id_dtype(arg: ort.NodeArg, where: str) -> type:
    # Optimum exports int64; some builders and hand-made graphs take int32.
    dtype = _ID_DTYPES.get(arg.type)
    if dtype is None:
        raise ModelLoadError(f"{where} takes {arg.name!r} as {arg.type}; int64 and int32 are supported")
    return dtype


def _static_dim(shape: list[Any], index: int) -> int | None:
    """A dimension of a (batch, heads, sequence, head_dim) cache, or None where the graph leaves it symbolic."""
    return shape[index] if len(shape) == 4 and isinstance(shape[index], int) else None


def _kv_shape(first: ort.NodeArg, hints: ShapeHints, where: str) -> tuple[int, int]:
    """KV heads and head size: the graph's static dimensions first, the configs for those it leaves open."""
    shape = list(first.shape) if first.shape else []
    kv_heads = _static_dim(shape, 1) or hints.kv_heads
    head_dim = _static_dim(shape, 3) or hints.head_dim
    if kv_heads is None or head_dim is None:
        raise ModelLoadError(
            f"cannot tell the KV cache shape of {where}: the graph leaves it open and {hints.source} "
            "lacks the key/value heads or the head size"
        )
    return kv_heads, head_dim


def _graph_mentions(path: Path, op_type: bytes) -> bool:
    """Whether the graph file holds ``op_type``; unreadable here (ONNX Runtime read it): True."""
    try:
        with path.open("rb") as file, mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as data:
            return data.find(op_type) != -1
    except (OSError, ValueError):
        return True


def uses_group_query_attention(path: Path) -> bool:
    """Whether attention is GroupQueryAttention, which places each row by its own length (``seqlens_k``).

    Such a graph's batch rows are right-aligned, so joining rows need no
    position ids. A false positive (the bytes inside weights) would batch a
    graph without position ids wrongly, so unreadable means False here.
    """
    try:
        return _graph_mentions(path, _GROUP_QUERY_ATTENTION) if path.is_file() else False
    except OSError:
        return False


def quantizes_per_call(path: Path) -> bool:
    """Whether the graph quantizes activations with one scale over each call's tokens.

    Such a graph's logits depend on how the ids are split into calls. Node op
    types are plain strings in the file, so a byte search finds them without
    parsing a graph whose weights are inside it a second time; the same bytes
    inside weights would only make resuming replay steps it need not.
    Unreadable here (ONNX Runtime read it): assume it does.
    """
    return _graph_mentions(path, _PER_CALL_SCALE_OPS)
