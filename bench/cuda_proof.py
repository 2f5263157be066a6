"""The one prepared script for a lent GPU: proves the ONNX Runtime backend's CUDA path, section by section.

Run it on the device as one call (docs/cuda.md says how to bring onnxruntime-gpu there first):

    PYTHONPATH=/tmp/ortgpu python3 bench/cuda_proof.py            # ~5-10 min on an H200

and here, on the CPU, as a dry run that proves its logic (every section runs, CPU stands in for CUDA):

    .venv/bin/python bench/cuda_proof.py --device cpu --quick     # ~2 min on 2 cores

Sections, in order: environment and CUDA libraries; placement (providers, nodes per provider,
Memcpy nodes); the KV cache staying on the device (zero-length past at step 0); CUDA vs CPU
logits and greedy tokens with TF32 off and on; each fixture layout's recorded tokens; chunked
prefill and resume; float16 graphs; ms per decode step at 128/1k/4k split into the session
run and the sampler, with CPU time per wall second; GPU memory after load, after long
generations, after close, and an arena cap; the missing-library failure path; the batched
engine; device picks (greedy rows picked on the device, only the others' logits copied); the
engine process beside the engine in process and the plain loop at 1, 8 and 32 rows (issue 44). Every
result is printed as it comes ([PASS]/[FAIL]/[INFO]) and, with $OUT set (or
--out), written as JSON. A section that raises is recorded and the next one runs; one that
would overrun --budget-s is skipped and says so. Exit status: 0 when no check failed, 1 otherwise.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import logging
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import numpy as np  # noqa: E402
import onnx  # noqa: E402
import onnxruntime as ort  # noqa: E402

from fixture_models.demo import build_demo_model  # noqa: E402
from workers.backends.base import EngineObserver, SamplingParams, Step  # noqa: E402
from workers.backends.errors import ModelLoadError  # noqa: E402
from workers.backends.onnx.cuda_libs import build_cuda_major, preload_cuda_libraries  # noqa: E402
from workers.backends.onnx.graph import GraphSpec, quantizes_per_call  # noqa: E402
from workers.backends.onnx.model import OnnxModel  # noqa: E402
from workers.backends.onnx.session import (  # noqa: E402
    CUDA_PROVIDER,
    cuda_device_count,
    cuda_provider_options,
    open_session,
    provider_assignment,
    session_options,
)
from workers.backends.sampling import Sampler, SamplingSettings  # noqa: E402

FIXTURES = REPO / "tests" / "fixtures"
REFERENCES: dict[str, dict[str, Any]] = json.loads((FIXTURES / "model_references.json").read_text(encoding="utf-8"))[
    "models"
]
QWEN_SAMPLING = SamplingSettings(temperature=0.7, top_k=20, top_p=0.8, repetition_penalty=1.05)
MIB = 1 << 20
WARM_UP_STEPS = 3


def never() -> bool:
    return False


# --------------------------------------------------------------------------- #
# The report
# --------------------------------------------------------------------------- #


class Report:
    """Checks and figures, printed as they come and kept for the JSON file."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.started = time.monotonic()
        self.data: dict[str, Any] = {"device": args.device, "quick": args.quick, "sections": {}}
        self.current: dict[str, Any] = {}
        self.failed = 0
        self.passed = 0

    def left_s(self) -> float:
        return self.args.budget_s - (time.monotonic() - self.started)

    @contextlib.contextmanager
    def section(self, name: str, needs_s: float) -> Iterator[bool]:
        """Runs the body unless fewer than ``needs_s`` seconds of the budget are left; records what it raised."""
        print(f"\n== {name} ({self.left_s():.0f} s of the budget left)", flush=True)
        self.current = self.data["sections"].setdefault(name, {"checks": [], "figures": {}})
        started = time.monotonic()
        if self.left_s() < needs_s:
            self.current["skipped"] = f"needs ~{needs_s:.0f} s, {self.left_s():.0f} s left"
            print(f"[SKIP] {self.current['skipped']}", flush=True)
            yield False
            return
        try:
            yield True
        except Exception as exc:  # the next section must still run
            self.failed += 1
            self.current["error"] = traceback.format_exc(limit=6)
            print(f"[FAIL] the section raised {type(exc).__name__}: {exc}", flush=True)
            print(textwrap.indent(self.current["error"], "       "), flush=True)
        finally:
            self.current["seconds"] = round(time.monotonic() - started, 2)
            gc.collect()

    def check(self, name: str, ok: bool, detail: Any = "") -> bool:
        self.current["checks"].append({"name": name, "ok": bool(ok), "detail": detail})
        if ok:
            self.passed += 1
        else:
            self.failed += 1
        print(f"[{'PASS' if ok else 'FAIL'}] {name}{': ' if detail != '' else ''}{detail}", flush=True)
        return bool(ok)

    def info(self, name: str, value: Any) -> None:
        self.current["figures"][name] = value
        print(f"[INFO] {name}: {value}", flush=True)

    def save(self) -> Path | None:
        self.data["summary"] = {
            "passed": self.passed,
            "failed": self.failed,
            "seconds": round(time.monotonic() - self.started, 1),
        }
        target = self.args.out or (Path(os.environ["OUT"]) / "cuda_proof.json" if os.environ.get("OUT") else None)
        if target is None:
            return None
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(json.dumps(self.data, indent=1, default=str), encoding="utf-8")
        return target


