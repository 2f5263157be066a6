"""The committed real-tool model fixtures (tests/fixtures/models) match their references.

The fixtures are made by ``python -m fixture_models.exports`` with torch, optimum-onnx and the
onnxruntime-genai builder, none of which CI has. These checks are the cheap ones that keep the
committed files and ``model_references.json`` in step: every model the references name has its
folder and graph, every file is there with the size recorded when it was made, the tree stays
small, and the recorded texts are what the fixture's own tokenizer makes of the recorded ids.
Running the fixtures through the service is for the service's tests.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from tokenizers import Tokenizer

# No database here: the PostgreSQL pass of scripts/test leaves these out (tests/conftest.py).
pytestmark = pytest.mark.database_free

FIXTURES = Path(__file__).resolve().parent / "fixtures"
MODELS = FIXTURES / "models"
REFERENCES: dict[str, Any] = json.loads((FIXTURES / "model_references.json").read_text(encoding="utf-8"))
# The limits fixture_models/exports.py builds to.
MAX_FOLDER_BYTES = 1408 * 1024
MAX_TREE_BYTES = 5 * 1024 * 1024
# What issue 15 asks the fixtures to cover: each layout, and which of them each variant exercises.
EXPECTED_LAYOUTS = {
    "qwen2-tiny": "optimum-flat",
    "llama-tiny": "optimum-flat",
    "phi3-tiny": "optimum-flat",
    "gpt2-tiny": "optimum-flat",
    "qwen2-community": "onnx-community",
    "qwen2-community:int8": "onnx-community",
    "qwen2-community:q4": "onnx-community",
    "qwen2-community:fp16": "onnx-community",
    "qwen2-community:q4f16": "onnx-community",
    "qwen2-community:uint8": "onnx-community",
    "qwen2-community:bnb4": "onnx-community",
    "llama-genai": "genai-builder",
    "llama-genai-int4": "genai-builder",
    "phi3-legacy": "optimum-legacy-merged",
}
MODEL_NAMES = sorted(REFERENCES["models"])


def _tree_files(folder: Path) -> dict[str, int]:
    return {p.relative_to(folder).as_posix(): p.stat().st_size for p in folder.rglob("*") if p.is_file()}


def test_references_cover_every_layout() -> None:
    assert {name: ref["layout"] for name, ref in REFERENCES["models"].items()} == EXPECTED_LAYOUTS


def test_every_fixture_folder_is_referenced() -> None:
    folders = {p.name for p in MODELS.iterdir() if p.is_dir()}
    assert folders == {ref["folder"] for ref in REFERENCES["models"].values()}


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_fixture_files_are_the_recorded_ones(name: str) -> None:
    ref = REFERENCES["models"][name]
    folder = MODELS / ref["folder"]
    recorded = {item["path"]: item["bytes"] for item in ref["files"]}
    assert _tree_files(folder) == recorded
    assert ref["graph"] in recorded
    assert sum(recorded.values()) <= MAX_FOLDER_BYTES


def test_fixture_tree_stays_small() -> None:
    assert sum(_tree_files(MODELS).values()) <= MAX_TREE_BYTES


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_recorded_text_is_the_tokenizers_decoding(name: str) -> None:
    ref = REFERENCES["models"][name]
    tokenizer = Tokenizer.from_file(str(MODELS / ref["folder"] / "tokenizer.json"))
    eos = ref["generation_config"]["eos_token_id"]
    eos_ids = set(eos) if isinstance(eos, list) else {eos}
    assert len(ref["cases"]) == 2
    assert max(case["prompt_tokens"] for case in ref["cases"]) >= 40
    for case in ref["cases"]:
        ids = case["output_ids"]
        assert case["prompt_tokens"] == len(case["prompt_ids"])
        assert case["output_tokens"] == len(ids) <= case["request"]["max_output_tokens"]
        assert case["ended_on_eos"] == (ids[-1] in eos_ids)
        assert case["text"] == tokenizer.decode(ids[:-1] if case["ended_on_eos"] else ids)
        # PostgreSQL's text and jsonb columns cannot hold NUL.
        assert "\x00" not in case["text"]
