"""Creating the ONNX Runtime session: device, execution providers, threads, memory.

``auto`` takes CUDA only when it really works and otherwise stays on the CPU
with at most one warning that says why; ``cuda`` raises ``ModelLoadError``
rather than run on the CPU unasked. Neither lets ONNX Runtime's Python layer
rebuild a failed CUDA session on the CPU behind our back (its fallback
prints to stdout and turns a GPU out-of-memory into a slow CPU model): a
CUDA failure at load is decided here, one at run time is a generation error.

Every session is built with:

- no memory pattern: ORT plans and keeps one allocation pattern per input
  shape, and every decode step has a new one (the past grows by a token), so
  the plans only pile up (measured: +24 MiB host memory per 3,000 lengths);
- the node-to-provider assignment recorded, so that a CUDA load can log how
  many nodes run on the CPU (:func:`provider_assignment`);
- on CUDA, TF32 off (fp32 logits then match the CPU's to float rounding and
  greedy tokens do not depend on the device) and an arena that grows by what
  is asked for, optionally capped (``gpu_mem_limit``).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import sys
from collections import Counter
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import onnxruntime as ort

from workers.backends.errors import ModelLoadError
from workers.backends.onnx.cuda_libs import preload_cuda_libraries
from workers.backends.onnx.error_text import one_line

log = logging.getLogger(__name__)

CPU_PROVIDER = "CPUExecutionProvider"
CUDA_PROVIDER = "CUDAExecutionProvider"
DEVICES = ("auto", "cpu", "cuda")
ARENA_EXTEND_STRATEGIES = ("kSameAsRequested", "kNextPowerOfTwo")
DEFAULT_ARENA_EXTEND_STRATEGY = "kSameAsRequested"
RECORD_ASSIGNMENT = "session.record_ep_graph_assignment_info"

# ONNX Runtime's own severity scale: 3 = errors only.
_ORT_ERRORS_ONLY = 3

# Options are bound once in ``open_session``, so the device paths only choose providers.
_CreateSession = Callable[[list[Any]], ort.InferenceSession]


class _CudaUnusable(Exception):
    """CUDA cannot run this session; the message says why, for a person."""


def _cuda_driver() -> ctypes.CDLL | None:
    """The CUDA driver library, initialised (``cuInit``); None without a driver or when it fails."""
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
            return driver if driver.cuInit(0) == 0 else None
        except AttributeError:
            return None
    return None


def cuda_device_count() -> int:
    """How many CUDA devices the driver reports; 0 without a driver.

    Asked before ONNX Runtime ever tries its CUDA provider: onnxruntime-gpu on
    a machine without CUDA prints an error line to stderr and silently falls
    back to CPU, and ``auto`` should stay quiet there. Loading the driver
    library and calling ``cuInit`` costs nothing the CUDA provider would not
    pay anyway.
    """
    driver = _cuda_driver()
    count = ctypes.c_int(0)
    try:
        if driver is None or driver.cuDeviceGetCount(ctypes.byref(count)) != 0:
            return 0
    except AttributeError:
        return 0
    return count.value


def cuda_free_bytes(device_id: int) -> int:
    """Free memory of CUDA device ``device_id`` (the driver's ``cuMemGetInfo``); 0 when it cannot be asked.

    Through the device's primary context, the one ONNX Runtime's CUDA provider
    uses, so asking creates nothing the sessions would not.
    """
    driver = _cuda_driver()
    if driver is None:
        return 0
    device, context = ctypes.c_int(), ctypes.c_void_p()
    free, total = ctypes.c_size_t(), ctypes.c_size_t()
    try:
        if driver.cuDeviceGet(ctypes.byref(device), device_id) or driver.cuDevicePrimaryCtxRetain(
            ctypes.byref(context), device
        ):
            return 0
        try:
            if driver.cuCtxPushCurrent_v2(context):
                return 0
            try:
                if driver.cuMemGetInfo_v2(ctypes.byref(free), ctypes.byref(total)):
                    return 0
            finally:
                driver.cuCtxPopCurrent_v2(ctypes.byref(ctypes.c_void_p()))
        finally:
            driver.cuDevicePrimaryCtxRelease_v2(device)
    except AttributeError:
        return 0
    return int(free.value)


def session_options(intra_op_threads: int | None, spinning: bool) -> ort.SessionOptions:
    """The options every session of this backend is created with (see the module's docstring)."""
    options = ort.SessionOptions()
    # Errors only: provider-placement warnings would flood the worker log.
    options.log_severity_level = _ORT_ERRORS_ONLY
    options.enable_mem_pattern = False
    options.add_session_config_entry(RECORD_ASSIGNMENT, "1")
    if intra_op_threads:
        options.intra_op_num_threads = intra_op_threads
    if not spinning:
        # Spinning intra-op threads keep every core busy between steps; on a
        # host that also serves the web and the database it starved the
        # event streams (docs/streams.md). Off, the demo model runs as fast
        # on half the CPU; large CPU models lose up to a quarter of speed.
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    return options


def cuda_provider_options(
    device_id: int,
    *,
    gpu_mem_limit: int | None = None,
    arena_extend_strategy: str = DEFAULT_ARENA_EXTEND_STRATEGY,
    use_tf32: bool = False,
) -> dict[str, str]:
    """The CUDA execution provider's options, as the strings ONNX Runtime takes.

    ``gpu_mem_limit`` caps this session's arena in bytes (None or 0, as
    ``LMSP_GPU_MEM_LIMIT_BYTES`` writes it: no cap);
    ``kSameAsRequested`` grows the arena by what a step asks for, where
    ORT's default doubles it (a KV cache near half the device then fails).
    """
    if arena_extend_strategy not in ARENA_EXTEND_STRATEGIES:
        raise ModelLoadError(
            f"arena_extend_strategy must be one of {', '.join(ARENA_EXTEND_STRATEGIES)}, got {arena_extend_strategy!r}"
        )
    options = {
        "device_id": str(device_id),
        "use_tf32": "1" if use_tf32 else "0",
        "arena_extend_strategy": arena_extend_strategy,
    }
    if gpu_mem_limit is not None:
        if isinstance(gpu_mem_limit, bool) or not isinstance(gpu_mem_limit, int) or gpu_mem_limit < 0:
            raise ModelLoadError(f"gpu_mem_limit must be a number of bytes (0: no limit), got {gpu_mem_limit!r}")
        if gpu_mem_limit:
            options["gpu_mem_limit"] = str(gpu_mem_limit)
    return options


def _create_session(
    model: Path | bytes, providers: list[Any], options: ort.SessionOptions, where: str, *, quiet: bool = False
) -> ort.InferenceSession:
    source = str(model) if isinstance(model, Path) else model
    try:
        # enable_fallback=0: a provider that fails raises here (or in run) instead of ORT's
        # Python layer printing "Falling back" and quietly rebuilding the session on the CPU.
        return ort.InferenceSession(source, options, providers=providers, enable_fallback=0)
    except Exception as exc:  # onnxruntime raises its own pybind exception types
        if not quiet:
            log.warning("onnxruntime could not load %s", where, exc_info=True)
        raise ModelLoadError(f"onnxruntime could not load {where}: {one_line(exc)}") from None


def open_session(
    path: Path,
    device: str,
    device_id: int,
    intra_op_threads: int | None,
    spinning: bool,
    *,
    where: str,
    gpu_mem_limit: int | None = None,
    arena_extend_strategy: str = DEFAULT_ARENA_EXTEND_STRATEGY,
    use_tf32: bool = False,
) -> tuple[ort.InferenceSession, str]:
    """A session on the requested device and the device type its cache lives on ("cpu"/"cuda").

    ``where`` ("<graph> of model '<name>'") names the graph in errors and logs.
    ``gpu_mem_limit``, ``arena_extend_strategy`` and ``use_tf32`` apply to a
    CUDA session (see :func:`cuda_provider_options`).
    """
    if device not in DEVICES:
        raise ModelLoadError(f"unknown device {device!r} for {where}; use one of {', '.join(DEVICES)}")
    # Checked on every device, so that a setting wrong for a GPU fails on a CPU machine too.
    cuda_options = cuda_provider_options(
        device_id, gpu_mem_limit=gpu_mem_limit, arena_extend_strategy=arena_extend_strategy, use_tf32=use_tf32
    )
    options = partial(session_options, intra_op_threads, spinning)
    if device == "cpu":
        return _create_session(path, [CPU_PROVIDER], options(), where), "cpu"
    cuda_built = CUDA_PROVIDER in ort.get_available_providers()
    if device == "cuda":
        if not cuda_built:
            raise ModelLoadError(f"CUDA requested for {where} but this onnxruntime build has no CUDAExecutionProvider")
        count = cuda_device_count()
        if count <= device_id:
            raise ModelLoadError(
                f"CUDA requested for {where} but the CUDA driver reports {count} device(s); wanted #{device_id}"
            )
        try:
            create = partial(_create_session, path, options=options(), where=where)
            return _open_cuda(create, cuda_options, where), "cuda"
        except _CudaUnusable as exc:
            raise ModelLoadError(f"CUDA requested for {where} but {exc}") from None
    if cuda_built and cuda_device_count() > device_id:
        try:
            create = partial(_create_session, path, options=options(), where=where, quiet=True)
            return _open_cuda(create, cuda_options, where), "cuda"
        except _CudaUnusable as exc:
            log.warning("CUDA device found but not usable for %s, so it runs on the CPU: %s", where, exc)
    return _create_session(path, [CPU_PROVIDER], options(), where), "cpu"


def open_helper_session(
    model: bytes,
    device_type: str,
    device_id: int,
    *,
    where: str,
    gpu_mem_limit: int | None = None,
    arena_extend_strategy: str = DEFAULT_ARENA_EXTEND_STRATEGY,
) -> ort.InferenceSession:
    """A session for a small graph of our own on the device a model's session already runs on.

    One thread and no spinning: it runs one tiny node per prefill call. Its
    CUDA arena is its own, hence its own limits.
    """
    cuda_options = cuda_provider_options(
        device_id, gpu_mem_limit=gpu_mem_limit, arena_extend_strategy=arena_extend_strategy
    )
    options = session_options(1, False)
    if device_type != "cuda":
        return _create_session(model, [CPU_PROVIDER], options, where)
    try:
        return _open_cuda(partial(_create_session, model, options=options, where=where), cuda_options, where)
    except _CudaUnusable as exc:
        raise ModelLoadError(f"CUDA failed for {where}: {exc}") from None


def _open_cuda(create: _CreateSession, cuda_options: dict[str, str], where: str) -> ort.InferenceSession:
    """A session whose first provider really is CUDA, or ``_CudaUnusable`` saying why not."""
    libraries = preload_cuda_libraries()
    if not libraries.ok:
        # Not even tried: ORT would print three lines blaming cuDNN and build a CPU session.
        raise _CudaUnusable(libraries.problem())
    try:
        # CPU stays listed so that nodes CUDA has no kernel for can still run.
        session = create([(CUDA_PROVIDER, cuda_options), CPU_PROVIDER])
    except ModelLoadError as exc:
        raise _CudaUnusable(str(exc)) from None
    if session.get_providers()[0] != CUDA_PROVIDER:
        raise _CudaUnusable(
            f"onnxruntime fell back to {session.get_providers()[0]} although the CUDA libraries loaded "
            "(its error is on the worker's stderr)"
        )
    _log_placement(session, where)
    return session


def provider_assignment(session: ort.InferenceSession) -> dict[str, int]:
    """How many of the session's nodes each execution provider runs; empty if the session did not record it.

    Counted as ORT's partitioner assigned them: before the Memcpy nodes it
    adds afterwards between providers (those show only in the graph ORT can
    write out, ``SessionOptions.optimized_model_filepath``; bench/cuda_proof.py
    counts them there).
    """
    getter = getattr(session, "get_provider_graph_assignment_info", None)
    if getter is None:
        return {}
    try:
        subgraphs = getter()
    except Exception:  # not recorded (an older build, or a session created elsewhere)
        return {}
    return dict(Counter(subgraph.ep_name for subgraph in subgraphs for _ in subgraph.get_nodes()))


def _log_placement(session: ort.InferenceSession, where: str) -> None:
    # ORT's own "Memcpy nodes are added" warning is below the errors-only level the sessions log at.
    nodes = provider_assignment(session)
    if not nodes:
        log.info("%s on CUDA; this onnxruntime does not report node placement", where)
        return
    cpu = nodes.get(CPU_PROVIDER, 0)
    # A tensor crossing between a CPU node and a CUDA node is copied: few CPU nodes, few copies.
    log.info(
        "%s on CUDA: %d of %d nodes on the CPU (%s)",
        where,
        cpu,
        sum(nodes.values()),
        ", ".join(f"{provider}: {count}" for provider, count in sorted(nodes.items())),
    )
