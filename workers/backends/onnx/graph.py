"""The graph's signature: which inputs to feed and how the KV cache is laid out.

Names, cache dtype and shapes are read from the session, nothing is specific
to one model; a graph this loop cannot drive raises ``ModelLoadError``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort

from workers.backends.errors import ModelLoadError

_KV_DTYPES = {"tensor(float)": np.float32, "tensor(float16)": np.float16}
_PAST_PREFIX = "past_key_values."
_PRESENT_PREFIX = "present."


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


def graph_spec(session: ort.InferenceSession, config: Mapping[str, Any], folder: Path) -> GraphSpec:
    inputs = {i.name: i for i in session.get_inputs()}
    outputs = {o.name for o in session.get_outputs()}
    where = f"model.onnx of model {folder.name!r}"
    _check_required_io(inputs, outputs, where)
    past_names, present_names = _cache_names(inputs, outputs, where)
    _check_no_unfed_inputs(inputs, past_names, where)
    first = inputs[past_names[0]]
    kv_dtype = _kv_dtype(first, where)
    kv_heads, head_dim = _kv_shape(first, config, folder)
    return GraphSpec(
        has_position_ids="position_ids" in inputs,
        past_names=tuple(past_names),
        present_names=tuple(present_names),
        kv_dtype=kv_dtype,
        kv_heads=kv_heads,
        head_dim=head_dim,
    )


def _check_required_io(inputs: Mapping[str, ort.NodeArg], outputs: set[str], where: str) -> None:
    for needed in ("input_ids", "attention_mask"):
        if needed not in inputs:
            raise ModelLoadError(f"{where} has no {needed!r} input")
    if "logits" not in outputs:
        raise ModelLoadError(f"{where} has no 'logits' output")


def _cache_names(inputs: Mapping[str, ort.NodeArg], outputs: set[str], where: str) -> tuple[list[str], list[str]]:
    """The past and present names, layer by layer; the layers must be exactly 0..n-1."""
    layers = sorted({int(n.split(".")[1]) for n in inputs if n.startswith(_PAST_PREFIX) and n.count(".") == 2})
    if not layers:
        raise ModelLoadError(
            f"{where} has no past_key_values inputs; export it with the KV cache (text-generation-with-past)"
        )
    past_names: list[str] = []
    present_names: list[str] = []
    for layer in layers:
        for kind in ("key", "value"):
            past, present = f"{_PAST_PREFIX}{layer}.{kind}", f"{_PRESENT_PREFIX}{layer}.{kind}"
            if past not in inputs or present not in outputs:
                raise ModelLoadError(f"{where} lacks {past!r} or {present!r}")
            past_names.append(past)
            present_names.append(present)
    # Checked after the pairs so that a layer missing its present output is
    # named as such rather than as a gap in the numbering.
    if layers != list(range(len(layers))):
        raise ModelLoadError(f"{where} has past_key_values for layers {layers}, not 0..{len(layers) - 1}")
    return past_names, present_names


def _check_no_unfed_inputs(inputs: Mapping[str, ort.NodeArg], past_names: list[str], where: str) -> None:
    known = {"input_ids", "attention_mask", "position_ids", *past_names}
    unknown = sorted(set(inputs) - known)
    if unknown:
        raise ModelLoadError(f"{where} needs inputs this backend does not feed: {', '.join(unknown)}")


def _kv_dtype(first: ort.NodeArg, where: str) -> type:
    kv_dtype = _KV_DTYPES.get(first.type)
    if kv_dtype is None:
        raise ModelLoadError(f"{where} has a {first.type} KV cache; float32 and float16 are supported")
    return kv_dtype


def _static_dim(shape: list[Any], index: int) -> int | None:
    """A dimension of a (batch, heads, sequence, head_dim) cache, or None where the graph leaves it symbolic."""
    return shape[index] if len(shape) == 4 and isinstance(shape[index], int) else None


def _kv_shape(first: ort.NodeArg, config: Mapping[str, Any], folder: Path) -> tuple[int, int]:
    """KV heads and head size: the graph's static dimensions first, config.json for those it leaves open."""
    shape = list(first.shape) if first.shape else []
    kv_heads = _static_dim(shape, 1)
    head_dim = _static_dim(shape, 3)
    try:
        if kv_heads is None:
            kv_heads = int(config.get("num_key_value_heads") or config["num_attention_heads"])
        if head_dim is None:
            head_dim = int(config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"])
    except (KeyError, TypeError, ValueError, ZeroDivisionError):
        raise ModelLoadError(
            f"cannot tell the KV cache shape of model {folder.name!r}: the graph leaves it open and config.json "
            "lacks num_key_value_heads/num_attention_heads/head_dim/hidden_size"
        ) from None
    return kv_heads, head_dim
