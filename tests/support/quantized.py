"""Graphs that quantize their activations per call: their tokens depend on the CPU's integer products.

``onnxruntime.quantization.quantize_dynamic`` graphs (the ``int8`` and ``uint8``
fixtures) run MatMulInteger over activations quantized to uint8 by
DynamicQuantizeLinear. ONNX Runtime's integer GEMM (MLAS) multiplies uint8 by
int8 weights with VPMADDUBSW on AVX2 and on AVX-512 without VNNI, which adds
the products in pairs into int16 and saturates; VNNI (VPDPBUSD), AMX and ARM
sum them exactly in int32, and uint8 weights go through a kernel that widens
to int16 first and is exact everywhere. So the int8 graph's tokens are the
CPU's: the references recorded them on one instruction set
(``recorded_isa`` in ``model_references.json``), and on another the expected
tokens are what a plain ONNX Runtime loop (optimum's way of running the graph)
gives on this CPU.
"""

from __future__ import annotations

import copy
import functools
import json
import platform
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer

from fixture_models.ort_loop import plain_greedy_ids

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures"
MODELS = FIXTURES / "models"
REFERENCES: dict[str, dict[str, Any]] = json.loads((FIXTURES / "model_references.json").read_text(encoding="utf-8"))[
    "models"
]
# Recorded only for graphs whose activation scales are computed per call (their tokens depend on the split).
PER_CALL = "ort_chunked_prefill"
# What a tokenizer decodes the bytes of a character that never ended into.
REPLACEMENT_CHARACTER = "\ufffd"
# The MLAS uint8 x int8 kernels that add products pairwise into saturating int16 (Linux builds).
U8S8_SATURATES = frozenset({"avx2", "avx512"})


def cpu_isa(cpuinfo: str | None = None) -> str:
    """The instruction set MLAS picks for uint8 x int8 GEMM on this CPU, from ``/proc/cpuinfo``'s flags.

    One of ``amx``, ``avx512-vnni``, ``avx512``, ``avx-vnni``, ``avx2``, ``sse2``, in MLAS's order
    of preference (AVX-512 without VNNI replaces the AVX-VNNI kernel), or the machine's name
    (``aarch64``, ``arm64``) where there are no x86 flags to read.
    """
    if cpuinfo is None:
        path = Path("/proc/cpuinfo")
        cpuinfo = path.read_text(encoding="utf-8") if path.exists() else ""
    line = next((line for line in cpuinfo.splitlines() if line.split(":")[0].strip() == "flags"), "")
    flags = set(line.partition(":")[2].split())
    if not flags:
        return platform.machine().lower()
    if {"amx_tile", "amx_int8"} <= flags:
        return "amx"
    if {"avx512f", "avx512bw", "avx512dq", "avx512vl"} <= flags:
        return "avx512-vnni" if "avx512_vnni" in flags else "avx512"
    if {"avx2", "fma"} <= flags:
        return "avx-vnni" if "avx_vnni" in flags else "avx2"
    return "sse2"


def eos_ids(model: dict[str, Any]) -> set[int]:
    configured = model["generation_config"]["eos_token_id"]
    return set(configured) if isinstance(configured, list) else {configured}


def recorded_ids(case: dict[str, Any], chunk: int | None) -> list[int] | None:
    """The ids the references hold for this prefill split, if they hold any."""
    if chunk is None or PER_CALL not in case:
        return case["output_ids"]
    chunked = case[PER_CALL]
    return chunked["output_ids"] if chunked["chunk_tokens"] == chunk else None


def case_ids(name: str, index: int, *, chunk: int | None, exact_u8s8: bool = False) -> list[int]:
    """What :func:`plain_greedy_ids` gives for a recorded request to the model ``name``."""
    model = REFERENCES[name]
    case = model["cases"][index]
    return plain_greedy_ids(
        MODELS / model["folder"] / model["graph"],
        prompt_ids=case["prompt_ids"],
        max_new_tokens=case["request"]["max_output_tokens"],
        chunk=chunk,
        repetition_penalty=float(model["generation_config"].get("repetition_penalty") or 1.0),
        eos_token_ids=eos_ids(model),
        exact_u8s8=exact_u8s8,
    )


@functools.cache
def _expected(name: str, index: int, chunk: int | None) -> dict[str, Any]:
    model = REFERENCES[name]
    case = model["cases"][index]
    if PER_CALL not in case:
        return case
    ids = case_ids(name, index, chunk=chunk)
    recorded, isa = recorded_ids(case, chunk), cpu_isa()
    if recorded is not None and isa == model["recorded_isa"]:
        assert ids == recorded, f"{name}: onnxruntime gives {ids} on {isa}, the references recorded {recorded} there"
    ended = bool(ids) and ids[-1] in eos_ids(model)
    text = Tokenizer.from_file(str(MODELS / model["folder"] / "tokenizer.json")).decode(ids[:-1] if ended else ids)
    return {**case, "output_ids": ids, "output_tokens": len(ids), "ended_on_eos": ended, "text": text}


def expected_case(name: str, index: int, *, chunk: int | None) -> dict[str, Any]:
    """The recorded case, with the output this CPU's ONNX Runtime gives where the graph quantizes per call.

    ``chunk`` is the prefill split (None: the whole prompt in one call); it matters only to such
    graphs. Their ids come from :func:`plain_greedy_ids`, and must equal the recorded ones where
    this CPU has the instruction set they were recorded on.

    ``shown_text`` is the text a client is shown: the exporting tool's decode
    (``text``) less the bytes of a character the generation ended inside,
    which decode to U+FFFD there and are dropped by the service (issue 41).
    """
    case = copy.deepcopy(_expected(name, index, chunk))
    case["shown_text"] = case["text"].rstrip(REPLACEMENT_CHARACTER)
    return case
