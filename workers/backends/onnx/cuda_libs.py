"""The CUDA libraries onnxruntime-gpu's CUDA provider needs, found and loaded before a CUDA session.

The pinned wheel brings none of them: outside the CUDA Docker image they come
from NVIDIA's pip packages (``nvidia-cublas``, ``nvidia-cuda-runtime``,
``nvidia-curand``, ``nvidia-cudnn-cu13``), whose ``lib`` folders are on no
loader path. Left to itself, ONNX Runtime then prints three lines (the last
one blaming cuDNN whatever is missing) and builds the session on the CPU.
So the libraries are looked up and loaded here first, process-wide, and a
problem names exactly the libraries that are missing or would not load.
"""

from __future__ import annotations

import contextlib
import ctypes
import io
import logging
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path

import onnxruntime as ort

log = logging.getLogger(__name__)

# The CUDA major version the pinned onnxruntime-gpu is built for, where the build does not say.
DEFAULT_CUDA_MAJOR = 13
CUDNN_MAJOR = 9
DOCS = "docs/cuda.md"


@dataclass(frozen=True)
class CudaLibraries:
    """What a search for the CUDA provider's libraries found, by library file name."""

    loaded: dict[str, str] = field(default_factory=dict)
    """Library -> where it was loaded from (a path, or the system loader's search)."""
    missing: tuple[str, ...] = ()
    """No file of that name in the searched folders, and the system loader has none."""
    unusable: dict[str, str] = field(default_factory=dict)
    """Library -> why a file of that name would not load (a wrong or broken file)."""
    searched: tuple[str, ...] = ()
    """The folders looked in first."""
    system: bool = True
    """Whether the system loader's path was searched after them."""
    cuda_major: int = DEFAULT_CUDA_MAJOR

    @property
    def ok(self) -> bool:
        return not self.missing and not self.unusable

    def problem(self) -> str:
        """One line for a person: which libraries, what is wrong with each, how to install them."""
        parts = []
        if self.missing:
            parts.append(f"missing {', '.join(self.missing)}")
        if self.unusable:
            parts.append("unusable " + "; ".join(f"{name} ({why})" for name, why in self.unusable.items()))
        packages = sorted({pip_package(name, self.cuda_major) for name in (*self.missing, *self.unusable)})
        places = list(self.searched) or ["no nvidia/*/lib folder on sys.path"]
        if self.system:
            places.append("the system loader's path")
        return (
            f"the CUDA {self.cuda_major} libraries onnxruntime's CUDA provider needs are not all loadable: "
            f"{'; '.join(parts)} (searched: {', '.join(places)}). "
            f"Install them with `pip install {' '.join(packages)}` in the worker's Python environment, "
            f"or run the CUDA Docker image ({DOCS})"
        )


def build_cuda_major() -> int:
    """The CUDA major version this onnxruntime build links (13 for onnxruntime-gpu 1.31)."""
    try:
        from onnxruntime.capi import build_and_package_info  # absent in some builds
    except ImportError:
        return DEFAULT_CUDA_MAJOR
    version = getattr(build_and_package_info, "cuda_version", None) or ""
    major = version.split(".")[0]
    return int(major) if major.isdigit() else DEFAULT_CUDA_MAJOR


def required_libraries(cuda_major: int) -> tuple[str, ...]:
    """The shared libraries the CUDA provider loads, in an order whose dependencies come first."""
    return (
        f"libcublasLt.so.{cuda_major}",
        f"libcublas.so.{cuda_major}",
        "libcurand.so.10",
        f"libcudart.so.{cuda_major}",
        f"libcudnn.so.{CUDNN_MAJOR}",
    )


def pip_package(library: str, cuda_major: int) -> str:
    """NVIDIA's pip package that ships ``library`` for this CUDA major version."""
    stem = library.split(".so")[0]
    base = {
        "libcublasLt": "nvidia-cublas",
        "libcublas": "nvidia-cublas",
        "libcurand": "nvidia-curand",
        "libcudart": "nvidia-cuda-runtime",
    }.get(stem)
    if base is None:  # cuDNN keeps a CUDA suffix on every CUDA line
        return f"nvidia-cudnn-cu{cuda_major}"
    # From CUDA 13 on the toolkit packages dropped their -cuNN suffix.
    return base if cuda_major >= 13 else f"{base}-cu{cuda_major}"


