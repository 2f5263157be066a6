"""Tests for fixture_models.demo: the tiny Qwen2-style ONNX model used in place of real weights, built and served."""

from __future__ import annotations

import hashlib
import io
import json
import os
import string
import subprocess
import sys
import unicodedata
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import openai
import pytest
from django.core.management import call_command
from jinja2.sandbox import ImmutableSandboxedEnvironment
from onnx import numpy_helper
from tokenizers import Tokenizer

from fixture_models import demo
from fixture_models.demo import DEMO_SIZES, EOS_HEAD_WEIGHT, SPECIAL_TOKENS, _bytes_to_unicode, build_demo_model
from tasks_app.models import ModelRecord
from tests.support.specs import prompt_for
from tests.support.tasks import create, wait_for_status
from workers.backends.base import FINISH_EOS, SamplingParams
from workers.backends.onnx import OnnxGeneration, OnnxModel, OnnxRuntimeBackend

# No database here: the PostgreSQL pass of scripts/test leaves these out (tests/conftest.py).
pytestmark = pytest.mark.database_free

REPO_ROOT = Path(__file__).resolve().parents[1]
BUILD_SCRIPT = (
    "import sys, pathlib\n"
    "from fixture_models.demo import build_demo_model\n"
    "build_demo_model(pathlib.Path(sys.argv[1]))\n"
)
# weights_digest() of demo:endless, the random demo weights (size "demo", seed 0).
RANDOM_DEMO_WEIGHTS_SHA256 = "3ea7be1082e0173a5c305ddb2971904286141e4272344b5dc837599f172c1599"
EXPECTED_FILES = {
    "model.onnx",
    "model.onnx_data",
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
    "special_tokens_map.json",
}


# --------------------------------------------------------------------------- #
# Fixtures and helpers
# --------------------------------------------------------------------------- #


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("demo_model")
    written = build_demo_model(out)
    assert {p.name for p in written} == EXPECTED_FILES
    assert all(p.parent == out and p.is_file() for p in written)
    return out


@pytest.fixture(scope="module")
def endless_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("demo_endless")
    build_demo_model(out, endless=True)
    return out


@pytest.fixture(scope="module")
def config(model_dir: Path) -> dict:
    return json.loads((model_dir / "config.json").read_text(encoding="utf-8"))


@pytest.fixture(scope="module")
def session(model_dir: Path) -> ort.InferenceSession:
    return ort.InferenceSession(str(model_dir / "model.onnx"), providers=["CPUExecutionProvider"])


@pytest.fixture(scope="module")
def endless_session(endless_dir: Path) -> ort.InferenceSession:
    return ort.InferenceSession(str(endless_dir / "model.onnx"), providers=["CPUExecutionProvider"])


@pytest.fixture(scope="module")
def tokenizer(model_dir: Path) -> Tokenizer:
    return Tokenizer.from_file(str(model_dir / "tokenizer.json"))


def empty_past(config: dict, batch: int) -> dict[str, np.ndarray]:
    shape = (batch, config["num_key_value_heads"], 0, config["head_dim"])
    return {
        f"past_key_values.{layer}.{kind}": np.zeros(shape, dtype=np.float32)
        for layer in range(config["num_hidden_layers"])
        for kind in ("key", "value")
    }


def forward(
    session: ort.InferenceSession,
    config: dict,
    input_ids: np.ndarray,
    attention_mask: np.ndarray | None = None,
    position_ids: np.ndarray | None = None,
    past: dict[str, np.ndarray] | None = None,
) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """One session run; returns (logits, past for the next step)."""
    input_ids = np.asarray(input_ids, dtype=np.int64)
    batch, seq = input_ids.shape
    past = past if past is not None else empty_past(config, batch)
    past_len = past["past_key_values.0.key"].shape[2]
    if attention_mask is None:
        attention_mask = np.ones((batch, past_len + seq), dtype=np.int64)
    if position_ids is None:
        position_ids = np.broadcast_to(np.arange(past_len, past_len + seq, dtype=np.int64), (batch, seq))
    feed = {
        "input_ids": input_ids,
        "attention_mask": np.asarray(attention_mask, dtype=np.int64),
        "position_ids": np.ascontiguousarray(position_ids, dtype=np.int64),
        **past,
    }
    names = [o.name for o in session.get_outputs()]
    results = dict(zip(names, session.run(None, feed), strict=True))
    present = {
        name.replace("present.", "past_key_values."): value for name, value in results.items() if name != "logits"
    }
    return results["logits"], present


def random_prompt(config: dict, length: int, seed: int = 1) -> np.ndarray:
    # Ordinary (non-special) tokens only.
    return np.random.default_rng(seed).integers(0, config["vocab_size"] - len(SPECIAL_TOKENS), (1, length))


