"""OpenAI's frequency and presence penalties, as vLLM applies them.

For every id ``j`` generated ``c[j]`` times so far (the prompt does not
count), ``logit[j] -= c[j] * frequency_penalty + (c[j] > 0) * presence_penalty``,
in float32, after the repetition penalty and before temperature and the cuts,
greedy decoding included. The expectations are that formula in plain numpy
over the whole row; then the same through the ONNX backend on the demo model,
a batched row against the same request alone.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from tests.support.specs import prompt_for, sampler_values
from tests.test_engine import Request, alone, fresh_engine, ids_of, run_together, varied
from tests.test_sampling import PROMPT, never, penalised, plain_pick
from workers.backends.base import SamplingParams
from workers.backends.errors import GenerationError
from workers.backends.onnx import OnnxModel, OnnxRuntimeBackend
from workers.backends.sampling import Sampler, SamplingDefaults, SamplingSettings

# No database here: the PostgreSQL pass of scripts/test leaves these out (tests/conftest.py).
pytestmark = pytest.mark.database_free


def reference_row(
    logits: np.ndarray, prompt: Sequence[int], generated: Sequence[int], settings: SamplingSettings
) -> np.ndarray:
    """The penalties as formulas over the whole row: repetition (prompt and output), then frequency, then presence."""
    row = np.array(logits, dtype=np.float32)
    if settings.repetition_penalty != 1.0 and len(prompt) + len(generated):
        row = penalised(row, [*prompt, *generated], settings.repetition_penalty)
    counts = np.bincount(np.asarray(generated, dtype=np.int64), minlength=len(row)).astype(np.float32)
    row = row - np.float32(settings.frequency_penalty) * counts
    return row - np.float32(settings.presence_penalty) * (counts > 0).astype(np.float32)


def reference_pick(row: np.ndarray, settings: SamplingSettings, rng: np.random.Generator) -> int:
    """Greedy's argmax, or the cuts' pick with the next number of the sampler's twin generator."""
    return int(np.argmax(row)) if settings.greedy else plain_pick(row, settings, rng.random())


def make(
    settings: SamplingSettings, *, seed: int = 0, prompt: Sequence[int] = (), generated: Sequence[int] = (), vocab: int
) -> Sampler:
    return Sampler(settings, seed=seed, context_ids=prompt, generated_ids=generated, vocab_size=vocab)


# --------------------------------------------------------------------------- #
# The formula
# --------------------------------------------------------------------------- #

CASES = [
    {"temperature": 0.0, "frequency_penalty": 0.7},
    {"temperature": 0.0, "presence_penalty": 1.5},
    {"temperature": 0.0, "frequency_penalty": -0.4, "presence_penalty": 0.9},
    {"temperature": 0.0, "frequency_penalty": 0.3, "presence_penalty": -2.0, "repetition_penalty": 1.3},
    {"temperature": 0.0, "frequency_penalty": 2.0, "presence_penalty": 2.0, "repetition_penalty": 0.8},
    {"temperature": 1.0, "frequency_penalty": 0.5},
    {"temperature": 1.0, "frequency_penalty": -1.0, "presence_penalty": 1.0, "repetition_penalty": 1.2},
    {"temperature": 0.7, "top_k": 20, "top_p": 0.8, "presence_penalty": 1.2, "repetition_penalty": 1.05},
    {"temperature": 1.3, "top_p": 0.9, "min_p": 0.05, "frequency_penalty": 1.1, "presence_penalty": -0.5},
]