def nvidia_library_dirs(paths: Iterable[str]) -> list[Path]:
    """The ``nvidia/<package>/lib`` folders under these import paths (where NVIDIA's wheels put them)."""
    found: list[Path] = []
    for entry in paths:
        root = Path(entry or ".") / "nvidia"
        if not root.is_dir():
            continue
        for lib in sorted(root.glob("*/lib")):
            if lib.is_dir() and lib not in found:
                found.append(lib)
    return found


def probe_cuda_libraries(
    search_dirs: Sequence[Path], *, system: bool = True, cuda_major: int | None = None
) -> CudaLibraries:
    """Load each library from the first folder that has it, else (``system``) by name from the loader's path.

    Loaded with RTLD_GLOBAL, so that the CUDA provider's own load finds them
    already in the process by their names. Loading is process-wide and cannot
    be undone: this is the real load, not a dry run.
    """
    major = build_cuda_major() if cuda_major is None else cuda_major
    loaded: dict[str, str] = {}
    missing: list[str] = []
    unusable: dict[str, str] = {}
    for name in required_libraries(major):
        state, detail = _load(name, search_dirs, system)
        if state == _LOADED:
            loaded[name] = detail
        elif state == _UNUSABLE:
            unusable[name] = detail
        else:
            missing.append(name)
    return CudaLibraries(
        loaded=loaded,
        missing=tuple(missing),
        unusable=unusable,
        searched=tuple(str(d) for d in search_dirs),
        system=system,
        cuda_major=major,
    )


_LOADED, _UNUSABLE, _MISSING = "loaded", "unusable", "missing"


def _load(name: str, search_dirs: Sequence[Path], system: bool) -> tuple[str, str]:
    """(state, where it came from or why it failed) for one library."""
    first_error = None
    for folder in search_dirs:
        path = folder / name
        if not path.is_file():
            continue
        try:
            ctypes.CDLL(str(path), mode=ctypes.RTLD_GLOBAL)
        except OSError as exc:
            first_error = first_error or str(exc)
            continue
        return _LOADED, str(path)
    if first_error is not None:
        return _UNUSABLE, first_error
    if not system:
        return _MISSING, ""
    try:
        ctypes.CDLL(name, mode=ctypes.RTLD_GLOBAL)
    except OSError as exc:
        # dlopen says "No such file" when no folder on its path has the name; anything else is a bad file.
        return (_MISSING, "") if "No such file" in str(exc) else (_UNUSABLE, str(exc))
    return _LOADED, "the system loader's path"


@cache
def preload_cuda_libraries() -> CudaLibraries:
    """Find and load the CUDA provider's libraries for this process, once.

    From NVIDIA's pip packages on ``sys.path`` (ahead of ``onnxruntime``'s own
    search, which looks only beside the onnxruntime package, not where a
    ``pip install --target`` puts it), else from the system loader's path (the
    CUDA Docker image). Then ``onnxruntime.preload_dlls()``, where the build
    has it, for what ORT loads on top; it prints its failures, which go to the
    debug log instead of the worker's stdout.
    """
    if not sys.platform.startswith("linux"):
        # Windows names its DLLs otherwise and has its own search order; ORT reports there itself.
        return CudaLibraries()
    libraries = probe_cuda_libraries(nvidia_library_dirs(sys.path))
    # onnxruntime-gpu 1.31 warns "No registered plugin EP device found for 'CUDAExecutionProvider'"
    # on its process-wide logger for every CUDA session it then builds with its own provider: 264
    # lines in the first H200 run, none of them news. The sessions' own logging is errors-only
    # already (session_options); errors on the process-wide logger still reach stderr.
    ort.set_default_logger_severity(3)
    preload = getattr(ort, "preload_dlls", None)
    if preload is not None:
        printed = io.StringIO()
        try:
            with contextlib.redirect_stdout(printed):
                preload()
        except Exception:  # a failure here changes nothing the probe above has not decided
            log.debug("onnxruntime.preload_dlls failed", exc_info=True)
        if printed.getvalue().strip():
            log.debug("onnxruntime.preload_dlls: %s", printed.getvalue().strip())
    if libraries.ok:
        log.info("CUDA libraries loaded: %s", ", ".join(f"{k} from {v}" for k, v in libraries.loaded.items()))
    return libraries
