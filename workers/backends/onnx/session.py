"""Creating the ONNX Runtime session: device, execution providers, threads.

``auto`` takes CUDA only when it really works and stays quiet otherwise;
``cuda`` raises ``ModelLoadError`` rather than run on the CPU unasked.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import sys
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import onnxruntime as ort

from workers.backends.errors import ModelLoadError
from workers.backends.onnx.error_text import one_line

log = logging.getLogger(__name__)

CPU_PROVIDER = "CPUExecutionProvider"
CUDA_PROVIDER = "CUDAExecutionProvider"
DEVICES = ("auto", "cpu", "cuda")

# ONNX Runtime's own severity scale: 3 = errors only.
_ORT_ERRORS_ONLY = 3

# Thread settings are bound once in ``open_session``, so the device paths only choose providers.
_CreateSession = Callable[[list[Any]], ort.InferenceSession]


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
    model: Path | bytes, providers: list[Any], intra_op_threads: int | None, spinning: bool, where: str
) -> ort.InferenceSession:
    source = str(model) if isinstance(model, Path) else model
    try:
        return ort.InferenceSession(source, _session_options(intra_op_threads, spinning), providers=providers)
    except Exception as exc:  # onnxruntime raises its own pybind exception types
        log.warning("onnxruntime could not load %s", where, exc_info=True)
        raise ModelLoadError(f"onnxruntime could not load {where}: {one_line(exc)}") from None


def open_session(
    path: Path, device: str, device_id: int, intra_op_threads: int | None, spinning: bool, *, where: str
) -> tuple[ort.InferenceSession, str]:
    """A session on the requested device and the device type its cache lives on ("cpu"/"cuda").

    ``where`` ("<graph> of model '<name>'") names the graph in errors and logs.
    """
    if device not in DEVICES:
        raise ModelLoadError(f"unknown device {device!r} for {where}; use one of {', '.join(DEVICES)}")
    create = partial(_create_session, path, intra_op_threads=intra_op_threads, spinning=spinning, where=where)
    if device == "cpu":
        return create([CPU_PROVIDER]), "cpu"
    cuda_built = CUDA_PROVIDER in ort.get_available_providers()
    if device == "cuda":
        return _open_cuda(create, device_id, cuda_built, where), "cuda"
    return _open_auto(create, device_id, cuda_built, where)


def open_helper_session(model: bytes, device_type: str, device_id: int, *, where: str) -> ort.InferenceSession:
    """A session for a small graph of our own on the device a model's session already runs on.

    One thread and no spinning: it runs one tiny node per prefill call.
    """
    providers = _cuda_providers(device_id) if device_type == "cuda" else [CPU_PROVIDER]
    session = _create_session(model, providers, 1, False, where)
    if device_type == "cuda" and session.get_providers()[0] != CUDA_PROVIDER:
        raise ModelLoadError(f"onnxruntime fell back to {session.get_providers()[0]} for {where}")
    return session


def _cuda_providers(device_id: int) -> list[Any]:
    # CPU stays listed so that nodes CUDA has no kernel for can still run.
    return [(CUDA_PROVIDER, {"device_id": device_id}), CPU_PROVIDER]


def _open_cuda(create: _CreateSession, device_id: int, cuda_built: bool, where: str) -> ort.InferenceSession:
    if not cuda_built:
        raise ModelLoadError(f"CUDA requested for {where} but this onnxruntime build has no CUDAExecutionProvider")
    count = cuda_device_count()
    if count <= device_id:
        raise ModelLoadError(
            f"CUDA requested for {where} but the CUDA driver reports {count} device(s); wanted #{device_id}"
        )
    session = create(_cuda_providers(device_id))
    if session.get_providers()[0] != CUDA_PROVIDER:
        raise ModelLoadError(
            f"CUDA requested for {where} but onnxruntime fell back to {session.get_providers()[0]} "
            "(CUDA/cuDNN libraries missing or unusable; see the worker's stderr)"
        )
    return session


def _open_auto(
    create: _CreateSession, device_id: int, cuda_built: bool, where: str
) -> tuple[ort.InferenceSession, str]:
    """CUDA when it really works, else a clean CPU session."""
    if cuda_built and cuda_device_count() > device_id:
        try:
            session = create(_cuda_providers(device_id))
        except ModelLoadError:
            session = None
        if session is not None and session.get_providers()[0] == CUDA_PROVIDER:
            return session, "cuda"
        log.warning("CUDA device found but onnxruntime could not use it for %s; using the CPU", where)
        if session is not None:
            return session, "cpu"  # it already fell back to the CPU provider alone
    return create([CPU_PROVIDER]), "cpu"