# --------------------------------------------------------------------------- #
# Build
# --------------------------------------------------------------------------- #


@pytest.mark.slow
def test_build_is_byte_identical_across_processes(tmp_path: Path) -> None:
    # Different hash seeds catch any dict/set ordering leaking into the files;
    # separate processes also give the Rust tokenizer trainer fresh hash seeds.
    dirs = []
    for hash_seed in ("1", "4242"):
        out = tmp_path / f"build_{hash_seed}"
        env = {**os.environ, "PYTHONHASHSEED": hash_seed, "PYTHONPATH": str(REPO_ROOT)}
        subprocess.run(
            [sys.executable, "-c", BUILD_SCRIPT, str(out)],
            check=True,
            cwd=REPO_ROOT,
            env=env,
            timeout=120,
        )
        dirs.append(out)
    first, second = dirs
    assert {p.name for p in first.iterdir()} == EXPECTED_FILES
    assert {p.name for p in second.iterdir()} == EXPECTED_FILES
    for name in sorted(EXPECTED_FILES):
        assert (first / name).read_bytes() == (second / name).read_bytes(), name


def test_rebuild_in_place_overwrites(tmp_path: Path, model_dir: Path) -> None:
    # onnx appends external data to an existing file; a rebuild must not grow it.
    build_demo_model(tmp_path)
    build_demo_model(tmp_path)
    for name in sorted(EXPECTED_FILES):
        assert (tmp_path / name).read_bytes() == (model_dir / name).read_bytes(), name


def test_seed_changes_weights_only(tmp_path: Path, model_dir: Path) -> None:
    build_demo_model(tmp_path, seed=1)
    assert (tmp_path / "model.onnx_data").read_bytes() != (model_dir / "model.onnx_data").read_bytes()
    assert (tmp_path / "tokenizer.json").read_bytes() == (model_dir / "tokenizer.json").read_bytes()


def weights_digest(model: onnx.ModelProto) -> str:
    """SHA-256 of every initializer's name, dtype, shape and values: the weights, whatever the file layout."""
    digest = hashlib.sha256()
    for tensor in sorted(model.graph.initializer, key=lambda t: t.name):
        array = numpy_helper.to_array(tensor)
        digest.update(f"{tensor.name}|{array.dtype}|{array.shape}|".encode())
        digest.update(array.tobytes())
    return digest.hexdigest()


def test_the_endless_variant_keeps_the_random_weights_and_leaves_out_the_eos_head(
    model_dir: Path, endless_dir: Path
) -> None:
    assert {p.name for p in endless_dir.iterdir()} == EXPECTED_FILES
    for name in sorted(EXPECTED_FILES - {"model.onnx", "model.onnx_data"}):
        assert (endless_dir / name).read_bytes() == (model_dir / name).read_bytes(), name
    ending = onnx.load(str(model_dir / "model.onnx"))
    endless = onnx.load(str(endless_dir / "model.onnx"))
    ending_weights = {t.name: numpy_helper.to_array(t) for t in ending.graph.initializer}
    endless_weights = {t.name: numpy_helper.to_array(t) for t in endless.graph.initializer}
    # The same graph (the EOS head aside), with other weights: demo's are fitted, demo:endless's random.
    assert set(ending_weights) - set(endless_weights) == {EOS_HEAD_WEIGHT}
    assert {n.name for n in endless.graph.node} < {n.name for n in ending.graph.node}
    for name, array in endless_weights.items():
        assert array.shape == ending_weights[name].shape, name
    assert not np.array_equal(endless_weights["lm_head.weight"], ending_weights["lm_head.weight"])
    # What this builder has written for demo:endless since before demo had an EOS head: tests and
    # benches compare against these very weights.
    assert weights_digest(endless) == RANDOM_DEMO_WEIGHTS_SHA256


@pytest.mark.django_db
def test_the_command_builds_both_variants_and_replaces_what_an_older_version_built(
    tmp_path: Path, settings, model_dir: Path, endless_dir: Path
) -> None:
    settings.LMSP_MODELS_DIR = tmp_path
    # What the builder wrote before the EOS head: the endless variant's bytes, under the name demo.
    build_demo_model(tmp_path / "demo", endless=True)

    def command(*args: str) -> str:
        out = io.StringIO()
        call_command("lmsp_build_demo_model", *args, stdout=out)
        return out.getvalue()

    assert "wrote 8 files" in command("--if-missing")
    assert "already present" in command("--if-missing")
    assert "registered demo:endless" in command("--endless", "--if-missing")
    assert "already present" in command("--endless", "--if-missing")
    for name in sorted(EXPECTED_FILES):
        assert (tmp_path / "demo" / name).read_bytes() == (model_dir / name).read_bytes(), name
        assert (tmp_path / "demo" / "endless" / name).read_bytes() == (endless_dir / name).read_bytes(), name
    assert sorted(ModelRecord.objects.values_list("name", flat=True)) == ["demo", "demo:endless"]


