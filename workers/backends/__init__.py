"""Inference runtimes by name; see ``workers.backends.base`` for the interface.

Runtimes are imported on first use, so importing this package does not pull
ONNX Runtime into processes that never generate (the API server).
"""

from __future__ import annotations

from workers.backends.base import Backend
from workers.backends.errors import ModelLoadError

BACKENDS = ("onnxruntime",)


def get_backend(name: str) -> Backend:
    """The runtime registered as ``name``; ``ModelLoadError`` for an unknown one."""
    if name == "onnxruntime":
        from workers.backends.onnx import OnnxRuntimeBackend

        return OnnxRuntimeBackend()
    raise ModelLoadError(f"unknown inference backend {name!r}; known: {', '.join(BACKENDS)}")