@pytest.mark.parametrize("vocab", [12, 4000])
@pytest.mark.parametrize("case", CASES, ids=lambda case: "-".join(f"{k}={v}" for k, v in case.items()))
def test_every_pick_is_the_formulas_pick_over_random_rows_and_histories(vocab: int, case: dict) -> None:
    """A random earlier output, then steps the sampler remembers itself: the reference's token every time."""
    settings = SamplingSettings(**case)
    rng = np.random.default_rng(vocab)
    changed = 0
    for trial in range(12):
        prompt = rng.integers(0, vocab, size=int(rng.integers(1, 20))).tolist()
        # Few distinct ids, so counts climb well past 1, and never all of them: presence alone
        # would then lower every score alike and change no pick.
        generated = rng.integers(0, min(vocab // 2, 40), size=int(rng.integers(0, 60))).tolist()
        sampler = make(settings, seed=trial, prompt=prompt, generated=generated, vocab=vocab)
        twin = np.random.Generator(np.random.PCG64(trial))
        plain = np.random.Generator(np.random.PCG64(trial))
        for _ in range(8):
            logits = (rng.normal(size=vocab) * rng.uniform(0.5, 4)).astype(np.float32)
            logits[:40] += 3.0  # the history's ids are the likely ones, so the penalties decide picks
            before = logits.copy()
            expected = reference_pick(reference_row(logits, prompt, generated, settings), settings, twin)
            unpenalised = reference_pick(logits, settings, plain)
            assert sampler.sample(logits) == expected, (trial, generated)
            assert np.array_equal(logits, before)  # the penalties work on a copy, never the session's row
            changed += expected != unpenalised
            generated.append(expected)
        if not settings.greedy:
            assert sampler.rng.bit_generator.state == twin.bit_generator.state  # one number per token, no more
    assert changed >= 10  # the penalties did move picks: the comparison has teeth


def test_frequency_compounds_with_every_repeat_and_presence_does_not() -> None:
    row = np.array([3.0, 2.2, -10.0, -10.0], dtype=np.float32)
    frequency = make(SamplingSettings(temperature=0.0, frequency_penalty=0.5), vocab=4)
    # 0 at 3.0, 2.5 (still above 2.2), then 2.0 loses to 2.2; 1 at 1.7 loses to 0's 2.0; 0 at 1.5 loses to 1.7.
    assert [frequency.sample(row) for _ in range(5)] == [0, 0, 1, 0, 1]
    presence = make(SamplingSettings(temperature=0.0, presence_penalty=1.0), vocab=4)
    # Both present once: 2.0 against 1.2 from then on, however often 0 repeats.
    assert [presence.sample(row) for _ in range(5)] == [0, 1, 0, 0, 0]
    # Negative penalties favour what was generated: 1 wins once and keeps winning.
    close = np.array([2.0, 2.1, -10.0, -10.0], dtype=np.float32)
    negative = make(SamplingSettings(temperature=0.0, frequency_penalty=-0.5, presence_penalty=-0.1), vocab=4)
    assert [negative.sample(close) for _ in range(4)] == [1, 1, 1, 1]


def test_the_prompt_is_not_penalised_only_what_was_generated() -> None:
    row = np.array([1.0, 0.5, -1.0, -2.0], dtype=np.float32)
    settings = SamplingSettings(temperature=0.0, frequency_penalty=2.0, presence_penalty=2.0)
    # The prompt is full of 0s: the first pick is still 0; only the generated 0 costs it 4.0.
    from_prompt = make(settings, prompt=[0, 0, 0, 0, 1], vocab=4)
    assert [from_prompt.sample(row) for _ in range(2)] == [0, 1]
    # The same ids as earlier output count.
    from_output = make(settings, prompt=[2], generated=[0, 0, 0, 0, 1], vocab=4)
    assert from_output.sample(row) == 2  # 0: 1 - 8 - 2 = -9, 1: 0.5 - 2 - 2 = -3.5, 2: -1.0
    # The repetition penalty still sees the prompt, as transformers' does.
    both = make(replace(settings, repetition_penalty=3.0), prompt=[0], vocab=4)
    assert both.sample(row) == 1  # 1.0 / 3 falls below 0.5


@pytest.mark.parametrize(
    "settings",
    [
        SamplingSettings(temperature=0.0, frequency_penalty=0.6, presence_penalty=0.4, repetition_penalty=1.2),
        SamplingSettings(temperature=1.0, frequency_penalty=1.5, presence_penalty=-0.3),
        SamplingSettings(temperature=0.8, top_k=10, min_p=0.02, frequency_penalty=-0.7, presence_penalty=1.1),
    ],
    ids=["greedy", "sampled", "sampled-cuts"],
)
def test_a_resumed_sampler_picks_what_the_uninterrupted_one_picks(settings: SamplingSettings) -> None:
    rng = np.random.default_rng(9)
    vocab, prompt = 30, [3, 7, 7, 11]
    rows = [(rng.normal(size=vocab) * 2).astype(np.float32) for _ in range(60)]
    whole = make(settings, seed=42, prompt=prompt, vocab=vocab)
    head = [whole.sample(row) for row in rows[:25]]
    state = json.loads(json.dumps(whole.get_state()))
    expected = [whole.sample(row) for row in rows[25:]]
    # As a resumed generation builds it: the prompt, the earlier output, the snapshot's random state.
    resumed = make(settings, seed=1, prompt=prompt, generated=head, vocab=vocab)
    resumed.set_state(state)
    assert [resumed.sample(row) for row in rows[25:]] == expected
    # The earlier output handed over as prompt would lose its counts: other tokens.
    uncounted = make(settings, seed=1, prompt=prompt + head, vocab=vocab)
    uncounted.set_state(state)
    assert [uncounted.sample(row) for row in rows[25:]] != expected


# --------------------------------------------------------------------------- #
# The request fields
# --------------------------------------------------------------------------- #


def test_the_request_sets_the_penalties_and_a_generation_config_cannot() -> None:
    params = sampler_values({"frequency_penalty": 0.5, "presence_penalty": -1.25})
    assert (params.frequency_penalty, params.presence_penalty) == (0.5, -1.25)
    assert sampler_values({}).frequency_penalty is None
    settings = SamplingDefaults().resolve(params)
    assert (settings.frequency_penalty, settings.presence_penalty) == (0.5, -1.25)
    configured = SamplingDefaults.from_generation_config({"frequency_penalty": 1.0, "presence_penalty": 1.0})
    assert configured.resolve(SamplingParams()) == SamplingSettings()
    # The ends of the range are allowed.
    edges = SamplingDefaults().resolve(SamplingParams(frequency_penalty=-2, presence_penalty=2))
    assert (edges.frequency_penalty, edges.presence_penalty) == (-2.0, 2.0)


@pytest.mark.parametrize(
    ("params", "message"),
    [
        (SamplingParams(frequency_penalty=2.5), r"frequency_penalty must be in \[-2, 2\], got 2.5 \(from the request"),
        (SamplingParams(frequency_penalty=-2.01), r"frequency_penalty must be in \[-2, 2\], got -2.01"),
        (SamplingParams(frequency_penalty=float("nan")), r"frequency_penalty must be in \[-2, 2\], got nan"),
        (SamplingParams(presence_penalty=-3.0), r"presence_penalty must be in \[-2, 2\], got -3.0 \(from the request"),
        (SamplingParams(presence_penalty=float("inf")), r"presence_penalty must be in \[-2, 2\], got inf"),
    ],
)
def test_out_of_range_penalties_name_the_field(params: SamplingParams, message: str) -> None:
    with pytest.raises(GenerationError, match=message):
        SamplingDefaults().resolve(params)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_zero_penalties_leave_the_row_untouched(temperature: float) -> None:
    zero = SamplingDefaults().resolve(SamplingParams(temperature=temperature, frequency_penalty=0, presence_penalty=0))
    assert zero == SamplingDefaults().resolve(SamplingParams(temperature=temperature))
    rng = np.random.default_rng(4)
    rows = [(rng.normal(size=500) * 3).astype(np.float32) for _ in range(30)]
    with_fields = make(zero, seed=6, generated=[1, 2, 2, 3], vocab=500)
    without = make(SamplingSettings(temperature=temperature), seed=6, vocab=500)
    assert [with_fields.sample(row) for row in rows] == [without.sample(row) for row in rows]
    # Off costs nothing: the row goes to the draw as the caller's own array, no copy made.
    assert np.shares_memory(with_fields.penalties.apply(rows[0]), rows[0])


def test_generated_ids_must_be_token_ids() -> None:
    settings = SamplingSettings(frequency_penalty=0.5)
    with pytest.raises(GenerationError, match=r"0\.\.3"):
        make(settings, generated=[4], vocab=4)
    with pytest.raises(GenerationError, match=r"0\.\.3"):
        make(SamplingSettings(repetition_penalty=1.1), generated=[-1], vocab=4)


def test_a_logits_row_wider_than_the_tokenizer_is_counted_too() -> None:
    # Models pad their output layer past the tokenizer's ids; a padded id that wins is counted like any.
    row = np.array([0.0, 0.0, 0.0, 0.0, 5.0, 4.5], dtype=np.float32)
    greedy = make(SamplingSettings(temperature=0.0, frequency_penalty=0.3), vocab=4)
    assert [greedy.sample(row) for _ in range(4)] == [4, 4, 5, 4]


# --------------------------------------------------------------------------- #
# Through the ONNX backend on the demo model
# --------------------------------------------------------------------------- #


@pytest.fixture(scope="module")
def model(demo_models_root: Path) -> Iterator[OnnxModel]:
    loaded = OnnxRuntimeBackend(prefill_chunk=8, intra_op_threads=1).load(demo_models_root / "demo", device="cpu")
    yield loaded
    loaded.close()


def penalised_requests(model: OnnxModel, *, seed: int | None) -> list[Request]:
    """The engine tests' staggered rows, every other one with penalties (a batch mixes both)."""
    requests = varied(model, seed=seed)
    for index, request in enumerate(requests):
        sampled = {} if seed is None else {"temperature": 1.0, "top_p": None}
        penalties = {"frequency_penalty": 1.5, "presence_penalty": 0.5} if index % 2 == 0 else {}
        request.params = replace(request.params, **sampled, **penalties)
    return requests


@pytest.mark.parametrize("seed", [None, 5], ids=["greedy", "seeded"])
def test_a_batched_row_with_penalties_gives_the_tokens_of_the_request_alone(model: OnnxModel, seed: int | None) -> None:
    requests = penalised_requests(model, seed=seed)
    expected = [alone(model, r.prompt, r.params) for r in requests]
    engine = fresh_engine(model, max_batch=4)
    try:
        got = [ids_of(chunks) for chunks in run_together(engine, model, requests)]
    finally:
        engine.close()
    assert got == expected
    unpenalised = [
        alone(model, r.prompt, replace(r.params, frequency_penalty=None, presence_penalty=None)) for r in requests
    ]
    assert any(e != u for e, u in zip(expected, unpenalised, strict=True))


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0, frequency_penalty=1.2, presence_penalty=0.6, max_output_tokens=30),
        SamplingParams(temperature=1.0, frequency_penalty=-0.8, presence_penalty=1.4, seed=8, max_output_tokens=30),
    ],
    ids=["greedy", "sampled"],
)
def test_a_resumed_generation_with_penalties_continues_token_for_token(
    model: OnnxModel, params: SamplingParams
) -> None:
    prompt = model.prompt_ids(prompt_for(PROMPT))
    whole = alone(model, prompt, params)
    first = model.generate(prompt, params, should_stop=never)
    head = []
    for step in first:
        head.append(step.token_id)
        if len(head) == 12:
            break
    resumed = model.resume(json.loads(json.dumps(first.snapshot())), params, should_stop=never)
    assert head + [step.token_id for step in resumed if step.token_id is not None] == whole
    assert whole != alone(model, prompt, replace(params, frequency_penalty=None, presence_penalty=None))
