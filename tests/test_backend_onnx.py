"""The ONNX Runtime backend on the real demo model: KV cache, sampling, streaming text, resume, loading.

No mocks: every test runs real ONNX Runtime sessions on the tiny random
Qwen2-style model from ``fixture_models.demo``. No database is touched.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort
import pytest

from fixture_models.demo import _bytes_to_unicode
from tests.support.specs import prompt_for
from workers.backends import get_backend
from workers.backends import onnx as onnx_backend
from workers.backends.base import (
    FINISH_CANCELLED,
    FINISH_EOS,
    FINISH_LENGTH,
    FINISH_STOP,
    SamplingParams,
    Step,
)
from workers.backends.detokenizer import StopFilter, StreamDetokenizer
from workers.backends.errors import GenerationError, ModelLoadError, PromptRejected
from workers.backends.onnx import OnnxGeneration, OnnxModel, OnnxRuntimeBackend, cuda_device_count
from workers.backends.onnx.cuda_libs import CudaLibraries

# No database here: the PostgreSQL pass of scripts/test leaves these out (tests/conftest.py).
pytestmark = pytest.mark.database_free

PROMPT = {"instructions": "Tell a story.", "input": "The lighthouse keeper climbed the stairs"}
NON_ASCII_PROMPT = {"input": "Grüße, 東京 🚀 — café, naïve, 서울"}
# Whether this machine can really run the CUDA provider (the CI machine cannot).
CUDA_READY = "CUDAExecutionProvider" in ort.get_available_providers() and cuda_device_count() > 0


def never() -> bool:
    return False


# --------------------------------------------------------------------------- #
# Fixtures and helpers
# --------------------------------------------------------------------------- #


@pytest.fixture(scope="module")
def model_dir(demo_models_root: Path) -> Path:
    return demo_models_root / "demo"


@pytest.fixture(scope="module")
def model(model_dir: Path) -> Iterator[OnnxModel]:
    loaded = OnnxRuntimeBackend().load(model_dir, device="cpu")
    yield loaded
    loaded.close()


@pytest.fixture(scope="module")
def prompt(model: OnnxModel) -> list[int]:
    return model.prompt_ids(prompt_for(PROMPT))


@pytest.fixture(scope="module")
def greedy_run(model: OnnxModel, prompt: list[int]) -> OnnxGeneration:
    """One uninterrupted greedy run of 40 tokens that several tests compare against."""
    generation = model.generate(prompt, SamplingParams(temperature=0, max_output_tokens=40), should_stop=never)
    list(generation)
    return generation


def copy_model(src: Path, dst: Path, **rewrites: Callable[[dict[str, Any]], None]) -> Path:
    """A copy of a model folder; each keyword names a JSON file (``config`` -> config.json) to edit in place."""
    shutil.copytree(src, dst)
    for stem, edit in rewrites.items():
        path = dst / f"{stem}.json"
        data = json.loads(path.read_text(encoding="utf-8"))
        edit(data)
        path.write_text(json.dumps(data), encoding="utf-8")
    return dst


def run(generation: OnnxGeneration, limit: int | None = None) -> list[Step]:
    """Iterate a generation, stopping early after ``limit`` steps (without cancelling it)."""
    steps: list[Step] = []
    for step in generation:
        steps.append(step)
        if limit is not None and len(steps) == limit:
            break
    return steps


def token_ids(steps: Sequence[Step]) -> list[int]:
    return [s.token_id for s in steps if s.token_id is not None]


def joined(steps: Sequence[Step]) -> str:
    return "".join(s.text for s in steps)


def reference_logits(model: OnnxModel, ids: Sequence[int]) -> np.ndarray:
    """Last-position logits from one plain ``session.run`` over all ids: no cache, no IOBinding."""
    graph = model.graph
    empty = np.zeros((1, graph.kv_heads, 0, graph.head_dim), dtype=graph.kv_dtype)
    feeds: dict[str, np.ndarray] = {
        "input_ids": np.asarray([ids], dtype=np.int64),
        "attention_mask": np.ones((1, len(ids)), dtype=np.int64),
        "position_ids": np.arange(len(ids), dtype=np.int64)[None, :],
        **{name: empty for name in graph.past_names},
    }
    (logits,) = model.session.run(["logits"], feeds)
    return logits[0, -1]


# --------------------------------------------------------------------------- #
# KV cache and chunked prefill
# --------------------------------------------------------------------------- #


def test_cached_logits_equal_a_full_recompute(model: OnnxModel, prompt: list[int]) -> None:
    decoder = model.decoder()
    ids = list(prompt)
    logits = decoder.feed(ids)
    for _ in range(20):
        np.testing.assert_allclose(logits, reference_logits(model, ids), rtol=1e-4, atol=1e-3)
        token = int(np.argmax(logits))
        ids.append(token)
        logits = decoder.feed([token])
    assert decoder.past_length == len(ids)
    assert logits.shape == (model.tokenizer.get_vocab_size(),)


def test_chunked_prefill_matches_one_shot(model: OnnxModel, model_dir: Path, prompt: list[int]) -> None:
    chunked = OnnxRuntimeBackend(prefill_chunk=5).load(model_dir, device="cpu")
    assert len(prompt) > 3 * 5 and len(prompt) % 5  # several full chunks and a partial one
    one_shot_decoder, chunked_decoder = model.decoder(), chunked.decoder()
    np.testing.assert_allclose(chunked_decoder.feed(prompt), one_shot_decoder.feed(prompt), rtol=1e-5, atol=1e-4)
    assert chunked_decoder.past_length == one_shot_decoder.past_length == len(prompt)

    params = SamplingParams(temperature=0, max_output_tokens=25)
    one_shot = model.generate(prompt, params, should_stop=never)
    split = chunked.generate(prompt, params, should_stop=never)
    assert token_ids(run(split)) == token_ids(run(one_shot))
    assert len(split.generated_ids) == 25


# --------------------------------------------------------------------------- #
# Resume from a snapshot
# --------------------------------------------------------------------------- #


@pytest.mark.parametrize(
    ("params", "k"),
    [
        (SamplingParams(temperature=0.8, top_p=0.9, seed=1234, max_output_tokens=48), 17),
        (SamplingParams(temperature=0.8, top_p=0.9, seed=99, max_output_tokens=30, stop=("QQQQQQQQQQ",)), 11),
        (SamplingParams(temperature=0, max_output_tokens=30), 9),
        (SamplingParams(temperature=1.0, seed=5, max_output_tokens=20), 0),
    ],
    ids=["sampled", "sampled-holding-stop-text", "greedy", "before-first-token"],
)
def test_resume_continues_token_for_token(model: OnnxModel, prompt: list[int], params: SamplingParams, k: int) -> None:
    whole = model.generate(prompt, params, should_stop=never)
    whole_steps = run(whole)

    first = model.generate(prompt, params, should_stop=never)
    first_steps = run(first, limit=k) if k else []
    snapshot = json.loads(json.dumps(first.snapshot()))
    assert snapshot["version"] == 1
    assert snapshot["generated_ids"] == token_ids(first_steps)
    if params.stop:
        assert snapshot["held_text"]  # the stop filter really held text across the snapshot

    resumed = model.resume(snapshot, params, should_stop=never)
    rest = run(resumed)
    assert token_ids(first_steps) + token_ids(rest) == token_ids(whole_steps)
    assert joined(first_steps) + joined(rest) == joined(whole_steps) == whole.text()
    assert resumed.text() == whole.text()
    assert resumed.finish_reason == whole.finish_reason == FINISH_LENGTH
    assert resumed.output_tokens == whole.output_tokens == params.max_output_tokens
    assert resumed.seed == first.seed == snapshot["seed"]


def test_snapshot_parts_taken_as_a_store_appends_them_rejoin_to_the_whole_snapshot(
    model: OnnxModel, prompt: list[int]
) -> None:
    params = SamplingParams(temperature=0.8, top_p=0.9, seed=77, max_output_tokens=40)
    generation = model.generate(prompt, params, should_stop=never)
    ids, first_state = generation.snapshot_since(0, with_prompt=True)
    stored, last_state = list(ids), first_state
    for index, _step in enumerate(generation):
        if index % 7 == 6:  # a "batch" every 7 steps
            new_ids, last_state = generation.snapshot_since(len(stored), with_prompt=False)
            stored += new_ids
            assert "prompt_ids" not in last_state and "text" not in last_state
        if index == 24:
            break
    new_ids, last_state = generation.snapshot_since(len(stored), with_prompt=False)  # the last, partial batch
    stored += new_ids

    rejoined = {**last_state, "prompt_ids": first_state["prompt_ids"], "generated_ids": stored}
    whole = generation.snapshot()
    assert rejoined == {key: value for key, value in whole.items() if key != "text"}
    resumed = model.resume(json.loads(json.dumps({**rejoined, "text": generation.text()})), params, should_stop=never)
    uninterrupted = model.generate(prompt, params, should_stop=never)
    assert token_ids(run(uninterrupted)) == stored + token_ids(run(resumed))


def test_snapshot_of_a_stopped_generation_does_not_resume_past_the_stop(
    model: OnnxModel, prompt: list[int], greedy_run: OnnxGeneration
) -> None:
    stop = greedy_run.text()[12:16]
    params = SamplingParams(temperature=0, max_output_tokens=40, stop=(stop,))
    generation = model.generate(prompt, params, should_stop=never)
    run(generation)
    resumed = model.resume(json.loads(json.dumps(generation.snapshot())), params, should_stop=never)
    assert run(resumed) == []
    assert resumed.finish_reason == FINISH_STOP
    assert resumed.text() == generation.text()


def test_resume_rejects_a_broken_snapshot(model: OnnxModel, prompt: list[int]) -> None:
    generation = model.generate(prompt, SamplingParams(seed=1, max_output_tokens=5), should_stop=never)
    run(generation, limit=3)
    snapshot = generation.snapshot()
    for broken in (
        {**snapshot, "version": 2},
        {**snapshot, "released_chars": 10**6},
        {k: v for k, v in snapshot.items() if k != "rng_state"},
    ):
        with pytest.raises(GenerationError):
            model.resume(broken, SamplingParams(seed=1, max_output_tokens=5), should_stop=never)


# --------------------------------------------------------------------------- #
# Streaming text
# --------------------------------------------------------------------------- #


def test_streamed_text_equals_the_full_decode_with_multibyte_characters(model: OnnxModel) -> None:
    prompt = model.prompt_ids(prompt_for(NON_ASCII_PROMPT))
    generation = model.generate(
        prompt, SamplingParams(temperature=1.0, seed=7, max_output_tokens=300), should_stop=never
    )
    steps = run(generation)
    full = model.tokenizer.decode(generation.generated_ids, skip_special_tokens=True)
    assert joined(steps) == generation.text() == full
    assert any(ord(char) > 127 for char in full)
    # Some token ended inside a character: its step released nothing, a later one the whole character.
    assert any(s.token_id is not None and s.text == "" for s in steps)
    position = 0
    for step in steps:
        if "\ufffd" in step.text:
            expected = full[position : position + len(step.text)]
            assert step.text == expected and "\ufffd" in expected
        position += len(step.text)
    assert position == len(full)


def test_detokenizer_releases_whole_characters_from_byte_tokens(model: OnnxModel) -> None:
    tokenizer = model.tokenizer
    table = _bytes_to_unicode()
    text = "Grüße 東京 🚀!"
    ids = [tokenizer.token_to_id(table[byte]) for byte in text.encode("utf-8")]
    assert None not in ids and len(ids) > len(text)

    detokenizer = StreamDetokenizer(tokenizer)
    pieces = [detokenizer.step(ids[: i + 1]) for i in range(len(ids))]
    assert "".join(pieces) == text
    assert all("\ufffd" not in piece for piece in pieces)
    # A piece appears exactly at the last byte of each character.
    ends = {len(text[: i + 1].encode("utf-8")) - 1 for i in range(len(text))}
    assert [i for i, piece in enumerate(pieces) if piece] == sorted(ends)
    assert detokenizer.flush(ids) == ""

    # Offsets restore mid-character: a new detokenizer continues the same way.
    cut = len("Grüße 東".encode())  # inside "京"
    half = StreamDetokenizer(tokenizer)
    early = "".join(half.step(ids[: i + 1]) for i in range(cut))
    restored = StreamDetokenizer(tokenizer, **half.state())
    late = "".join(restored.step(ids[: i + 1]) for i in range(cut, len(ids)))
    assert early + late == text

    # A generation that ends inside a character drops its bytes on flush: never a U+FFFD (issue 41).
    dangling = ids[: len("Grüße ".encode()) + 2]
    cut_off = StreamDetokenizer(tokenizer)
    streamed = "".join(cut_off.step(dangling[: i + 1]) for i in range(len(dangling)))
    assert streamed == "Grüße "
    assert tokenizer.decode(dangling, skip_special_tokens=True) == "Grüße \ufffd"
    assert cut_off.flush(dangling) == ""


def test_stop_filter_holds_back_possible_stop_text() -> None:
    stops = StopFilter(["STOP", "xy"])
    assert stops.push("abcS") == "a"  # keeps 3 chars: "bcS" could grow into "STOP"
    assert stops.push("T") == "b"
    assert stops.push("OPtail") == "c"
    assert stops.stopped and stops.released_chars == 3
    assert stops.push("more") == "" and stops.flush() == ""

    free = StopFilter(["STOP"])
    assert free.push("hello") == "he"
    assert free.flush() == "llo"
    assert free.released_chars == 5
    assert StopFilter([]).push("abc") == "abc"
    restored = StopFilter(["STOP"], held="xST", released_chars=2)
    assert restored.push("OP") == "x" and restored.stopped


# --------------------------------------------------------------------------- #
# How generations end
# --------------------------------------------------------------------------- #


def test_max_output_tokens_gives_exactly_that_many(model: OnnxModel, prompt: list[int]) -> None:
    generation = model.generate(prompt, SamplingParams(seed=3, max_output_tokens=7), should_stop=never)
    steps = run(generation)
    assert generation.finish_reason == FINISH_LENGTH
    assert generation.output_tokens == len(token_ids(steps)) == 7
    assert generation.prompt_tokens == len(prompt)
    assert generation.text() == model.tokenizer.decode(generation.generated_ids, skip_special_tokens=True)


def test_stop_string_ends_the_text_right_before_it(
    model: OnnxModel, prompt: list[int], greedy_run: OnnxGeneration
) -> None:
    full = greedy_run.text()
    stop = full[15:19]
    at = full.find(stop)
    assert at > 0 and len(stop) == 4
    generation = model.generate(
        prompt, SamplingParams(temperature=0, max_output_tokens=40, stop=(stop,)), should_stop=never
    )
    steps = run(generation)
    assert generation.finish_reason == FINISH_STOP
    assert generation.text() == joined(steps) == full[:at]
    assert stop not in generation.text()
    assert generation.output_tokens < 40
    assert steps[-1].token_id is not None  # no flush step after a stop


def test_eos_token_ends_the_generation(
    model_dir: Path, tmp_path: Path, prompt: list[int], greedy_run: OnnxGeneration
) -> None:
    ids = greedy_run.generated_ids
    index = next(i for i in range(4, len(ids)) if ids[i] not in ids[:i])
    eos = ids[index]
    folder = copy_model(model_dir, tmp_path / "eos", generation_config=lambda c: c.update(eos_token_id=[eos]))
    model = OnnxRuntimeBackend().load(folder, device="cpu")
    assert model.eos_token_ids == {eos}
    generation = model.generate(prompt, SamplingParams(temperature=0, max_output_tokens=40), should_stop=never)
    steps = run(generation)
    assert generation.finish_reason == FINISH_EOS
    assert generation.generated_ids == ids[: index + 1]
    assert generation.output_tokens == index + 1
    eos_step = next(s for s in steps if s.token_id == eos)
    assert eos_step.text == ""
    assert generation.text() == joined(steps) == model.tokenizer.decode(ids[:index], skip_special_tokens=True)


def test_should_stop_cancels_after_k_steps(model: OnnxModel, prompt: list[int]) -> None:
    produced: list[Step] = []
    generation = model.generate(
        prompt, SamplingParams(seed=4, max_output_tokens=50), should_stop=lambda: len(produced) >= 6
    )
    for step in generation:
        produced.append(step)
    assert generation.finish_reason == FINISH_CANCELLED
    assert generation.output_tokens == len(produced) == 6
    assert all(s.token_id is not None for s in produced)  # no flush step on cancel

    at_once = model.generate(prompt, SamplingParams(seed=4, max_output_tokens=50), should_stop=lambda: True)
    assert run(at_once) == [] and at_once.finish_reason == FINISH_CANCELLED and at_once.output_tokens == 0


def test_context_window_limits_output_and_rejects_long_prompts(model_dir: Path, tmp_path: Path) -> None:
    folder = copy_model(model_dir, tmp_path / "short", config=lambda c: c.update(max_position_embeddings=40))
    model = OnnxRuntimeBackend().load(folder, device="cpu")
    assert model.context_length == 40
    prompt = model.prompt_ids(prompt_for({"input": "Hi"}))
    generation = model.generate(prompt, SamplingParams(seed=1, max_output_tokens=500), should_stop=never)
    run(generation)
    assert generation.finish_reason == FINISH_LENGTH
    assert generation.output_tokens == 40 - len(prompt)
    long_prompt = model.prompt_ids(
        prompt_for({"input": "The old lighthouse keeper climbed the spiral stairs every evening."})
    )
    assert len(long_prompt) >= 40
    with pytest.raises(GenerationError, match="context window"):
        model.generate(long_prompt, SamplingParams(), should_stop=never)


# --------------------------------------------------------------------------- #
# Seeds and sampling
# --------------------------------------------------------------------------- #


def test_seeds_decide_sampled_output_and_greedy_ignores_them(model: OnnxModel, prompt: list[int]) -> None:
    def ids(**kwargs: Any) -> list[int]:
        generation = model.generate(prompt, SamplingParams(max_output_tokens=24, **kwargs), should_stop=never)
        return token_ids(run(generation))

    assert ids(temperature=1.0, seed=11) == ids(temperature=1.0, seed=11)
    assert ids(temperature=1.0, seed=11) != ids(temperature=1.0, seed=12)
    assert ids(temperature=0, seed=11) == ids(temperature=0, seed=12) == ids(temperature=0)

    unseeded = model.generate(prompt, SamplingParams(temperature=1.0, max_output_tokens=24), should_stop=never)
    first = token_ids(run(unseeded))
    assert isinstance(unseeded.seed, int) and 0 <= unseeded.seed < 2**63
    assert unseeded.snapshot()["seed"] == unseeded.seed
    assert ids(temperature=1.0, seed=unseeded.seed) == first


# --------------------------------------------------------------------------- #
# Prompt rendering
# --------------------------------------------------------------------------- #


def test_prompt_uses_the_chat_template_and_its_special_tokens(model: OnnxModel) -> None:
    request = {
        "instructions": "Be brief.",
        "input": [
            {"type": "message", "role": "developer", "content": "Answer in German."},
            {
                "type": "message",
                "role": "user",
                "content": [
                    {"type": "input_text", "text": "Hello, "},
                    {"type": "input_text", "text": "Grüße!"},
                ],
            },
        ],
    }
    text = model.render_prompt(prompt_for(request))
    assert text == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>system\nAnswer in German.<|im_end|>\n"
        "<|im_start|>user\nHello, Grüße!<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    ids = model.prompt_ids(prompt_for(request))
    start, end = model.tokenizer.token_to_id("<|im_start|>"), model.tokenizer.token_to_id("<|im_end|>")
    assert ids.count(start) == 4 and ids.count(end) == 3
    assert ids[0] == start
    assert model.tokenizer.decode(ids, skip_special_tokens=False) == text


def test_prompt_without_template_and_with_a_raising_template(model_dir: Path, tmp_path: Path) -> None:
    def drop_template(config: dict[str, Any]) -> None:
        config.pop("chat_template")

    plain = copy_model(model_dir, tmp_path / "plain", tokenizer_config=drop_template)
    (plain / "chat_template.jinja").unlink()
    model = OnnxRuntimeBackend().load(plain, device="cpu")
    assert (
        model.render_prompt(prompt_for({"instructions": "Sys", "input": "Hi"})) == "system: Sys\nuser: Hi\nassistant:"
    )
    assert model.tokenizer.decode(model.prompt_ids(prompt_for({"input": "Hi"}))) == "user: Hi\nassistant:"

    strict = copy_model(model_dir, tmp_path / "strict")
    (strict / "chat_template.jinja").write_text(
        "{% if messages[0]['role'] == 'system' %}{{ raise_exception('no system role') }}{% endif %}"
        "{{ bos_token }}{% for m in messages %}{{ m['content'] }}{% endfor %}",
        encoding="utf-8",
    )
    model = OnnxRuntimeBackend().load(strict, device="cpu")
    assert model.render_prompt(prompt_for({"input": "Hi"})) == "<|endoftext|>Hi"
    with pytest.raises(PromptRejected, match="no system role"):
        model.prompt_ids(prompt_for({"instructions": "Sys", "input": "Hi"}))


# --------------------------------------------------------------------------- #
# Loading, devices, registry
# --------------------------------------------------------------------------- #


def assert_load_fails(folder: Path, needle: str, **kwargs: Any) -> ModelLoadError:
    with pytest.raises(ModelLoadError) as caught:
        OnnxRuntimeBackend().load(folder, **kwargs)
    error = caught.value
    assert type(error) is ModelLoadError  # what workers.execution reports as model_load_failed
    assert needle in str(error)
    assert "Traceback" not in str(error) and "\n" not in str(error)
    return error


def test_load_failures_raise_model_load_failed(model_dir: Path, tmp_path: Path) -> None:
    assert_load_fails(tmp_path / "nowhere", "does not exist", device="cpu")

    corrupt = copy_model(model_dir, tmp_path / "corrupt")
    (corrupt / "model.onnx").write_bytes(b"\x00garbage\xff" * 100)
    assert_load_fails(corrupt, "could not load", device="cpu")

    no_tokenizer = copy_model(model_dir, tmp_path / "no-tokenizer")
    (no_tokenizer / "tokenizer.json").unlink()
    assert_load_fails(no_tokenizer, "tokenizer.json", device="cpu")

    bad_config = copy_model(model_dir, tmp_path / "bad-config")
    (bad_config / "config.json").write_text("{not json", encoding="utf-8")
    assert_load_fails(bad_config, "config.json", device="cpu")

    assert_load_fails(model_dir, "unknown device", device="tpu")


def test_cpu_device_and_registry(model_dir: Path) -> None:
    model = get_backend("onnxruntime").load(model_dir, device="cpu")
    assert model.provider == "CPUExecutionProvider" and model.device_type == "cpu"
    assert model.resumable is True and model.context_length == 32768
    model.close()
    with pytest.raises(GenerationError, match="closed"):
        model.generate([1, 2, 3], SamplingParams(), should_stop=never)
    with pytest.raises(ModelLoadError) as caught:
        get_backend("llama.cpp")
    assert type(caught.value) is ModelLoadError  # what workers.execution reports as model_load_failed


def test_auto_and_cuda_devices_follow_what_the_machine_has(
    model_dir: Path, capfd: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level("DEBUG", logger="workers.backends.onnx")
    capfd.readouterr()
    auto = OnnxRuntimeBackend().load(model_dir, device="auto")
    assert auto.provider == ("CUDAExecutionProvider" if CUDA_READY else "CPUExecutionProvider")
    assert f"model demo loaded on {auto.provider}" in caplog.text
    if not CUDA_READY:
        assert "CUDA" not in capfd.readouterr().err  # auto stayed quiet on a machine without CUDA
        assert_load_fails(model_dir, "CUDA requested", device="cuda")
    else:
        assert OnnxRuntimeBackend().load(model_dir, device="cuda").provider == "CUDAExecutionProvider"


def test_cuda_fallback_is_detected_after_session_creation(model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Pretend the driver reports a device: onnxruntime then really tries CUDA and falls back to CPU."""
    if CUDA_READY:  # nothing falls back on such a machine: the real CUDA session must come up
        assert OnnxRuntimeBackend().load(model_dir, device="cuda").provider == "CUDAExecutionProvider"
        return
    monkeypatch.setattr(onnx_backend.session, "cuda_device_count", lambda: 1)
    # The CUDA libraries count as loaded (tests/test_onnx_session.py has them missing): ORT itself tries.
    monkeypatch.setattr(onnx_backend.session, "preload_cuda_libraries", lambda: CudaLibraries())
    if "CUDAExecutionProvider" in ort.get_available_providers():
        assert_load_fails(model_dir, "fell back", device="cuda")
    else:
        assert_load_fails(model_dir, "no CUDAExecutionProvider", device="cuda")
    assert OnnxRuntimeBackend().load(model_dir, device="auto").provider == "CPUExecutionProvider"


def test_threads_do_not_spin_between_steps_unless_asked(model: OnnxModel, model_dir: Path) -> None:
    # A spinning thread pool keeps a core busy while the worker commits and the
    # web process streams; it is an opt-in for hosts that only generate.
    key = "session.intra_op.allow_spinning"
    assert model.session.get_session_options().get_session_config_entry(key) == "0"
    spinning = OnnxRuntimeBackend().load(model_dir, device="cpu", spinning=True)
    try:
        # Not set at all: ONNX Runtime's default, which spins.
        with pytest.raises(RuntimeError, match="does not have configuration"):
            spinning.session.get_session_options().get_session_config_entry(key)
    finally:
        spinning.close()
