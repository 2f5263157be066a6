"""The fixture models of every layout, loaded once per test module (the ``loaded`` fixture, in tests/conftest.py)."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

from tests.test_backend_layouts import MODELS, REFERENCES
from workers.backends.onnx import OnnxRuntimeBackend
from workers.backends.onnx.model import OnnxModel

# The prefill chunk of the loaded models: small, so the fixtures' prompts take several calls.
CHUNK = 8


@pytest.fixture(scope="module")
def loaded() -> Iterator[Callable[[str], OnnxModel]]:
    """``loaded(key)``: the model of ``REFERENCES[key]`` on the CPU, loaded on first use in the module."""
    models: dict[str, OnnxModel] = {}

    def get(key: str) -> OnnxModel:
        if key not in models:
            reference = REFERENCES[key]
            backend = OnnxRuntimeBackend(prefill_chunk=CHUNK)
            models[key] = backend.load(MODELS / reference["folder"], graph=reference["graph"], device="cpu")
        return models[key]

    yield get
    for model in models.values():
        model.close()