class Captured(logging.Handler):
    """The backend's log records while a block runs (placement lines, warnings)."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    def messages(self, level: int = logging.INFO) -> list[str]:
        return [r.getMessage() for r in self.records if r.levelno >= level]


@contextlib.contextmanager
def captured_logs() -> Iterator[Captured]:
    handler, logger = Captured(), logging.getLogger("workers")
    previous = logger.level
    logger.setLevel(logging.INFO)
    logger.addHandler(handler)
    try:
        yield handler
    finally:
        logger.removeHandler(handler)
        logger.setLevel(previous)


# --------------------------------------------------------------------------- #
# Models and loops
# --------------------------------------------------------------------------- #


@dataclass(frozen=True)
class Graph:
    """One graph to try: a name for the report, its folder and its path inside it."""

    name: str
    folder: Path
    graph: str = "model.onnx"


def demo_graphs(root: Path, quick: bool) -> dict[str, Graph]:
    """The demo models the project builds (``lmsp_build_demo_model``): ``demo``, ``small``, ``base``, ``endless``."""
    sizes = {"demo": "demo"} if quick else {"demo": "demo", "small": "small", "base": "base"}
    graphs = {}
    for name, size in sizes.items():
        if not (root / name / "model.onnx").is_file():
            build_demo_model(root / name, size=size)
        graphs[name] = Graph(f"demo:{name}", root / name)
    # The same weights without the EOS head: generations as long as asked, for resume and memory.
    if not (root / "endless" / "model.onnx").is_file():
        build_demo_model(root / "endless", size="demo", endless=True)
    graphs["endless"] = Graph("demo:endless", root / "endless")
    # Demo's shape with Qwen's 151,936 logits a row (padded): what a real vocabulary costs a step.
    if not (root / "wide" / "model.onnx").is_file():
        build_demo_model(root / "wide", size="wide", endless=True)
    graphs["wide"] = Graph("demo:wide", root / "wide")
    return graphs


def fixture_graphs(quick: bool) -> dict[str, Graph]:
    keys = ["qwen2-community", "qwen2-community:fp16", "llama-genai"] if quick else list(REFERENCES)
    return {key: Graph(key, FIXTURES / "models" / REFERENCES[key]["folder"], REFERENCES[key]["graph"]) for key in keys}


def load(graph: Graph, device: str, **kwargs: Any) -> OnnxModel:
    return OnnxModel(graph.folder, graph=graph.graph, device=device, intra_op_threads=1, **kwargs)


def synthetic_ids(model: OnnxModel, count: int, salt: int = 0) -> list[int]:
    """Ordinary token ids (no special ones: those sit at the end of these vocabularies)."""
    vocab = model.tokenizer.get_vocab_size(with_added_tokens=True)
    return [((i + salt) * 7919) % (vocab - 16) + 8 for i in range(count)]


class RawDecoder:
    """A plain IOBinding loop on one session: what the backend's own loop is measured against.

    The presents stay where the session computed them and come back as the
    next call's past; only the logits are bound to the host.
    """

    def __init__(self, session: ort.InferenceSession, graph: GraphSpec, device: str, device_id: int = 0) -> None:
        self.session, self.graph, self.device, self.device_id = session, graph, device, device_id
        empty = [1, graph.kv_heads, 0, graph.head_dim]
        self.past = [
            ort.OrtValue.ortvalue_from_shape_and_type(empty, graph.kv_dtype, device, device_id)
            for _ in graph.past_names
        ]
        self.length = 0

    def feed(self, ids: Sequence[int]) -> np.ndarray:
        graph, names = self.graph, self.graph.names
        binding = self.session.io_binding()
        total = self.length + len(ids)
        binding.bind_cpu_input(names.input_ids, np.asarray([ids], dtype=graph.input_ids_dtype))
        binding.bind_cpu_input(names.attention_mask, np.ones((1, total), dtype=graph.attention_mask_dtype))
        if graph.has_position_ids:
            positions = np.arange(self.length, total, dtype=graph.position_ids_dtype)[None, :]
            binding.bind_cpu_input(names.position_ids, positions)
        if graph.use_cache_branch is not None:
            binding.bind_cpu_input(graph.use_cache_branch, np.array([self.length > 0], dtype=np.bool_))
        for name, value in zip(graph.past_names, self.past, strict=True):
            binding.bind_ortvalue_input(name, value)
        binding.bind_output(names.logits, "cpu")
        for name in graph.present_names:
            binding.bind_output(name, self.device, self.device_id)
        self.session.run_with_iobinding(binding)
        outputs = binding.get_outputs()
        self.past = outputs[1:]
        self.length = total
        return outputs[0].numpy()[0, -1].astype(np.float32)

    def feed_chunked(self, ids: Sequence[int], chunk: int = 512) -> np.ndarray:
        row = None
        for start in range(0, len(ids), chunk):
            row = self.feed(ids[start : start + chunk])
        assert row is not None
        return row

    def cache_devices(self) -> set[str]:
        return {value.device_name().lower() for value in self.past}


def raw_decoder(model: OnnxModel, device: str, *, use_tf32: bool = False) -> RawDecoder:
    """A plain loop on a fresh session of the model's graph (TF32 as asked) on ``device``."""
    session, device_type = open_session(
        graph_path(model), device, 0, 1, False, where=f"the proof's session of {model.where}", use_tf32=use_tf32
    )
    return RawDecoder(session, model.graph, device_type)


def graph_path(model: OnnxModel) -> Path:
    return model.folder / model.graph_file


def greedy_run(decoder: RawDecoder, prompt: Sequence[int], steps: int) -> tuple[list[int], list[np.ndarray]]:
    rows, tokens = [decoder.feed_chunked(prompt)], []
    for _ in range(steps):
        tokens.append(int(np.argmax(rows[-1])))
        rows.append(decoder.feed([tokens[-1]]))
    return tokens, rows


def forced_rows(decoder: RawDecoder, prompt: Sequence[int], tokens: Sequence[int]) -> list[np.ndarray]:
    """The logits rows after the prompt and after each of ``tokens`` (teacher-forced: the same inputs everywhere)."""
    rows = [decoder.feed_chunked(prompt)]
    rows.extend(decoder.feed([token]) for token in tokens)
    return rows


def margin(row: np.ndarray) -> float:
    top = np.partition(row, len(row) - 2)[-2:]
    return float(abs(top[1] - top[0]))


def generated(model: OnnxModel, prompt: Sequence[int], params: SamplingParams, limit: int | None = None) -> list[int]:
    tokens = []
    for step in model.generate(list(prompt), params, should_stop=never):
        if step.token_id is not None:
            tokens.append(step.token_id)
        if limit is not None and len(tokens) >= limit:
            break
    return tokens


def first_difference(a: Sequence[int], b: Sequence[int]) -> int | None:
    for index, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return index
    return None if len(a) == len(b) else min(len(a), len(b))


def gpu_memory_mib(device_id: int = 0) -> int | None:
    """Device memory in use, as nvidia-smi reports it (all processes); None without nvidia-smi."""
    if shutil.which("nvidia-smi") is None:
        return None
    try:
        out = subprocess.run(
            ["nvidia-smi", f"--id={device_id}", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=20,
            check=True,
        ).stdout
        return int(out.strip().splitlines()[0])
    except (subprocess.SubprocessError, ValueError, IndexError, OSError):
        return None


def ms(seconds: float) -> float:
    return round(seconds * 1000, 3)


# --------------------------------------------------------------------------- #
# Sections
# --------------------------------------------------------------------------- #


def environment_section(args: argparse.Namespace, report: Report) -> None:
    report.info("python", platform.python_version())
    report.info("numpy", np.__version__)
    report.info("onnxruntime", f"{ort.__version__} from {Path(ort.__file__).parent}")
    report.info("providers built", ort.get_available_providers())
    report.info("CUDA major of the build", build_cuda_major())
    report.info("CUDA devices (driver)", cuda_device_count())
    report.info("cpu count", os.cpu_count())
    if shutil.which("nvidia-smi"):
        smi = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=20, check=False)
        report.info("nvidia-smi -L", smi.stdout.strip())
    report.data["gpu_memory_baseline_mib"] = gpu_memory_mib()
    report.info("GPU memory in use before any session (MiB)", report.data["gpu_memory_baseline_mib"])
    if args.device != "cuda":
        return
    libraries = preload_cuda_libraries()
    report.info("CUDA libraries loaded", libraries.loaded)
    report.check("the CUDA libraries load", libraries.ok, "" if libraries.ok else libraries.problem())
    report.check("onnxruntime has the CUDA provider", CUDA_PROVIDER in ort.get_available_providers())
    report.check("the driver reports a device", cuda_device_count() >= 1)