def test_unknown_size_raises(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unknown demo model size"):
        build_demo_model(tmp_path / "x", size="gigantic")
    assert not (tmp_path / "x").exists()


def test_sizes_are_consistent() -> None:
    demo = DEMO_SIZES["demo"]
    assert (
        demo.hidden_size,
        demo.num_layers,
        demo.num_heads,
        demo.num_kv_heads,
        demo.head_dim,
    ) == (64, 2, 4, 2, 16)
    assert demo.intermediate_size == 176
    for name, size in DEMO_SIZES.items():
        assert size.num_kv_heads < size.num_heads, name  # GQA everywhere
        assert size.num_heads % size.num_kv_heads == 0, name


def test_config_files(model_dir: Path, config: dict, tokenizer: Tokenizer) -> None:
    demo = DEMO_SIZES["demo"]
    assert config["architectures"] == ["Qwen2ForCausalLM"]
    assert config["model_type"] == "qwen2"
    assert config["hidden_size"] == demo.hidden_size
    assert config["intermediate_size"] == demo.intermediate_size
    assert config["num_hidden_layers"] == demo.num_layers
    assert config["num_attention_heads"] == demo.num_heads
    assert config["num_key_value_heads"] == demo.num_kv_heads
    assert config["head_dim"] == demo.head_dim
    assert config["vocab_size"] == demo.vocab_size == tokenizer.get_vocab_size(with_added_tokens=True)
    assert config["max_position_embeddings"] == 32768
    assert config["rope_theta"] == 10000.0
    assert config["hidden_act"] == "silu"
    assert config["torch_dtype"] == "float32"

    im_end = tokenizer.token_to_id("<|im_end|>")
    endoftext = tokenizer.token_to_id("<|endoftext|>")
    assert config["eos_token_id"] == im_end
    assert config["pad_token_id"] == endoftext
    generation = json.loads((model_dir / "generation_config.json").read_text(encoding="utf-8"))
    assert generation["eos_token_id"] == [im_end, endoftext]
    assert generation["bos_token_id"] == config["bos_token_id"]
    assert generation["pad_token_id"] == config["pad_token_id"]

    tok_config = json.loads((model_dir / "tokenizer_config.json").read_text(encoding="utf-8"))
    assert tok_config["chat_template"] == (model_dir / "chat_template.jinja").read_text(encoding="utf-8")
    assert tok_config["eos_token"] == "<|im_end|>"
    assert tok_config["pad_token"] == "<|endoftext|>"
    assert tok_config["bos_token"] == "<|endoftext|>"
    assert {int(i): entry["content"] for i, entry in tok_config["added_tokens_decoder"].items()} == {
        tokenizer.token_to_id(t): t for t in SPECIAL_TOKENS
    }
    assert all(entry["special"] for entry in tok_config["added_tokens_decoder"].values())
    special_map = json.loads((model_dir / "special_tokens_map.json").read_text(encoding="utf-8"))
    assert special_map["eos_token"]["content"] == "<|im_end|>"


# --------------------------------------------------------------------------- #
# ONNX interface
# --------------------------------------------------------------------------- #


def test_session_io_matches_optimum(session: ort.InferenceSession, config: dict) -> None:
    layers = range(config["num_hidden_layers"])
    past_names = {f"past_key_values.{i}.{kind}" for i in layers for kind in ("key", "value")}
    present_names = {f"present.{i}.{kind}" for i in layers for kind in ("key", "value")}
    inputs = {i.name: i for i in session.get_inputs()}
    outputs = {o.name: o for o in session.get_outputs()}

    assert set(inputs) == {"input_ids", "attention_mask", "position_ids"} | past_names
    assert set(outputs) == {"logits"} | present_names
    for name in ("input_ids", "attention_mask", "position_ids"):
        assert inputs[name].type == "tensor(int64)", name
    for name in past_names:
        assert inputs[name].type == "tensor(float)", name
    for name in present_names | {"logits"}:
        assert outputs[name].type == "tensor(float)", name

    kv, head_dim = config["num_key_value_heads"], config["head_dim"]
    assert inputs["input_ids"].shape == ["batch_size", "sequence_length"]
    assert inputs["position_ids"].shape == ["batch_size", "sequence_length"]
    assert inputs["past_key_values.0.key"].shape == [
        "batch_size",
        kv,
        "past_sequence_length",
        head_dim,
    ]
    assert outputs["logits"].shape == [
        "batch_size",
        "sequence_length",
        config["vocab_size"],
    ]
    assert outputs["present.0.value"].shape[:2] == ["batch_size", kv]
    assert outputs["present.0.value"].shape[3] == head_dim
    assert inputs["attention_mask"].shape[1] == outputs["present.0.key"].shape[2]


def test_graph_uses_only_standard_ops(model_dir: Path) -> None:
    model = onnx.load(str(model_dir / "model.onnx"), load_external_data=False)
    assert {op.domain for op in model.opset_import} == {""}
    assert {node.domain for node in model.graph.node} == {""}
    onnx.checker.check_model(str(model_dir / "model.onnx"), full_check=True)


# --------------------------------------------------------------------------- #
# Numerics
# --------------------------------------------------------------------------- #


def reference_logits(model_dir: Path, config: dict, input_ids: np.ndarray) -> np.ndarray:
    """Independent numpy Qwen2 forward pass (HF modeling_qwen2 maths), for one unpadded batch."""
    model = onnx.load(str(model_dir / "model.onnx"))
    w = {t.name: numpy_helper.to_array(t).astype(np.float64) for t in model.graph.initializer}
    eps = config["rms_norm_eps"]
    heads, kv_heads, head_dim = (
        config["num_attention_heads"],
        config["num_key_value_heads"],
        config["head_dim"],
    )

    def rms_norm(x: np.ndarray, weight: np.ndarray) -> np.ndarray:
        return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * weight

    def rotate_half(x: np.ndarray) -> np.ndarray:
        half = x.shape[-1] // 2
        return np.concatenate([-x[..., half:], x[..., :half]], axis=-1)

    batch, seq = input_ids.shape
    inv_freq = 1.0 / config["rope_theta"] ** (np.arange(0, head_dim, 2) / head_dim)
    emb = np.concatenate([np.outer(np.arange(seq), inv_freq)] * 2, axis=-1)
    cos, sin = np.cos(emb), np.sin(emb)
    causal = np.tril(np.ones((seq, seq), dtype=bool))

    h = w["model.embed_tokens.weight"][input_ids]
    for layer in range(config["num_hidden_layers"]):
        p = f"model.layers.{layer}"
        x = rms_norm(h, w[f"{p}.input_layernorm.weight"])

        def proj(name: str, n: int, x: np.ndarray = x, p: str = p) -> np.ndarray:
            y = x @ w[f"{p}.self_attn.{name}.weight"] + w[f"{p}.self_attn.{name}.bias"]
            return y.reshape(batch, seq, n, head_dim).transpose(0, 2, 1, 3)

        q, k, v = (
            proj("q_proj", heads),
            proj("k_proj", kv_heads),
            proj("v_proj", kv_heads),
        )
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        # HF repeat_kv: query head i uses kv head i // n_rep.
        k = np.repeat(k, heads // kv_heads, axis=1)
        v = np.repeat(v, heads // kv_heads, axis=1)
        scores = q @ k.transpose(0, 1, 3, 2) / np.sqrt(head_dim)
        scores = np.where(causal, scores, -np.inf)
        probs = np.exp(scores - scores.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
        context = (probs @ v).transpose(0, 2, 1, 3).reshape(batch, seq, heads * head_dim)
        h = h + context @ w[f"{p}.self_attn.o_proj.weight"]

        x = rms_norm(h, w[f"{p}.post_attention_layernorm.weight"])
        gate = x @ w[f"{p}.mlp.gate_proj.weight"]
        up = x @ w[f"{p}.mlp.up_proj.weight"]
        h = h + (gate / (1 + np.exp(-gate)) * up) @ w[f"{p}.mlp.down_proj.weight"]

    h = rms_norm(h, w["model.norm.weight"])
    logits = h @ w["lm_head.weight"] + w["lm_head.bias"]
    if EOS_HEAD_WEIGHT in w:
        logits[..., config["eos_token_id"]] = reference_eos_logit(logits, h, w[EOS_HEAD_WEIGHT], np.arange(seq))
    return logits


def reference_eos_logit(logits: np.ndarray, hidden: np.ndarray, direction: np.ndarray, positions: np.ndarray):
    """The EOS head as fixture_models.demo describes it: the best logit, plus the mood, minus the handicap."""
    mood = demo.EOS_MOOD_GAIN * np.clip(hidden @ direction[:, 0], -demo.EOS_MOOD_LIMIT, demo.EOS_MOOD_LIMIT)
    start, end = demo.EOS_RAMP_START, demo.EOS_RAMP_END
    shrink = (
        (demo.EOS_HANDICAP_START - demo.EOS_HANDICAP_END) * np.clip(positions - start, 0, end - start) / (end - start)
    )
    handicap = np.where(positions < start, demo.EOS_OUT_OF_REACH, demo.EOS_HANDICAP_START - shrink)
    return logits.max(-1) + mood - handicap


def test_matches_numpy_reference(session: ort.InferenceSession, config: dict, model_dir: Path) -> None:
    ids = random_prompt(config, 16, seed=7)
    logits, _ = forward(session, config, ids)
    expected = reference_logits(model_dir, config, ids)
    np.testing.assert_allclose(logits, expected, rtol=1e-4, atol=1e-3)


def test_the_eos_head_matches_the_reference_before_on_and_after_its_ramp(
    session: ort.InferenceSession, config: dict, model_dir: Path
) -> None:
    length = demo.EOS_RAMP_END + 40
    ids = random_prompt(config, length, seed=5)
    logits, _ = forward(session, config, ids)
    expected = reference_logits(model_dir, config, ids)
    eos = config["eos_token_id"]
    np.testing.assert_allclose(logits[..., eos], expected[..., eos], rtol=1e-4, atol=1e-3)
    # Before the ramp EOS trails the best token by more than any temperature makes up for.
    others = np.delete(logits[0], eos, axis=-1).max(-1)
    reach = demo.EOS_OUT_OF_REACH - demo.EOS_MOOD_GAIN * demo.EOS_MOOD_LIMIT
    assert (logits[0, : demo.EOS_RAMP_START, eos] <= others[: demo.EOS_RAMP_START] - reach + 1e-3).all()
    assert (logits[0, demo.EOS_RAMP_START :, eos] > others[demo.EOS_RAMP_START :] - reach).all()


def test_kv_cache_matches_full_forward(session: ort.InferenceSession, config: dict) -> None:
    ids = random_prompt(config, 20)
    full, full_present = forward(session, config, ids)
    assert full.shape == (1, 20, config["vocab_size"])
    assert full_present["past_key_values.0.key"].shape == (
        1,
        config["num_key_value_heads"],
        20,
        config["head_dim"],
    )

    # Prefill 5 tokens, then decode the rest one at a time.
    prefill = 5
    logits, past = forward(session, config, ids[:, :prefill])
    steps = [logits]
    for t in range(prefill, 20):
        logits, past = forward(session, config, ids[:, t : t + 1], past=past)
        assert past["past_key_values.1.value"].shape[2] == t + 1
        steps.append(logits)
    incremental = np.concatenate(steps, axis=1)
    np.testing.assert_allclose(incremental, full, rtol=1e-5, atol=1e-4)
    for name, value in full_present.items():
        np.testing.assert_allclose(past[name], value, rtol=1e-5, atol=1e-5, err_msg=name)

    # Chunked prefill: two chunks of 10.
    first, past = forward(session, config, ids[:, :10])
    second, _ = forward(session, config, ids[:, 10:], past=past)
    np.testing.assert_allclose(np.concatenate([first, second], axis=1), full, rtol=1e-5, atol=1e-4)


def test_left_padding_matches_unpadded(session: ort.InferenceSession, config: dict, tokenizer: Tokenizer) -> None:
    long_ids = tokenizer.encode("The keeper climbed the stairs at dusk with a lantern.").ids
    short_ids = tokenizer.encode("Grüße aus München 🚀").ids
    assert len(short_ids) < len(long_ids)
    pad = len(long_ids) - len(short_ids)
    pad_id = config["pad_token_id"]

    input_ids = np.array([long_ids, [pad_id] * pad + short_ids])
    attention_mask = np.array([[1] * len(long_ids), [0] * pad + [1] * len(short_ids)])
    # HF convention: positions count real tokens only; padded slots get 1.
    position_ids = np.where(attention_mask == 1, np.cumsum(attention_mask, axis=1) - 1, 1)
    batch_logits, batch_past = forward(session, config, input_ids, attention_mask, position_ids)
    assert np.isfinite(batch_logits).all()  # fully masked padding rows must not be NaN

    alone_long, long_past = forward(session, config, np.array([long_ids]))
    alone_short, short_past = forward(session, config, np.array([short_ids]))
    np.testing.assert_allclose(batch_logits[0, -1], alone_long[0, -1], rtol=1e-5, atol=1e-4)
    np.testing.assert_allclose(batch_logits[1, -1], alone_short[0, -1], rtol=1e-5, atol=1e-4)

    # One decode step through the padded cache still matches.
    next_ids = np.array([[11], [12]])
    step_mask = np.concatenate([attention_mask, np.ones((2, 1), dtype=np.int64)], axis=1)
    step_positions = position_ids[:, -1:] + 1
    step_logits, _ = forward(session, config, next_ids, step_mask, step_positions, past=batch_past)
    ref_long, _ = forward(session, config, next_ids[:1], past=long_past)
    ref_short, _ = forward(session, config, next_ids[1:], past=short_past)
    np.testing.assert_allclose(step_logits[0, -1], ref_long[0, -1], rtol=1e-5, atol=1e-4)
    np.testing.assert_allclose(step_logits[1, -1], ref_short[0, -1], rtol=1e-5, atol=1e-4)


def test_far_positions_are_finite_and_relative(session: ort.InferenceSession, config: dict) -> None:
    ids = random_prompt(config, 6, seed=3)
    base = 7990
    # Short past at positions 7990..7992, then a 3-token chunk ending at 7995,
    # and a single step at the very last position.
    _, past = forward(session, config, ids[:, :3], position_ids=np.arange(base, base + 3)[None])
    far, past = forward(
        session,
        config,
        ids[:, 3:],
        position_ids=np.arange(base + 3, base + 6)[None],
        past=past,
    )
    last, _ = forward(session, config, ids[:, :1], position_ids=np.array([[8191]]), past=past)
    assert np.isfinite(far).all() and np.isfinite(last).all()

    # RoPE only encodes relative offsets, so shifting every position by a
    # constant changes the logits by float32 rounding of the angles only;
    # the EOS logit alone depends on the position itself.
    near, _ = forward(session, config, ids)
    eos = config["eos_token_id"]
    np.testing.assert_allclose(np.delete(far, eos, -1), np.delete(near[:, 3:], eos, -1), rtol=1e-4, atol=0.01)


def greedy(session: ort.InferenceSession, config: dict, tokenizer: Tokenizer, text: str, limit: int) -> list[int]:
    """Greedy decoding of a chat prompt until a special token or ``limit`` tokens; the special token is kept."""
    special = {tokenizer.token_to_id(t) for t in SPECIAL_TOKENS}
    prompt = tokenizer.encode(f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n").ids
    logits, past = forward(session, config, np.array([prompt]))
    generated: list[int] = []
    while len(generated) < limit and not special & set(generated[-1:]):
        token = int(np.argmax(logits[0, -1]))
        generated.append(token)
        logits, past = forward(session, config, np.array([[token]]), past=past)
    return generated


def test_greedy_generation_of_the_endless_variant_runs_long_without_eos(
    endless_session: ort.InferenceSession, config: dict, tokenizer: Tokenizer
) -> None:
    generated = greedy(endless_session, config, tokenizer, "Tell me a story.", 600)

    assert len(generated) == 600
    assert not {tokenizer.token_to_id(t) for t in SPECIAL_TOKENS} & set(generated)
    assert len(set(generated)) > 30, f"only {len(set(generated))} distinct tokens"
    assert len(tokenizer.decode(generated)) > 600


def test_greedy_generation_ends_with_eos_after_tens_to_hundreds_of_tokens(
    session: ort.InferenceSession, config: dict, tokenizer: Tokenizer
) -> None:
    lengths = []
    for text in ["Tell me a story.", "Hello", "x", "What is 2+2?", "The river, the mountain, the city", "Hi 8"]:
        generated = greedy(session, config, tokenizer, text, 1000)
        assert generated[-1] == config["eos_token_id"], text
        assert len(set(generated)) > 10, text
        lengths.append(len(generated) - 1)
    assert min(lengths) >= 10 and max(lengths) <= 600, lengths
    assert max(lengths) - min(lengths) >= 50, lengths


# --------------------------------------------------------------------------- #
# Tokenizer and chat template
# --------------------------------------------------------------------------- #


@pytest.mark.parametrize(
    "text",
    [
        "Hello, world! The quick brown fox jumps over the lazy dog.",
        "  leading spaces, trailing tabs\t\nand\r\nnew lines  ",
        "Grüße aus München, Ærøskøbing – café naïve façade, où est l'hôtel ?",  # noqa: RUF001
        "我们明天早上八点在火车站见面。今日はとても良い天気ですね。오늘은 날씨가 좋습니다.",
        "Emoji 😀🎉🚀 ❤️ 👨‍👩‍👧‍👦 🇩🇪 and rare ones 🦩🪐",
        "Unseen bytes: \x00\x07 ∮ E⋅da = Q, 𝔘𝔫𝔦𝔠𝔬𝔡𝔢",  # noqa: RUF001
    ],
)
def test_tokenizer_round_trips(tokenizer: Tokenizer, text: str) -> None:
    ids = tokenizer.encode(text).ids
    assert tokenizer.decode(ids) == text
    assert tokenizer.decode(ids, skip_special_tokens=False) == text


def test_tokenizer_merges_common_text(tokenizer: Tokenizer) -> None:
    # A trained BPE should need far fewer tokens than bytes on in-domain text.
    text = "The train left the station and the children played in the garden."
    assert len(tokenizer.encode(text).ids) < len(text.encode()) / 2


def test_special_tokens_are_single_ids(tokenizer: Tokenizer, config: dict) -> None:
    ids = [tokenizer.token_to_id(t) for t in SPECIAL_TOKENS]
    assert len(set(ids)) == len(SPECIAL_TOKENS)
    assert all(i is not None and 0 <= i < config["vocab_size"] for i in ids)
    for token, token_id in zip(SPECIAL_TOKENS, ids, strict=True):
        assert tokenizer.encode(token).ids == [token_id]
        assert tokenizer.encode(f"a{token}b").ids.count(token_id) == 1
    # skip_special_tokens removes them on decode.
    assert tokenizer.decode(tokenizer.encode("hi<|im_end|>").ids) == "hi"


def test_chat_template_renders_chatml(model_dir: Path, tokenizer: Tokenizer) -> None:
    tok_config = json.loads((model_dir / "tokenizer_config.json").read_text(encoding="utf-8"))
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    template = env.from_string(tok_config["chat_template"])
    messages = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Wie geht's? 😀"},
    ]
    rendered = template.render(messages=messages, add_generation_prompt=True)
    assert rendered == (
        "<|im_start|>system\nYou are terse.<|im_end|>\n"
        "<|im_start|>user\nWie geht's? 😀<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    assert template.render(messages=messages, add_generation_prompt=False).endswith("😀<|im_end|>\n")

    ids = tokenizer.encode(rendered).ids
    im_start, im_end = (
        tokenizer.token_to_id("<|im_start|>"),
        tokenizer.token_to_id("<|im_end|>"),
    )
    assert ids[0] == im_start
    assert ids.count(im_start) == 3 and ids.count(im_end) == 2
    assert tokenizer.decode(ids, skip_special_tokens=False) == rendered


# --------------------------------------------------------------------------- #
# What demo writes: the corpus' words, through the real backend
# --------------------------------------------------------------------------- #

# What a word may carry around it and still be the corpus' word ("sea." is "sea").
PUNCTUATION = string.punctuation + "，。、！？：；«»“”‘’—–…"  # noqa: RUF001 - CJK punctuation is intended
CORPUS_WORDS = set(demo._CORPUS.split()) | {word.strip(PUNCTUATION) for word in demo._CORPUS.split()}
READING_PROMPTS = [
    "Hello",
    "Tell me a story.",
    "x",
    "What is 2+2?",
    "Grüße, 東京 🚀 — café, naïve, 서울",
    "Unseen bytes: \x07 ∮ E⋅da = Q, 𝔘𝔫𝔦𝔠𝔬𝔡𝔢",  # noqa: RUF001
    "lighthouse " * 40,  # a long prompt: a short answer
]
READING_SEEDS = [None, 1, 2, 3]  # None: greedy
# The module docstring's bound: every text ends by about the end of the EOS head's ramp.
MOST_TOKENS = 600


@pytest.fixture(scope="module")
def backend_model(model_dir: Path) -> Iterator[OnnxModel]:
    loaded = OnnxRuntimeBackend().load(model_dir, device="cpu")
    yield loaded
    loaded.close()


def answer(model: OnnxModel, text: str, seed: int | None) -> OnnxGeneration:
    """The whole answer to a one-message chat: greedy when ``seed`` is None, else sampled at temperature 1."""
    params = (
        SamplingParams(temperature=0, max_output_tokens=1000)
        if seed is None
        else SamplingParams(temperature=1.0, seed=seed, max_output_tokens=1000)
    )
    generation = model.generate(model.prompt_ids(prompt_for({"input": text})), params, should_stop=lambda: False)
    for _ in generation:
        pass
    return generation


@pytest.mark.parametrize("text", READING_PROMPTS)
def test_the_demo_writes_corpus_words_and_ends_by_itself(backend_model: OnnxModel, text: str) -> None:
    for seed in READING_SEEDS:
        generation = answer(backend_model, text, seed)
        written = generation.text()
        assert generation.finish_reason == FINISH_EOS, (seed, written)
        assert generation.output_tokens <= MOST_TOKENS, (seed, generation.output_tokens)
        assert "\ufffd" not in written, (seed, written)
        assert not [char for char in written if char != "\n" and unicodedata.category(char)[0] == "C"], (seed, written)
        # JSON's own tokens only where the context holds JSON (issue 41): none of these prompts does.
        assert not set("{}") & set(written) and '":' not in written, (seed, written)
        words = written.split()
        known = [word for word in words if word in CORPUS_WORDS or word.strip(PUNCTUATION) in CORPUS_WORDS]
        assert len(words) >= 3 and len(known) >= 0.9 * len(words), (seed, written)


def test_the_demo_writes_other_words_for_other_prompts_and_seeds(backend_model: OnnxModel) -> None:
    texts = {answer(backend_model, text, seed).text() for text in ("Hello", "x") for seed in READING_SEEDS}
    assert len(texts) == 2 * len(READING_SEEDS)
    assert len({word for text in texts for word in text.split()}) > 100


def test_no_prompt_makes_a_control_character_or_a_stray_utf8_piece_possible(
    session: ort.InferenceSession, config: dict, tokenizer: Tokenizer
) -> None:
    byte_of = {char: byte for byte, char in _bytes_to_unicode().items()}
    pieces = {i: bytes(byte_of[c] for c in token) for token, i in tokenizer.get_vocab(with_added_tokens=False).items()}

    def whole(piece: bytes) -> bool:
        try:
            piece.decode("utf-8")
        except UnicodeDecodeError:
            return False
        return True

    vocab = config["vocab_size"]
    # Special tokens (but the EOS token, which the EOS head gives its own logit) and tokens with a control character.
    never = np.zeros(vocab, dtype=bool)
    never[[tokenizer.token_to_id(t) for t in SPECIAL_TOKENS if t != "<|im_end|>"]] = True
    for i, piece in pieces.items():
        never[i] = whole(piece) and any(c != "\n" and unicodedata.category(c)[0] == "C" for c in piece.decode())
    # Tokens that continue a character another token began: never after a token that ends a character.
    continuation = np.array([i in pieces and 0x80 <= pieces[i][0] < 0xC0 for i in range(vocab)])
    ends_a_character = np.array([i not in pieces or whole(pieces[i]) for i in range(vocab)])
    assert never.sum() > len(SPECIAL_TOKENS) and continuation.sum() > 30

    for seed in range(6):
        ids = np.random.default_rng(seed).integers(0, vocab, (1, 64))  # special tokens and stray pieces too
        logits, _ = forward(session, config, ids)
        scores = logits[0].astype(np.float64)
        probs = np.exp(scores - scores.max(axis=-1, keepdims=True))
        probs /= probs.sum(axis=-1, keepdims=True)
        assert probs[:, never].sum(axis=-1).max() < 1e-12
        assert probs[ends_a_character[ids[0]]][:, continuation].sum(axis=-1).max() < 1e-12


# --------------------------------------------------------------------------- #
# Served: the real worker, over HTTP and the openai package
# --------------------------------------------------------------------------- #

# Far above any natural ending: a text that reaches it did not end by itself.
ROOM = 1500


@pytest.mark.slow
def test_the_served_demo_ends_by_itself_after_lengths_that_vary_with_the_prompt(api, running_worker):
    subjects = ["rivers", "a lighthouse", "the storm", "bread", "trains", "numbers", "a garden", "the sea", "music"]
    requests = [
        {"input": f"Tell me about {subject}.", "seed": n, **({"temperature": 0} if n % 2 else {})}
        for n, subject in enumerate(subjects + [f"question {n}?" for n in range(11)])
    ]
    tasks = [create(api, request.pop("input"), max_output_tokens=ROOM, **request) for request in requests]

    lengths = []
    for task in tasks:
        done = wait_for_status(api, task["id"], {"succeeded", "failed", "cancelled"})
        assert (done["status"], done["response"]["status"]) == ("succeeded", "completed"), done
        lengths.append(done["response"]["usage"]["output_tokens"])
    assert min(lengths) >= 10 and max(lengths) < ROOM / 2, lengths
    assert max(lengths) - min(lengths) >= 100 and len(set(lengths)) >= len(lengths) // 2, lengths


@pytest.mark.slow
def test_the_openai_packages_stream_helper_gets_the_completed_response(api, running_worker, web_server):
    sdk = openai.OpenAI(base_url=f"{web_server.base}/lmsp/v1", api_key=api.token, max_retries=0, timeout=60)

    with sdk.responses.stream(model="demo", input="Hello", max_output_tokens=ROOM) as stream:
        final = stream.get_final_response()

    assert final.status == "completed"
    assert 0 < final.usage.output_tokens < ROOM / 2
    assert final.output_text