def optimized_memcpy_nodes(path: Path, device: str, scratch: Path) -> int:
    """Memcpy nodes in the graph ORT writes after partitioning (If branches included)."""
    options = session_options(1, False)
    written = scratch / f"optimized-{path.parent.name}-{path.stem}.onnx"
    options.optimized_model_filepath = str(written)
    providers: list[Any] = ["CPUExecutionProvider"]
    if device == "cuda":
        providers = [(CUDA_PROVIDER, cuda_provider_options(0)), "CPUExecutionProvider"]
    ort.InferenceSession(str(path), options, providers=providers)

    def count(graph: Any) -> int:
        total = 0
        for node in graph.node:
            total += node.op_type.startswith("Memcpy")
            for attribute in node.attribute:
                if attribute.g is not None and attribute.g.node:
                    total += count(attribute.g)
        return total

    return count(onnx.load(str(written), load_external_data=False).graph)


def recorded_memcpy_nodes(session: ort.InferenceSession) -> int | None:
    try:
        subgraphs = session.get_provider_graph_assignment_info()
    except Exception:  # not recorded by this build
        return None
    return sum(node.op_type.startswith("Memcpy") for sub in subgraphs for node in sub.get_nodes())


def placement_section(args: argparse.Namespace, report: Report, graphs: dict[str, Graph], scratch: Path) -> None:
    expected = CUDA_PROVIDER if args.device == "cuda" else "CPUExecutionProvider"
    for graph in graphs.values():
        with captured_logs() as logs:
            try:
                model = load(graph, args.device)
            except ModelLoadError as exc:
                report.check(f"{graph.name} loads on {args.device}", False, str(exc))
                continue
        try:
            nodes = provider_assignment(model.session)
            figures = {
                "providers": model.session.get_providers(),
                "nodes": nodes,
                # Whether the partitioner's record has ORT's Memcpy nodes too (believed not: they come later).
                "memcpy_nodes_recorded": recorded_memcpy_nodes(model.session),
                "log": logs.messages(),
            }
            try:
                figures["memcpy_nodes_in_optimized_graph"] = optimized_memcpy_nodes(
                    graph_path(model), args.device, scratch
                )
            except Exception as exc:  # writing the optimized graph is a diagnosis, not the proof
                figures["memcpy_nodes_in_optimized_graph"] = f"not written: {exc}"
            report.info(f"{graph.name} placement", figures)
            report.check(f"{graph.name} runs on {expected}", model.provider == expected, model.session.get_providers())
            report.check(
                f"{graph.name}: ORT's silent CPU fallback is off",
                getattr(model.session, "_enable_fallback", None) is False,
            )
        finally:
            model.close()


def kv_section(args: argparse.Namespace, report: Report, graphs: dict[str, Graph]) -> None:
    for graph in graphs.values():
        model = load(graph, args.device)
        try:
            decoder = RawDecoder(model.session, model.graph, model.device_type)
            step0 = decoder.cache_devices()
            report.check(
                f"{graph.name}: the zero-length past at step 0 lies on {args.device}",
                all(d.startswith(args.device) for d in step0),
                sorted(step0),
            )
            prompt = synthetic_ids(model, 17)
            decoder.feed(prompt)
            seen, lengths = set(decoder.cache_devices()), [decoder.past[0].shape()[2]]
            token = 0
            for _ in range(24):
                token = int(np.argmax(decoder.feed([token])))
                seen |= decoder.cache_devices()
                lengths.append(decoder.past[0].shape()[2])
            report.check(
                f"{graph.name}: every present stays on {args.device} through 25 calls",
                seen and all(d.startswith(args.device) for d in seen),
                sorted(seen),
            )
            report.check(
                f"{graph.name}: the cache grows by one position a step",
                lengths == list(range(17, 17 + 25)),
                f"{lengths[0]}..{lengths[-1]}",
            )
        finally:
            model.close()


def logits_section(args: argparse.Namespace, report: Report, graphs: dict[str, Graph]) -> None:
    """CUDA against CPU on float32 graphs: logits on the same inputs, and free-running greedy tokens."""
    steps = 16 if args.quick else 64
    for graph in graphs.values():
        cpu_model = load(graph, "cpu")
        model = load(graph, args.device)
        try:
            if model.graph.float16:
                continue
            prompt = synthetic_ids(model, min(64, model.context_length // 4))
            cpu_tokens, cpu_rows = greedy_run(RawDecoder(cpu_model.session, cpu_model.graph, "cpu"), prompt, steps)
            for tf32 in (False, True):
                label = f"{graph.name} TF32 {'on' if tf32 else 'off'}"
                decoder = raw_decoder(model, args.device, use_tf32=tf32)
                rows = forced_rows(decoder, prompt, cpu_tokens)
                diff = max(float(np.max(np.abs(a - b))) for a, b in zip(rows, cpu_rows, strict=True))
                tokens, _ = greedy_run(raw_decoder(model, args.device, use_tf32=tf32), prompt, steps)
                at = first_difference(tokens, cpu_tokens)
                detail = {
                    "max_abs_logit_diff": diff,
                    "greedy_equal_steps": steps if at is None else at,
                    "cpu_top2_margin_where_they_differ": None if at is None else margin(cpu_rows[at]),
                    "smallest_cpu_top2_margin": min(margin(r) for r in cpu_rows[:-1]),
                }
                if tf32:
                    report.info(f"{label} (for the record)", detail)
                else:
                    report.check(f"{label}: greedy tokens equal the CPU's", at is None, detail)
            backend = generated(model, prompt, SamplingParams(temperature=0, max_output_tokens=steps))
            on_cpu = generated(cpu_model, prompt, SamplingParams(temperature=0, max_output_tokens=steps))
            report.check(
                f"{graph.name}: the backend's greedy generation equals the CPU's",
                backend == on_cpu,
                f"{len(backend)} tokens, first difference at {first_difference(backend, on_cpu)}",
            )
        finally:
            model.close()
            cpu_model.close()


def fixtures_section(args: argparse.Namespace, report: Report, graphs: dict[str, Graph]) -> None:
    """Each layout's recorded greedy tokens (transformers' or the exporting tool's runtime) on the device."""
    for key, graph in graphs.items():
        model = load(graph, args.device)
        try:
            for index, case in enumerate(REFERENCES[key]["cases"]):
                params = SamplingParams(temperature=0, max_output_tokens=case["request"]["max_output_tokens"])
                tokens = generated(model, case["prompt_ids"], params)
                at = first_difference(tokens, case["output_ids"])
                detail = {"tokens": len(tokens), "first_difference": at, "recorded_margin": case["min_top2_margin"]}
                if REFERENCES[key]["reference_runtime"] == "transformers" and not quantizes_per_call(graph_path(model)):
                    report.check(f"{key} case {index}: the recorded tokens", at is None, detail)
                else:  # quantized per call or by the tool's own kernels: agreement is a figure, not a promise
                    report.info(f"{key} case {index}: agreement with the recorded tokens", detail)
        finally:
            model.close()


def resume_section(args: argparse.Namespace, report: Report, graphs: dict[str, Graph]) -> None:
    """A prompt in one call or in chunks, and a generation resumed from its snapshot, give the same tokens."""
    total = 24 if args.quick else 48
    for graph in graphs.values():
        whole = load(graph, args.device, prefill_chunk=4096)
        chunked = load(graph, args.device, prefill_chunk=64)
        try:
            prompt = synthetic_ids(whole, min(300, whole.context_length // 2 - total))
            greedy = SamplingParams(temperature=0, max_output_tokens=total)
            one_call = generated(whole, prompt, greedy)
            in_chunks = generated(chunked, prompt, greedy)
            name = f"{graph.name}: a {len(prompt)}-token prompt in one call or in chunks of 64"
            detail = f"first difference at {first_difference(one_call, in_chunks)} of {len(one_call)}"
            if whole.replays_steps:  # float16 or per-call scales: another split rounds otherwise (docs/recovery.md)
                report.info(name + " (a figure: this graph's results depend on the split)", detail)
            else:
                report.check(name, one_call == in_chunks, detail)
            sampled = SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_output_tokens=total)
            for label, params in (("greedy", greedy), ("sampled", sampled)):
                generation = whole.generate(prompt, params, should_stop=never)
                head: list[Step] = []
                for step in generation:
                    head.append(step)
                    if sum(s.token_id is not None for s in head) == total // 3:
                        break
                snapshot = json.loads(json.dumps(generation.snapshot()))
                rest = [s.token_id for s in generation if s.token_id is not None]
                resumed = [
                    s.token_id for s in whole.resume(snapshot, params, should_stop=never) if s.token_id is not None
                ]
                report.check(
                    f"{graph.name}: {label} resume after {total // 3} tokens continues token for token",
                    resumed == rest,
                    f"{len(rest)} tokens, first difference at {first_difference(resumed, rest)}",
                )
        finally:
            whole.close()
            chunked.close()


def fp16_section(args: argparse.Namespace, report: Report, pairs: Sequence[tuple[Graph, Graph]]) -> None:
    """float16 graphs: finite logits all the way, and their greedy tokens against the float32 graph's."""
    steps = 16 if args.quick else 64
    for half, full in pairs:
        fp16_model, fp32_model = load(half, args.device), load(full, args.device)
        try:
            prompt = REFERENCES[half.name]["cases"][0]["prompt_ids"]
            tokens16, rows16 = greedy_run(RawDecoder(fp16_model.session, fp16_model.graph, args.device), prompt, steps)
            tokens32, rows32 = greedy_run(RawDecoder(fp32_model.session, fp32_model.graph, args.device), prompt, steps)
            report.check(
                f"{half.name}: every logits row is finite", all(bool(np.isfinite(r).all()) for r in rows16), len(rows16)
            )
            at = first_difference(tokens16, tokens32)
            forced = forced_rows(RawDecoder(fp16_model.session, fp16_model.graph, args.device), prompt, tokens32)
            report.info(
                f"{half.name} against {full.name}",
                {
                    "greedy_equal_steps": steps if at is None else at,
                    "max_abs_logit_diff_forced": max(
                        float(np.max(np.abs(a - b))) for a, b in zip(forced, rows32, strict=True)
                    ),
                    "fp32_top2_margin_where_they_differ": None if at is None else margin(rows32[at]),
                },
            )
            # No repetition penalty (the fixture's config has one): the plain loop takes the bare argmax.
            plain_greedy = SamplingParams(temperature=0, repetition_penalty=1.0, max_output_tokens=steps)
            backend = generated(fp16_model, prompt, plain_greedy)
            report.check(
                f"{half.name}: the backend's greedy tokens equal a plain loop's", backend == tokens16[: len(backend)]
            )
        finally:
            fp16_model.close()
            fp32_model.close()


def timing_section(args: argparse.Namespace, report: Report, graphs: dict[str, Graph]) -> None:
    """ms per decode step through the backend (session run, then the sampler) against a plain loop."""
    contexts = (128, 1024) if args.quick else (128, 1024, 4096)
    steps = 8 if args.quick else 64
    for graph in graphs.values():
        model = load(graph, args.device)
        try:
            vocab = model.vocab_size
            for context in contexts:
                prompt = synthetic_ids(model, context)
                decoder = model.decoder()
                row = decoder.feed(prompt)
                samplers = {
                    "greedy": Sampler(SamplingSettings(temperature=0.0), seed=1, vocab_size=vocab),
                    "qwen": Sampler(QWEN_SAMPLING, seed=1, vocab_size=vocab, context_ids=prompt),
                }
                run_s, sample_s = [], {name: [] for name in samplers}
                for _ in range(WARM_UP_STEPS):  # first calls at new shapes allocate
                    row = decoder.feed([samplers["greedy"].sample(row)])
                wall0, cpu0 = time.perf_counter(), time.process_time()
                for _ in range(steps):
                    for name, sampler in samplers.items():
                        started = time.perf_counter()
                        token = sampler.sample(row)
                        sample_s[name].append(time.perf_counter() - started)
                    started = time.perf_counter()
                    row = decoder.feed([token])
                    run_s.append(time.perf_counter() - started)
                wall, cpu = time.perf_counter() - wall0, time.process_time() - cpu0
                plain = RawDecoder(model.session, model.graph, model.device_type)
                plain_row = plain.feed_chunked(prompt)
                for _ in range(WARM_UP_STEPS):
                    plain_row = plain.feed([int(np.argmax(plain_row))])
                plain_s = []
                for _ in range(steps):
                    started = time.perf_counter()
                    plain_row = plain.feed([int(np.argmax(plain_row))])
                    plain_s.append(time.perf_counter() - started)
                report.info(
                    f"{graph.name} at context {context}",
                    {
                        "session_run_ms_median": ms(float(np.median(run_s))),
                        "sampler_ms_median": {name: ms(float(np.median(v))) for name, v in sample_s.items()},
                        "plain_loop_ms_median": ms(float(np.median(plain_s))),
                        "cpu_seconds_per_wall_second": round(cpu / wall, 2),
                        "steps": steps,
                    },
                )
        finally:
            model.close()
    width = 151936
    rng = np.random.default_rng(0)
    rows = [(rng.normal(size=width) * 3).astype(np.float32) for _ in range(4)]
    costs = {}
    for name, settings in {
        "greedy": SamplingSettings(temperature=0.0),
        "top_p 0.9": SamplingSettings(temperature=0.7, top_p=0.9),
        "top_p 1.0": SamplingSettings(temperature=0.7),
        "top_k 20 + top_p 0.8": SamplingSettings(temperature=0.7, top_k=20, top_p=0.8),
    }.items():
        sampler = Sampler(settings, seed=1, vocab_size=width)
        sampler.sample(rows[0])
        started = time.perf_counter()
        for index in range(20):
            sampler.sample(rows[index % 4])
        costs[name] = ms((time.perf_counter() - started) / 20)
    report.info("host sampler ms per token at vocabulary 151,936", costs)


def memory_section(args: argparse.Namespace, report: Report, graphs: dict[str, Graph]) -> None:
    """GPU memory after load, after long generations, with a second model, after close; then an arena cap."""
    readings: dict[str, int | None] = {
        "before any session": report.data.get("gpu_memory_baseline_mib"),
        "at the start of this section (earlier sections' models closed)": gpu_memory_mib(),
    }
    big = graphs.get("base") or graphs["demo"]
    long_context = 1024 if args.quick else 4096
    generate_tokens = 64 if args.quick else 1024
    first = load(big, args.device)
    readings["after loading " + big.name] = gpu_memory_mib()
    decoder = first.decoder()
    row = decoder.feed(synthetic_ids(first, long_context))
    sampler = Sampler(QWEN_SAMPLING, seed=3, vocab_size=first.vocab_size)
    for _ in range(generate_tokens):
        row = decoder.feed([sampler.sample(row)])
    readings[f"after {long_context} + {generate_tokens} tokens"] = gpu_memory_mib()
    del decoder
    second = load(graphs["endless"], args.device)
    generated(second, synthetic_ids(second, 256), SamplingParams(temperature=0, max_output_tokens=generate_tokens))
    readings["with a second model loaded and run"] = gpu_memory_mib()
    first.close()
    second.close()
    del first, second
    gc.collect()
    readings["after closing both"] = gpu_memory_mib()
    report.info("GPU memory in use (MiB, nvidia-smi)", readings)
    if args.device != "cuda":
        report.info("arena cap", "not on the CPU: gpu_mem_limit is a CUDA provider option")
        return
    # A cap well above the weights and far below a 4096-token call's attention scores
    # (8 heads x 4096 x 4096 floats on demo:small: 512 MiB): the load fits, the call does not.
    small = graphs.get("small") or graphs["demo"]
    weights = sum(p.stat().st_size for p in small.folder.glob("model.onnx*"))
    cap = 2 * weights + 64 * MIB
    try:
        session, _ = open_session(
            small.folder / small.graph, "cuda", 0, 1, False, where=f"{small.name} capped", gpu_mem_limit=cap
        )
    except ModelLoadError as exc:
        report.check(f"a session capped at {cap // MIB} MiB loads {small.name}", False, str(exc))
        return
    probe = load(small, "cpu")
    capped = RawDecoder(session, probe.graph, "cuda")
    try:
        capped.feed(synthetic_ids(probe, 4096))
        outcome = "the 4096-token call fit under the cap"
        failed_cleanly = False
    except Exception as exc:  # what the cap must produce: an error, not a CPU session
        outcome = f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"
        failed_cleanly = True
    finally:
        probe.close()
    report.check(
        f"an arena capped at {cap // MIB} MiB refuses a 4096-token call and stays on CUDA",
        failed_cleanly and session.get_providers()[0] == CUDA_PROVIDER,
        {"outcome": outcome, "providers after": session.get_providers()},
    )


_CHILD = r"""
import json, logging, sys, tempfile
from pathlib import Path
sys.path.insert(0, sys.argv[1])
from workers.backends.onnx import cuda_libs, session
from workers.backends.onnx.model import OnnxModel
from workers.backends.errors import ModelLoadError
mode, folder, pretend_driver = sys.argv[2], Path(sys.argv[3]), sys.argv[4] == "1"
if pretend_driver:  # the dry run on a machine without a GPU: the driver is the one part made up
    session.cuda_device_count = lambda: 1
if mode == "injected":  # an empty install: nothing in the nvidia folders, the system path not searched
    empty = Path(tempfile.mkdtemp())
    session.preload_cuda_libraries = lambda: cuda_libs.probe_cuda_libraries([empty], system=False)
else:  # "hidden": no nvidia pip folders; whatever the system loader's path has decides
    cuda_libs.nvidia_library_dirs = lambda paths: []
records = []
handler = logging.Handler(logging.WARNING)
handler.emit = lambda record: records.append(record.getMessage())
logging.getLogger("workers").addHandler(handler)
result = {}
model = OnnxModel(folder, device="auto", intra_op_threads=1)
result["auto_provider"] = model.provider
model.close()
result["auto_warnings"] = list(records)
try:
    OnnxModel(folder, device="cuda", intra_op_threads=1).close()
    result["cuda"] = "loaded"
except ModelLoadError as exc:
    result["cuda"] = f"ModelLoadError: {exc}"
print("RESULT " + json.dumps(result))
"""


def missing_libraries_section(args: argparse.Namespace, report: Report, graphs: dict[str, Graph]) -> None:
    """In fresh processes (a process loads the libraries once): the CUDA libraries not there."""
    pretend = "1" if cuda_device_count() == 0 else "0"
    for mode in ("injected", "hidden"):
        child = subprocess.run(
            [sys.executable, "-c", _CHILD, str(REPO), mode, str(graphs["demo"].folder), pretend],
            capture_output=True,
            text=True,
            timeout=300,
            check=False,
        )
        lines = [line for line in child.stdout.splitlines() if line.startswith("RESULT ")]
        if not lines:
            report.check(f"{mode}: the child process reported", False, child.stderr[-2000:])
            continue
        result = json.loads(lines[-1][len("RESULT ") :])
        noise = [
            line
            for line in child.stdout.splitlines() + child.stderr.splitlines()
            if "cuDNN" in line or "Falling back" in line
        ]
        report.info(f"{mode}: what the child saw", {**result, "onnxruntime's own lines": noise})
        if mode == "injected" or result["auto_provider"] == "CPUExecutionProvider":
            report.check(
                f"{mode}: auto runs on the CPU after exactly one warning that names the libraries",
                result["auto_provider"] == "CPUExecutionProvider"
                and len(result["auto_warnings"]) == 1
                and "libcublas" in result["auto_warnings"][0],
                result["auto_warnings"],
            )
            report.check(
                f"{mode}: cuda fails the load (model_load_failed) naming them",
                result["cuda"].startswith("ModelLoadError") and "pip install" in result["cuda"],
                result["cuda"][:400],
            )
            report.check(f"{mode}: none of onnxruntime's own lines blaming cuDNN", not noise, noise)
        else:
            report.info(f"{mode}: the system loader's path has the libraries, so CUDA ran", result["auto_provider"])


class _StepTimes(EngineObserver):
    """An engine observer (``EngineObserver``) that keeps the decode step times and the widest batch."""

    def __init__(self) -> None:
        self.steps: list[float] = []
        self.widest = 0

    def step(self, *, rows: int, seconds: float) -> None:
        self.steps.append(seconds)
        self.widest = max(self.widest, rows)

    def prefill(self, *, tokens: int, seconds: float) -> None: ...
    def queue_wait(self, seconds: float) -> None: ...
    def kv(self, *, in_use: int, budget: int) -> None: ...
    def rows(self, *, running: int, waiting: int) -> None: ...
    def close(self) -> None: ...


def _engine_rows(
    model: OnnxModel,
    prompts: Sequence[list[int]],
    tokens: Sequence[int],
    *,
    max_batch: int,
    watch: bool = False,
    device_picks: bool = False,
    params: Callable[[int, int], SamplingParams] | None = None,
    engine: Any = None,
) -> tuple[list[list[int]], float, _StepTimes, list[dict[str, Any]]]:
    """Run the prompts as rows of one batch engine (staggered, so rows join and leave); tokens, seconds, steps.

    ``engine``: one already made (and closed by the caller) with ``model``, such as an engine process's
    (``RemoteModel.engine``); by default a new ``BatchEngine`` in this process."""
    import threading

    from workers.backends.onnx.engine import BatchEngine

    times = _StepTimes()
    own = engine is None
    if own:
        engine = BatchEngine(
            model,
            max_batch=max_batch,
            kv_budget_bytes=0,
            delta_tokens=16,
            delta_seconds=0.05,
            observer=times,
            device_picks=device_picks,
        )
    results: list[list[int]] = [[] for _ in prompts]
    seen: list[dict[str, Any]] = []

    def submit(index: int) -> None:
        time.sleep(0.002 * (index % 4))
        if params is None:
            asked = SamplingParams(temperature=0, max_output_tokens=tokens[index])
        else:
            asked = params(index, tokens[index])
        generation = model.generate(prompts[index], asked, should_stop=lambda: False)
        for chunk in engine.submit(generation):
            results[index].extend(step.token_id for step in chunk.steps if step.token_id is not None)

    threads = [threading.Thread(target=submit, args=(i,)) for i in range(len(prompts))]
    started = time.perf_counter()
    for thread in threads:
        thread.start()
    while watch and any(thread.is_alive() for thread in threads):
        state = engine.snapshot()
        if state["cache_bytes"]:
            seen.append(state)
        time.sleep(0.002)
    for thread in threads:
        thread.join()
    seconds = time.perf_counter() - started
    if own:
        engine.close()
    return results, seconds, times, seen


def batched_section(
    args: argparse.Namespace, report: Report, graphs: dict[str, Graph], sweep: dict[str, Graph]
) -> None:
    """The batch engine on the device: the cache stays there through joins and leaves, rows keep
    their tokens (equal to the same requests alone, and to the CPU on fp32), and the sweep of
    aggregate tokens/s at 1, 2, 4, 8, 16, 32 rows."""
    for graph in graphs.values():
        model = load(graph, args.device)
        try:
            prompts = [synthetic_ids(model, 20 + 9 * i, salt=i) for i in range(6)]
            tokens = [12 + 7 * i for i in range(6)]
            got, _, times, seen = _engine_rows(model, prompts, tokens, max_batch=3, watch=True)
            alone = []
            for prompt, count in zip(prompts, tokens, strict=True):
                params = SamplingParams(temperature=0, max_output_tokens=count)
                steps = model.generate(prompt, params, should_stop=lambda: False)
                alone.append([step.token_id for step in steps if step.token_id is not None])
            report.check(f"{graph.name}: rows joining and leaving give the tokens of each request alone", got == alone)
            report.check(
                f"{graph.name}: the batch cache stays on {args.device} through joins and leaves",
                bool(seen) and all(state["cache_on_device"] for state in seen),
                f"{len(seen)} looks, widest {max((s['cache_width'] for s in seen), default=0)} positions",
            )
            report.info(f"{graph.name}: widest batch in that run", times.widest)
            if args.device == "cuda" and not model.graph.float16:
                cpu = load(graph, "cpu")
                try:
                    on_cpu, _, _, _ = _engine_rows(cpu, prompts, tokens, max_batch=3)
                finally:
                    cpu.close()
                report.check(f"{graph.name}: batched tokens on CUDA equal the CPU's (fp32, TF32 off)", got == on_cpu)
        finally:
            model.close()
    for key, graph in sweep.items():
        if args.quick and key != "endless":
            continue
        model = load(graph, args.device)
        try:
            count = 64 if args.quick else 256
            figures = {}
            for rows in (1, 2, 4) if args.quick else (1, 2, 4, 8, 16, 32):
                prompts = [synthetic_ids(model, 128, salt=i) for i in range(rows)]
                made, seconds, times, _ = _engine_rows(model, prompts, [count] * rows, max_batch=rows)
                steps = sorted(times.steps) or [0.0]
                # Counted, not assumed: a row that meets its end-of-text token stops early (the first
                # H200 run credited demo's one row with 256 tokens it never made: 10,583 tokens/s).
                generated = sum(len(tokens) for tokens in made)
                figures[rows] = {
                    "tokens_per_s": round(generated / seconds, 1),
                    "tokens": generated,
                    "step_ms_p50": round(1000 * steps[len(steps) // 2], 3),
                    "step_ms_p99": round(1000 * steps[min(len(steps) - 1, int(len(steps) * 0.99))], 3),
                }
                report.info(f"{graph.name}: {rows} rows x {count} tokens", figures[rows])
            base = figures[1]["tokens_per_s"]
            report.info(
                f"{graph.name}: aggregate speed-up over 1 row",
                {rows: round(f["tokens_per_s"] / base, 2) for rows, f in figures.items()},
            )
        finally:
            model.close()


def engine_process_section(args: argparse.Namespace, report: Report, graphs: dict[str, Graph]) -> None:
    """Issue 44 on the device: the batch engine in a worker's engine process (``workers.engine_process``)
    against the same engine in this process and a plain batched IOBinding greedy loop (``plain_loop.py``),
    at 1, 8 and 32 rows of greedy tokens: aggregate tokens/s side by side, and the engine process's tokens
    equal the in-process engine's. The whole service (web, Celery, a database) does not run here: the device
    has no Redis; ``concurrency.py`` measures it on a host that has."""
    from plain_loop import PlainLoop

    from workers.engine_process.client import model_load

    count = 64 if args.quick else 256
    for graph in graphs.values():
        local = load(graph, args.device)
        remote = model_load(
            "onnxruntime",
            graph.folder,
            silence_seconds=30,
            start_seconds=120,
            graph=graph.graph,
            device=args.device,
            intra_op_threads=1,
        )
        engine = remote.engine(max_batch=32, kv_budget_bytes=0, delta_tokens=16, delta_seconds=0.05)
        plain = PlainLoop(graph.folder, threads=1, device=args.device)
        try:
            report.info(f"{graph.name}: the engine process's provider", remote.provider)
            figures = {}
            for rows in (1, 8) if args.quick else (1, 8, 32):
                prompts = [synthetic_ids(local, 128, salt=i) for i in range(rows)]
                here, here_s, _, _ = _engine_rows(local, prompts, [count] * rows, max_batch=rows)
                there, there_s, _, _ = _engine_rows(remote, prompts, [count] * rows, max_batch=rows, engine=engine)
                plain.generate(prompts[0], rows, 3)  # this batch size's first run
                loop = plain.generate(prompts[0], rows, count)
                # Counted, not assumed: demo:base meets its end-of-text token (the plain loop makes all it is asked).
                made_here, made_there = sum(map(len, here)), sum(map(len, there))
                figures[rows] = {
                    "engine_process_tokens_per_s": round(made_there / there_s, 1),
                    "in_process_tokens_per_s": round(made_here / here_s, 1),
                    "plain_loop_tokens_per_s": round(rows * count / loop["seconds"], 1),
                }
                figures[rows]["engine_process_over_plain"] = round(
                    figures[rows]["engine_process_tokens_per_s"] / figures[rows]["plain_loop_tokens_per_s"], 3
                )
                report.info(f"{graph.name}: {rows} rows x {count} tokens", figures[rows])
                report.check(
                    f"{graph.name}, {rows} rows: the engine process's tokens equal the engine's here", here == there
                )
            report.info(
                f"{graph.name}: engine process / plain loop",
                {r: f["engine_process_over_plain"] for r, f in figures.items()},
            )
        finally:
            remote.close()
            local.close()


def _mixed(index: int, tokens: int) -> SamplingParams:
    """Every other row greedy (picked on the device: plain, or penalised and picked from its candidates),
    the rest seeded (brought whole)."""
    if index % 4 == 0:
        return SamplingParams(temperature=0, repetition_penalty=1.0, max_output_tokens=tokens)
    if index % 4 == 2:
        return SamplingParams(
            temperature=0, repetition_penalty=1.1, frequency_penalty=0.5, presence_penalty=0.2, max_output_tokens=tokens
        )
    return SamplingParams(temperature=0.8, top_p=0.9, seed=100 + index, max_output_tokens=tokens)


def picks_section(args: argparse.Namespace, report: Report, graphs: dict[str, Graph], wide: Graph) -> None:
    """Device picks (``step_picks``): a decode step's plain greedy rows picked where the logits lie, only
    the other rows' logits copied to the host. Same tokens as the host path on the same device; the
    bytes and the step time at 1-32 rows of the 151,936-wide model, with and without."""
    for graph in graphs.values():
        model = load(graph, args.device)
        try:
            prompts = [synthetic_ids(model, 20 + 9 * i, salt=i) for i in range(6)]
            tokens = [12 + 7 * i for i in range(6)]
            runs = {
                picks: _engine_rows(model, prompts, tokens, max_batch=6, device_picks=picks, params=_mixed)[0]
                for picks in (False, True)
            }
            same = runs[True] == runs[False]
            where = [first_difference(a, b) for a, b in zip(runs[True], runs[False], strict=True)]
            report.check(
                f"{graph.name}: greedy rows picked on {args.device}, seeded ones beside them: the host path's tokens",
                same,
                "" if same else where,
            )
        finally:
            model.close()
    model = load(wide, args.device)
    try:
        width = model.vocab_size
        count = 32 if args.quick else 128
        for rows in (1, 8) if args.quick else (1, 8, 32):
            prompts = [synthetic_ids(model, 64, salt=i) for i in range(rows)]
            figures: dict[str, Any] = {}
            made: dict[bool, list[list[int]]] = {}
            for picks in (False, True):
                plain = lambda index, tokens: SamplingParams(  # noqa: E731
                    temperature=0, repetition_penalty=1.0, max_output_tokens=tokens
                )
                got, seconds, times, _ = _engine_rows(
                    model, prompts, [count] * rows, max_batch=rows, device_picks=picks, params=plain
                )
                made[picks] = got
                steps = sorted(times.steps) or [0.0]
                figures["device" if picks else "host"] = {
                    "tokens_per_s": round(sum(len(t) for t in got) / seconds, 1),
                    "step_ms_p50": round(1000 * steps[len(steps) // 2], 3),
                    # An id, a peak, a NaN flag and the best score with its id, against the whole row.
                    "host_bytes_per_step": rows * (8 + 4 + 1 + 4 + 8) if picks else rows * width * 4,
                }
            report.check(
                f"{wide.name}: {rows} greedy rows: the same tokens picked on the device", made[True] == made[False]
            )
            report.info(f"{wide.name}: {rows} greedy rows x {count} tokens, host vs device picks", figures)
    finally:
        model.close()


def prefix_section(args: argparse.Namespace, report: Report, graphs: dict[str, Graph]) -> None:
    """The prefix cache (issue 29): a chain of turns, each prompt the last one, its answer and new ids,
    through one engine with the cache: the same tokens as each turn alone on the same device, the hits
    the rule gives, the entries kept on the device, and each later turn's time with and without it."""
    from workers.backends.onnx.engine import BatchEngine

    turns = 3 if args.quick else 5
    for graph in graphs.values():
        # Chunks of 32: a float16 graph reuses whole chunks of its prompts, which a short prompt then has.
        model = load(graph, args.device, prefill_chunk=32)
        try:
            engines = {
                cached: BatchEngine(
                    model,
                    max_batch=2,
                    kv_budget_bytes=1 << 30,
                    delta_tokens=16,
                    delta_seconds=0.05,
                    prefix_cache=cached,
                )
                for cached in (True, False)
            }
            params = SamplingParams(temperature=0, max_output_tokens=12)
            prompt = synthetic_ids(model, 300 if not args.quick else 120, salt=7)
            same, hits, seconds = True, [], {True: [], False: []}
            answer: list[int] = []
            for turn in range(turns):
                if turn:
                    prompt = [*prompt, *answer, *synthetic_ids(model, 20, salt=100 + turn)]
                alone = generated(model, prompt, params)
                for cached, engine in engines.items():
                    generation = model.generate(prompt, params, should_stop=never)
                    started = time.perf_counter()
                    list(engine.submit(generation))
                    seconds[cached].append(ms(time.perf_counter() - started))
                    same &= generation.generated_ids == alone
                    if cached:
                        hits.append(generation.cached_tokens)
                        answer = generation.generated_ids
            cache = engines[True].prefix_cache
            report.check(f"{graph.name}: every turn with the cache gives its tokens alone on {args.device}", same)
            usable = cache is not None
            report.check(
                f"{graph.name}: later turns start from the cache" if usable else f"{graph.name}: no cache (per call)",
                all(hits[1:]) if usable else not any(hits),
                hits,
            )
            if usable:
                report.check(
                    f"{graph.name}: the entries stay on {args.device}",
                    cache.devices() <= {args.device},
                    cache.devices(),
                )
            report.info(
                f"{graph.name}: turn ms with / without the cache", {"with": seconds[True], "without": seconds[False]}
            )
            for engine in engines.values():
                engine.close()
        finally:
            model.close()


# --------------------------------------------------------------------------- #


SECTIONS = ("environment", "placement", "kv", "logits", "fixtures", "resume", "fp16", "timing", "memory", "libraries")
SECTIONS += ("batched", "picks", "prefix", "engine_process")
# The float32 fixture layouts, compared with the CPU token for token; the float16 ones against this one.
FP32_FIXTURES = ("qwen2-community", "qwen2-tiny", "llama-tiny", "phi3-tiny", "gpt2-tiny", "llama-genai", "phi3-legacy")
FP32_PAIR = "qwen2-community"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="cpu: the dry run")
    parser.add_argument("--quick", action="store_true", help="fewer models, steps and contexts")
    parser.add_argument("--budget-s", type=float, default=540.0, help="sections that would overrun it are skipped")
    parser.add_argument("--sections", default=",".join(SECTIONS), help=f"a subset of {','.join(SECTIONS)}")
    parser.add_argument("--models-dir", type=Path, default=None, help="where the demo models are built (a temp dir)")
    parser.add_argument("--out", type=Path, default=None, help="the JSON file (default $OUT/cuda_proof.json)")
    args = parser.parse_args()
    wanted = set(args.sections.split(","))
    report = Report(args)
    scratch = Path(tempfile.mkdtemp(prefix="lmsp-cuda-proof-"))
    models_dir = args.models_dir or scratch / "models"
    print(f"cuda_proof: device {args.device}, quick {args.quick}, budget {args.budget_s:.0f} s", flush=True)

    demos = demo_graphs(models_dir, args.quick)
    fixtures = fixture_graphs(args.quick)
    fp32 = {k: g for k, g in demos.items() if k not in ("endless", "wide")}
    fp32_fixtures = {k: g for k, g in fixtures.items() if k in FP32_FIXTURES}
    halves = [(fixtures[k], fixtures[FP32_PAIR]) for k in fixtures if k.endswith("16") and FP32_PAIR in fixtures]
    resumed = {
        "endless": demos["endless"],
        **{k: fixtures[k] for k in (FP32_PAIR, f"{FP32_PAIR}:fp16") if k in fixtures},
    }
    steps: list[tuple[str, float, Callable[[], None]]] = [
        ("environment", 5, lambda: environment_section(args, report)),
        ("placement", 30, lambda: placement_section(args, report, {**fp32, **fixtures}, scratch)),
        ("kv", 10, lambda: kv_section(args, report, {**fp32, **fixtures})),
        ("logits", 60, lambda: logits_section(args, report, {**fp32, **fp32_fixtures})),
        ("fixtures", 20, lambda: fixtures_section(args, report, fixtures)),
        ("resume", 40, lambda: resume_section(args, report, resumed)),
        ("fp16", 15, lambda: fp16_section(args, report, halves)),
        ("timing", 90, lambda: timing_section(args, report, fp32)),
        ("memory", 60, lambda: memory_section(args, report, demos)),
        ("libraries", 40, lambda: missing_libraries_section(args, report, demos)),
        (
            "picks",
            45,
            lambda: picks_section(
                args,
                report,
                {
                    "endless": demos["endless"],
                    **{k: fixtures[k] for k in ("llama-genai", f"{FP32_PAIR}:fp16") if k in fixtures},
                },
                demos["wide"],
            ),
        ),
        (
            "prefix",
            40,
            lambda: prefix_section(
                args,
                report,
                {
                    "endless": demos["endless"],
                    **{k: fixtures[k] for k in ("llama-genai", f"{FP32_PAIR}:fp16") if k in fixtures},
                },
            ),
        ),
        (
            "batched",
            60,
            lambda: batched_section(
                args,
                report,
                {**fp32, "llama-genai": fixtures["llama-genai"]},
                # Demo's own size that never writes its end-of-text token, so every row makes all it is asked.
                {k: demos[k] for k in ("endless", "base") if k in demos},
            ),
        ),
        (
            "engine_process",
            60,
            lambda: engine_process_section(args, report, {k: demos[k] for k in ("endless", "base") if k in demos}),
        ),
    ]
    for name, needs, run in steps:
        if name not in wanted:
            continue
        with report.section(name, needs) as go:
            if go:
                run()
    saved = report.save()
    summary = report.data["summary"]
    print(f"\ncuda_proof: {summary['passed']} passed, {summary['failed']} failed in {summary['seconds']} s", flush=True)
    if saved:
        print(f"JSON: {saved}", flush=True)
    shutil.rmtree(scratch, ignore_errors=True)
    return 0 if report.failed == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
