"""Sampling as transformers applies it: the repetition penalty, temperature, top_k, top_p and min_p.

The expectations are transformers 4.57's formulas worked by hand or in plain
numpy (CI has no torch): ``RepetitionPenaltyLogitsProcessor`` turns the score
of every id in the context into ``score * p`` when negative, ``score / p``
otherwise, greedy decoding included; ``TopKLogitsWarper`` keeps every score at
least the k-th largest; ``TopPLogitsWarper`` keeps the smallest most-likely
prefix whose mass (over what top_k left) reaches top_p; ``MinPLogitsWarper``
keeps what is at least ``min_p`` times as likely as the top token after
temperature. Then the same through the ONNX backend on the demo model, and
the request fields through the HTTP API and a real worker.
"""

from __future__ import annotations

import json
import shutil
import threading
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path

import numpy as np
import pytest

from tasks_app.models import Task
from tests.support.problems import assert_problem
from tests.support.specs import prompt_for, sampler_values
from tests.support.tasks import wait_for_status
from workers.backends.base import SamplingParams
from workers.backends.errors import GenerationError
from workers.backends.onnx import OnnxModel, OnnxRuntimeBackend
from workers.backends.sampling import Sampler, SamplingDefaults, SamplingPool, SamplingSettings

# A client's protocol over the engine, whose writes the lifecycle's, recovery's and the adapters' own tests
# test on both databases: the SQLite pass only (pyproject.toml, the sqlite_pass marker).
pytestmark = pytest.mark.sqlite_pass

QWEN_CONFIG = {"do_sample": True, "repetition_penalty": 1.05, "temperature": 0.7, "top_k": 20, "top_p": 0.8}
PROMPT = {"instructions": "Tell a story.", "input": "The lighthouse keeper climbed the stairs"}


def never() -> bool:
    return False


def sampler(seed: int = 0, context: Sequence[int] = (), vocab: int = 4, **settings: float) -> Sampler:
    return Sampler(SamplingSettings(**settings), seed=seed, context_ids=context, vocab_size=vocab)


def kept(logits: Sequence[float], draws: int = 400, **settings: float) -> set[int]:
    """Every id one sampler picks from the same row in many draws (a fresh context each time)."""
    return {sampler(seed, vocab=len(logits), **settings).sample(np.asarray(logits)) for seed in range(draws)}


def logs(*probs: float) -> np.ndarray:
    return np.log(np.asarray(probs))


# --------------------------------------------------------------------------- #
# The repetition penalty, greedy and sampled
# --------------------------------------------------------------------------- #


def test_greedy_applies_the_penalty_to_every_id_in_the_context() -> None:
    logits = np.array([2.0, 1.9, -1.0, -1.05], dtype=np.float32)
    assert sampler(temperature=0.0, repetition_penalty=1.1).sample(logits) == 0
    # 2.0 / 1.1 = 1.82 falls below 1.9.
    assert sampler(context=[0], temperature=0.0, repetition_penalty=1.1).sample(logits) == 1
    # A negative score is multiplied: -1.0 * 1.1 = -1.1 falls below -1.05.
    negative = np.array([-1.0, -1.05, -3.0, -4.0], dtype=np.float32)
    assert sampler(context=[0], temperature=0.0, repetition_penalty=1.1).sample(negative) == 1
    # A penalty below 1 favours what was seen.
    assert sampler(context=[1], temperature=0.0, repetition_penalty=0.9).sample(logits) == 1
    # Off at 1.0: no change.
    assert sampler(context=[0], temperature=0.0, repetition_penalty=1.0).sample(logits) == 0


def test_each_sampled_token_joins_the_context_and_is_penalised_once() -> None:
    row = np.array([1.0, 0.99, 0.98, -5.0], dtype=np.float32)
    greedy = sampler(temperature=0.0, repetition_penalty=1.1)
    state = greedy.get_state()
    # 0, then 1 (0 is now 0.909), then 2, then 0 again (0.909 > 0.900 > 0.891), then 0 once more:
    # however often an id repeats, its score is divided once (compounded, 1 would win the fifth step).
    assert [greedy.sample(row) for _ in range(5)] == [0, 1, 2, 0, 0]
    assert greedy.get_state() == state  # greedy decoding draws no random number, penalty or not
    repeated = sampler(context=[0, 0, 0, 0], temperature=0.0, repetition_penalty=1.1)
    assert repeated.sample(row) == 1 and repeated.sample(row) == 2 and repeated.sample(row) == 0


def test_the_penalty_comes_before_the_sampling_cuts() -> None:
    logits = np.array([3.0, 2.0, 2.0, 0.0], dtype=np.float32)
    assert {sampler(seed, top_k=1).sample(logits) for seed in range(100)} == {0}
    # 3.0 / 3 = 1.0 falls below the two 2.0s, which tie for the one place top_k leaves.
    penalised = {sampler(seed, context=[0], top_k=1, repetition_penalty=3.0).sample(logits) for seed in range(200)}
    assert penalised == {1, 2}


def test_context_ids_must_be_token_ids() -> None:
    with pytest.raises(GenerationError, match=r"0\.\.3"):
        sampler(context=[4], repetition_penalty=1.1)
    with pytest.raises(GenerationError, match=r"0\.\.3"):
        sampler(context=[-1], repetition_penalty=1.1)


def test_a_logits_row_wider_than_the_tokenizer_is_sampled_and_remembered() -> None:
    # Models pad their output layer past the tokenizer's ids (Qwen2.5: 151936 logits, 151665 ids).
    row = np.array([0.0, 0.0, 0.0, 0.0, 5.0, 4.9], dtype=np.float32)
    greedy = sampler(context=[0], vocab=4, temperature=0.0, repetition_penalty=1.1)
    assert [greedy.sample(row) for _ in range(3)] == [4, 5, 4]


# --------------------------------------------------------------------------- #
# top_k, top_p and min_p, in transformers' order
# --------------------------------------------------------------------------- #


def test_top_k_keeps_the_k_most_likely_and_every_tie_with_the_kth() -> None:
    logits = [1.0, 3.0, 2.0, 2.0, 0.5]
    assert kept(logits, top_k=1) == {1}
    assert kept(logits, top_k=2) == {1, 2, 3}
    assert kept(logits, top_k=4) == {0, 1, 2, 3}
    assert kept(logits, top_k=5, draws=2000) == kept(logits, top_k=0, draws=2000) == {0, 1, 2, 3, 4}
    assert kept(logits, top_k=50, draws=2000) == {0, 1, 2, 3, 4}  # more than the vocabulary: all


def test_top_p_keeps_the_smallest_nucleus() -> None:
    logits = logs(0.2, 0.5, 0.3)
    assert kept(logits, top_p=0.5, draws=50) == {1}
    assert kept(logits, top_p=0.8, draws=300) == {1, 2}
    assert kept(logits, top_p=1.0, draws=300) == {0, 1, 2}


def test_top_p_measures_the_mass_top_k_left() -> None:
    logits = logs(0.4, 0.3, 0.2, 0.1)
    assert kept(logits, top_p=0.5) == {0, 1}  # 0.4 alone does not reach 0.5
    # After top_k 2 the two ids have 0.4 / 0.7 = 0.57 and 0.43: 0.57 alone reaches 0.5.
    assert kept(logits, top_k=2, top_p=0.5) == {0}
    assert kept(logits, top_k=2, top_p=0.6) == {0, 1}


def test_min_p_is_relative_to_the_top_token_after_temperature() -> None:
    logits = logs(0.5, 0.3, 0.15, 0.05)
    assert kept(logits, min_p=0.29) == {0, 1, 2}  # at least 0.29 * 0.5 = 0.145
    # Temperature 0.5 squares the odds: 0.3^2 / 0.5^2 = 0.36 stays, 0.15^2 / 0.5^2 = 0.09 goes.
    assert kept(logits, min_p=0.29, temperature=0.5) == {0, 1}
    # Temperature 2 takes square roots: sqrt(0.05 / 0.5) = 0.32 stays.
    assert kept(logits, min_p=0.29, temperature=2.0, draws=2000) == {0, 1, 2, 3}
    assert kept(logits, min_p=1.0) == {0}


def test_min_p_comes_after_top_p() -> None:
    # top_p 0.75 first keeps 0.4, 0.3, 0.2 (0.7 before the third is under 0.75); min_p 0.45 (>= 0.18) keeps them.
    # The other order would renormalise to 0.44, 0.33, 0.22 and top_p would keep only two.
    assert kept(logs(0.4, 0.3, 0.2, 0.1), top_p=0.75, min_p=0.45) == {0, 1, 2}


def test_greedy_ignores_every_sampling_cut() -> None:
    logits = np.array([0.0, 4.0, 3.9, 1.0], dtype=np.float32)
    assert sampler(temperature=0.0, top_k=1, top_p=0.01, min_p=1.0).sample(logits) == 1


@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_logits_that_are_not_finite_fail_the_generation_instead_of_picking_a_token(
    temperature: float, bad: float
) -> None:
    # An fp16 graph that overflows yields NaN or inf; argmax alone would take it for the best token.
    logits = np.array([0.0, 1.0, bad, 0.5], dtype=np.float32)
    with pytest.raises(GenerationError, match="not finite"):
        sampler(temperature=temperature).sample(logits)


def test_the_nucleus_shortcut_matches_a_full_sort() -> None:
    """The partial sort must pick exactly what sorting the whole vocabulary picks, ties included."""

    def reference(logits: np.ndarray, temperature: float, top_p: float, draw: float) -> int:
        scaled = logits.astype(np.float64) / temperature
        probs = np.exp(scaled - scaled.max())
        probs /= probs.sum()
        order = np.argsort(-probs, kind="stable")
        cumulative = np.cumsum(probs[order])
        keep = min(int(np.searchsorted(cumulative, top_p)) + 1, len(order))
        kept = cumulative[:keep]
        return int(order[min(int(np.searchsorted(kept, draw * kept[-1], side="right")), keep - 1)])

    rng = np.random.default_rng(0)
    picks = set()
    for trial in range(60):
        # Rounding makes many ties; float32 as a model's logits are.
        logits = np.round(rng.normal(size=4000) * rng.uniform(0.5, 6), 1).astype(np.float32)
        top_p = float(rng.uniform(0.05, 0.99))
        draw = np.random.Generator(np.random.PCG64(trial)).random()
        pick = sampler(trial, vocab=4000, temperature=0.9, top_p=top_p).sample(logits)
        assert pick == reference(logits, 0.9, top_p, draw)
        picks.add(pick)
    assert len(picks) > 10


def plain_pick(row: np.ndarray, settings: SamplingSettings, draw: float) -> int:
    """The cuts as formulas over the whole vocabulary in float64: no partial sort, no work array reused."""
    scores = row.astype(np.float64) / settings.temperature
    ids = np.arange(len(scores))
    if 0 < settings.top_k < len(scores):
        ids = np.flatnonzero(scores >= np.sort(scores)[len(scores) - settings.top_k])
    probs = np.exp(scores - scores.max())
    probs /= probs.sum()
    ordered = settings.top_k > 0 or settings.top_p < 1.0
    if ordered:
        ids = ids[np.argsort(-probs[ids], kind="stable")]
    cumulative = np.cumsum(probs[ids])
    if settings.top_p < 1.0:
        target = settings.top_p * (cumulative[-1] if settings.top_k else 1.0)
        keep = min(int(np.searchsorted(cumulative, target)) + 1, len(ids))
        ids, cumulative = ids[:keep], cumulative[:keep]
    if settings.min_p > 0.0:
        mask = probs[ids] >= settings.min_p * probs[ids].max()
        # A prefix of an ordered list; else a mask in id order, whose running sum is its own.
        ids, cumulative = (ids[mask], cumulative[mask]) if ordered else (ids[mask], np.cumsum(probs[ids[mask]]))
    return int(ids[min(int(np.searchsorted(cumulative, draw * cumulative[-1], side="right")), len(ids) - 1)])


@pytest.mark.parametrize("vocab", [7, 4000, 151936])
def test_every_cut_picks_exactly_what_the_plain_float64_formulas_pick(vocab: int) -> None:
    """Same seed, same token: the work the sampler saves (float32 top_k threshold, reused arrays) changes no bit."""
    rng = np.random.default_rng(vocab)
    cases = [
        {"temperature": 1.0},
        {"temperature": 0.7, "top_p": 0.9},
        {"temperature": 1.0, "top_p": 0.6},
        {"temperature": 0.7, "top_k": 20, "top_p": 0.8},
        {"temperature": 1.0, "top_k": 5},
        {"temperature": 1.3, "top_k": 50, "top_p": 0.95, "min_p": 0.05},
        {"temperature": 0.5, "min_p": 0.1},
        {"temperature": 1e-3, "top_k": 3},  # scores of thousands: exp underflows for all but a few ids
    ]
    picks = set()
    for trial in range(6 if vocab > 10_000 else 40):
        logits = (rng.normal(size=vocab) * rng.uniform(0.5, 8)).astype(np.float32)
        if trial % 2:
            logits = np.round(logits, 0)  # many ties, at the top_k threshold too
        context = rng.integers(0, vocab, size=min(vocab, 30)).tolist()
        for settings in (SamplingSettings(**case, repetition_penalty=1.1) for case in cases):
            draw = np.random.Generator(np.random.PCG64(trial)).random()
            expected = plain_pick(penalised(logits, context, 1.1), settings, draw)
            before = logits.copy()
            pick = Sampler(settings, seed=trial, context_ids=context, vocab_size=vocab).sample(logits)
            assert pick == expected, (trial, settings)
            assert np.array_equal(logits, before)  # the penalty works on a copy, never the session's row
            picks.add(pick)
    assert len(picks) > min(vocab, 40) // 2


def row_of_shape(rng: np.random.Generator, shape: str, vocab: int) -> np.ndarray:
    """float32 logits of one shape a model's rows take, each sending the sampler down another path."""
    if shape == "peaked":  # a few strong candidates over a long tail: the nucleus is a handful of ids
        row = rng.normal(0.0, 2.0, size=vocab)
        row[rng.integers(0, vocab, size=8)] += rng.uniform(8.0, 14.0, size=8)
    elif shape == "flat":  # nearly uniform: the nucleus is most of the vocabulary (one full sort)
        row = rng.normal(0.0, 0.01, size=vocab)
    elif shape == "ties":  # few distinct values: ties at every cut and threshold
        row = np.round(rng.normal(0.0, 3.0, size=vocab), 0)
    elif shape == "masked":  # a grammar's row: most ids at -inf
        row = rng.normal(0.0, 3.0, size=vocab)
        row[rng.random(vocab) < 0.9] = -np.inf
    else:  # "spread": no id near the peak but the peak itself, so the first candidate cuts find too few
        row = rng.normal(0.0, 1.0, size=vocab)
        row[rng.integers(0, vocab)] += 33.0
        row[rng.integers(0, vocab, size=vocab // 3)] += 25.0
    return row.astype(np.float32)


SHAPES = ["peaked", "flat", "ties", "masked", "spread"]
SHAPE_CASES = [
    {"temperature": 0.7, "top_p": 0.9},
    {"temperature": 1.0, "top_p": 0.999},
    {"temperature": 0.05, "top_p": 0.5},
    {"temperature": 0.7, "top_k": 40},
    {"temperature": 0.7, "top_k": 2000, "top_p": 0.95},  # more ids than lie near the peak: the whole-row search
    {"temperature": 1.3, "top_k": 1},
    {"temperature": 0.9, "top_p": 0.8, "min_p": 0.05},
    {"temperature": 0.7, "min_p": 0.1},
    {"temperature": 1.0},
    {"temperature": 1e300, "top_p": 0.9},  # every scaled score rounds to a handful of values
    {"temperature": 1e300, "top_k": 5},
]


@pytest.mark.parametrize("shape", SHAPES)
def test_every_shape_of_row_gives_the_plain_formulas_pick(shape: str) -> None:
    """Peaks, flat rows, ties, masks, temperatures that merge scores: the shortcuts change no pick."""
    rng = np.random.default_rng(SHAPES.index(shape))
    picks = set()
    for vocab in (600, 151936):
        for trial in range(3):
            logits = row_of_shape(rng, shape, vocab)
            for case in SHAPE_CASES:
                settings = SamplingSettings(**case)
                seed = 100 * trial + len(picks)
                draw = np.random.Generator(np.random.PCG64(seed)).random()
                pick = Sampler(settings, seed=seed, vocab_size=vocab).sample(logits)
                assert pick == plain_pick(logits, settings, draw), (vocab, trial, case)
                picks.add(pick)
    assert len(picks) > 20


def test_a_temperature_so_small_that_the_scores_overflow_fails_the_row() -> None:
    logits = np.array([0.0, 1.0, 2.0], dtype=np.float32)
    with pytest.raises(GenerationError, match="not finite"):
        sampler(temperature=1e-310, top_p=0.9, vocab=3).sample(logits)


def test_a_step_sampled_on_several_threads_picks_what_each_row_picks_alone() -> None:
    """Which thread samples a row changes no bit; a row that fails fails alone."""
    rng = np.random.default_rng(12)
    width = 151936
    settings = [
        SamplingSettings(temperature=0.7, top_p=0.9),
        SamplingSettings(temperature=0.0),
        SamplingSettings(temperature=0.7, top_k=20, top_p=0.8, repetition_penalty=1.05),
        SamplingSettings(temperature=1.0, min_p=0.05, frequency_penalty=0.5),
        SamplingSettings(temperature=0.0, repetition_penalty=1.3),
        SamplingSettings(temperature=1.2),
        SamplingSettings(temperature=0.7, top_p=0.9),
    ]
    steps = [[row_of_shape(rng, SHAPES[(r + n) % 5], width) for r in range(len(settings))] for n in range(4)]
    broken = steps[2][3] = steps[2][3].copy()
    broken[5] = np.nan  # row 3's logits at the third step

    def samplers() -> list[Sampler]:
        return [Sampler(s, seed=r, context_ids=[r, 7, 99], vocab_size=width) for r, s in enumerate(settings)]

    def outcome(pick: int | GenerationError) -> int | str:
        return pick if isinstance(pick, int) else f"failed: {pick}"

    def sample_alone(sampler_: Sampler, row: np.ndarray) -> int | str:
        try:
            return sampler_.sample(row)
        except GenerationError as exc:
            return outcome(exc)

    alone_samplers = samplers()
    alone = [[sample_alone(s, row) for s, row in zip(alone_samplers, rows, strict=True)] for rows in steps]
    pool = SamplingPool(threads=3)
    ran_on: dict[int, set[str]] = {r: set() for r in range(len(settings))}

    def pick(r: int, s: Sampler, row: np.ndarray) -> int:
        ran_on[r].add(threading.current_thread().name)
        return s.sample(row)

    try:
        pooled_samplers = samplers()
        sampled = [not s.greedy for s in pooled_samplers]
        together = [
            [
                outcome(picked)
                for picked in pool.run(
                    [partial(pick, r, s, row) for r, (s, row) in enumerate(zip(pooled_samplers, rows, strict=True))],
                    width=width,
                    sampled=sampled,
                )
            ]
            for rows in steps
        ]
    finally:
        pool.close()
    assert together == alone
    # The greedy rows' argmax stayed in the calling thread; the sampled rows were shared out.
    caller = threading.current_thread().name
    assert all(ran_on[r] == {caller} for r, s in enumerate(sampled) if not s)
    sharing = set().union(*(ran_on[r] for r, s in enumerate(sampled) if s))
    assert caller in sharing and len(sharing) >= 2
    assert str(together[2][3]).startswith("failed: the model produced logits that are not finite")
    assert all(
        isinstance(pick, int) for n, picks in enumerate(together) for r, pick in enumerate(picks) if (n, r) != (2, 3)
    )
    assert [s.get_state() for s in pooled_samplers] == [s.get_state() for s in alone_samplers]


def test_samplers_in_parallel_threads_draw_what_they_draw_alone() -> None:
    """Work arrays are per thread: two generations sampling at once must not see each other's rows."""
    rng = np.random.default_rng(3)
    rows = [(rng.normal(size=151936) * 3).astype(np.float32) for _ in range(4)]
    settings = [
        SamplingSettings(temperature=0.7, top_k=20, top_p=0.8, repetition_penalty=1.05),
        SamplingSettings(temperature=1.0, repetition_penalty=1.3),
    ]

    def run(index: int) -> list[int]:
        sampler = Sampler(settings[index], seed=index, context_ids=[index, 99], vocab_size=151936)
        return [sampler.sample(rows[(step + index) % 4]) for step in range(40)]

    alone = [run(0), run(1)]
    with ThreadPoolExecutor(max_workers=2) as pool:
        together = list(pool.map(run, [0, 1]))
    assert together == alone


def test_one_random_number_per_sampled_token_and_a_resumed_sampler_continues_the_stream() -> None:
    rng = np.random.default_rng(5)
    rows = [rng.normal(size=50) * 2 for _ in range(45)]
    settings = {"temperature": 1.3, "top_p": 0.95, "top_k": 30, "min_p": 0.01, "repetition_penalty": 1.2}
    prompt = [3, 7, 7, 41]
    first = sampler(2**62 + 12345, context=prompt, vocab=50, **settings)
    twin = np.random.Generator(np.random.PCG64(2**62 + 12345))
    head = [first.sample(row) for row in rows[:5]]
    for _ in head:
        twin.random()
    assert first.rng.bit_generator.state == twin.bit_generator.state
    state = json.loads(json.dumps(first.get_state()))
    expected = [first.sample(row) for row in rows[5:]]
    # As a resumed generation builds it: the context is the prompt plus what was generated, the draws the state's.
    restored = sampler(1, context=prompt + head, vocab=50, **settings)
    restored.set_state(state)
    assert [restored.sample(row) for row in rows[5:]] == expected
    with pytest.raises(GenerationError):
        restored.set_state({"bit_generator": "PCG64"})


# --------------------------------------------------------------------------- #
# Defaults from generation_config.json
# --------------------------------------------------------------------------- #


def test_a_qwen_style_generation_config_is_the_default_a_request_overrides() -> None:
    defaults = SamplingDefaults.from_generation_config(QWEN_CONFIG)
    assert defaults.resolve(SamplingParams()) == SamplingSettings(
        temperature=0.7, top_p=0.8, top_k=20, min_p=0.0, repetition_penalty=1.05
    )
    request = SamplingParams(temperature=0.2, top_p=0.5, top_k=0, min_p=0.1, repetition_penalty=1.0)
    assert defaults.resolve(request) == SamplingSettings(
        temperature=0.2, top_p=0.5, top_k=0, min_p=0.1, repetition_penalty=1.0
    )
    # Greedy on request: the config's penalty still applies, as generate(do_sample=False) applies it.
    greedy = defaults.resolve(SamplingParams(temperature=0))
    assert greedy.greedy and greedy.repetition_penalty == 1.05


def test_without_a_config_every_cut_is_off() -> None:
    assert SamplingDefaults().resolve(SamplingParams()) == SamplingSettings(
        temperature=1.0, top_p=1.0, top_k=0, min_p=0.0, repetition_penalty=1.0
    )
    assert SamplingDefaults.from_generation_config({"min_p": 0.05}).resolve(SamplingParams()).min_p == 0.05


def test_do_sample_false_is_greedy_unless_the_request_asks_for_a_temperature() -> None:
    defaults = SamplingDefaults.from_generation_config({**QWEN_CONFIG, "do_sample": False})
    settings = defaults.resolve(SamplingParams())
    assert settings.greedy and settings.repetition_penalty == 1.05
    assert defaults.resolve(SamplingParams(temperature=0.9)).temperature == 0.9


def test_config_values_of_the_wrong_type_are_ignored() -> None:
    defaults = SamplingDefaults.from_generation_config(
        {"top_k": "20", "top_p": None, "repetition_penalty": True, "min_p": [0.1], "temperature": 0.5, "do_sample": 1}
    )
    assert defaults == SamplingDefaults(temperature=0.5)
    assert SamplingDefaults.from_generation_config({"top_k": 20.0}).top_k == 20


@pytest.mark.parametrize(
    ("config", "params", "message"),
    [
        (
            {},
            SamplingParams(temperature=-1.0),
            r"temperature must be a finite number >= 0, got -1.0 \(from the request",
        ),
        ({}, SamplingParams(top_p=0.0), r"top_p must be in \(0, 1\], got 0.0 \(from the request"),
        ({"top_p": 1.5}, SamplingParams(), r"top_p must be in \(0, 1\], got 1.5 \(from the model's generation_config"),
        ({"top_k": -1}, SamplingParams(), r"top_k must be an integer >= 0, got -1 \(from the model's"),
        ({"min_p": 2}, SamplingParams(), r"min_p must be in \[0, 1\], got 2.0 \(from the model's"),
        ({"repetition_penalty": 0}, SamplingParams(), r"repetition_penalty must be in \[0.01, 100\], got 0.0"),
        ({}, SamplingParams(repetition_penalty=1000.0), r"repetition_penalty must be in \[0.01, 100\], got 1000.0"),
    ],
)
def test_out_of_range_values_name_the_knob_and_where_it_came_from(
    config: dict, params: SamplingParams, message: str
) -> None:
    with pytest.raises(GenerationError, match=message):
        SamplingDefaults.from_generation_config(config).resolve(params)


# --------------------------------------------------------------------------- #
# Through the ONNX backend on the demo model
# --------------------------------------------------------------------------- #


@pytest.fixture(scope="module")
def model(demo_models_root: Path) -> Iterator[OnnxModel]:
    loaded = OnnxRuntimeBackend().load(demo_models_root / "demo", device="cpu")
    yield loaded
    loaded.close()


@pytest.fixture(scope="module")
def configured_model(demo_models_root: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[OnnxModel]:
    """The demo model with a Qwen2.5-style generation config (a stronger penalty, so it shows on 30 tokens)."""
    folder = tmp_path_factory.mktemp("sampling") / "demo"
    shutil.copytree(demo_models_root / "demo", folder)
    path = folder / "generation_config.json"
    config = json.loads(path.read_text(encoding="utf-8"))
    path.write_text(json.dumps({**config, **QWEN_CONFIG, "repetition_penalty": 1.3}), encoding="utf-8")
    loaded = OnnxRuntimeBackend().load(folder, device="cpu")
    yield loaded
    loaded.close()


def penalised(logits: np.ndarray, ids: Sequence[int], penalty: float) -> np.ndarray:
    """RepetitionPenaltyLogitsProcessor in plain numpy, over the whole row."""
    row, seen, factor = np.array(logits, dtype=np.float32), np.unique(ids), np.float32(penalty)
    row[seen] = np.where(row[seen] < 0, row[seen] * factor, row[seen] / factor)
    return row


def reference_greedy(model: OnnxModel, prompt: list[int], penalty: float, steps: int) -> list[int]:
    """transformers' greedy loop: penalise every id seen so far, take the argmax."""
    decoder, ids, out = model.decoder(), list(prompt), []
    logits = decoder.feed(ids)
    for _ in range(steps):
        out.append(int(np.argmax(penalised(logits, ids, penalty))))
        ids.append(out[-1])
        logits = decoder.feed([out[-1]])
    return out


def generated(model: OnnxModel, prompt: list[int], params: SamplingParams) -> list[int]:
    generation = model.generate(prompt, params, should_stop=never)
    return [step.token_id for step in generation if step.token_id is not None]


def test_greedy_with_a_penalty_equals_transformers_greedy_loop(model: OnnxModel) -> None:
    prompt = model.prompt_ids(prompt_for(PROMPT))
    plain = generated(model, prompt, SamplingParams(temperature=0, max_output_tokens=30))
    penalised = generated(model, prompt, SamplingParams(temperature=0, repetition_penalty=1.3, max_output_tokens=30))
    assert penalised == reference_greedy(model, prompt, 1.3, 30)
    assert plain == reference_greedy(model, prompt, 1.0, 30)
    assert penalised != plain


def test_the_model_config_sets_the_penalty_and_the_cuts(configured_model: OnnxModel) -> None:
    prompt = configured_model.prompt_ids(prompt_for(PROMPT))
    greedy = generated(configured_model, prompt, SamplingParams(temperature=0, max_output_tokens=30))
    assert greedy == reference_greedy(configured_model, prompt, 1.3, 30)
    overridden = SamplingParams(temperature=0, repetition_penalty=1.0, max_output_tokens=30)
    assert generated(configured_model, prompt, overridden) == reference_greedy(configured_model, prompt, 1.0, 30)

    # Sampled with the config's top_k 20 and top_p 0.8: every token is among the 20 best penalised scores.
    tokens = generated(configured_model, prompt, SamplingParams(seed=3, max_output_tokens=30))
    decoder, ids = configured_model.decoder(), list(prompt)
    logits = decoder.feed(ids)
    for token in tokens:
        row = penalised(logits, ids, 1.3)
        assert row[token] >= np.sort(row)[-20]
        ids.append(token)
        logits = decoder.feed([token])
    assert len(set(tokens)) > 3


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0, repetition_penalty=1.3, max_output_tokens=30),
        SamplingParams(temperature=0.9, top_k=5, min_p=0.05, repetition_penalty=1.3, seed=8, max_output_tokens=30),
    ],
    ids=["greedy", "sampled"],
)
def test_resume_with_a_penalty_continues_token_for_token(model: OnnxModel, params: SamplingParams) -> None:
    prompt = model.prompt_ids(prompt_for(PROMPT))
    whole = generated(model, prompt, params)
    first = model.generate(prompt, params, should_stop=never)
    head = []
    for step in first:
        head.append(step.token_id)
        if len(head) == 12:
            break
    resumed = model.resume(json.loads(json.dumps(first.snapshot())), params, should_stop=never)
    assert head + [step.token_id for step in resumed if step.token_id is not None] == whole


# --------------------------------------------------------------------------- #
# The request fields over HTTP
# --------------------------------------------------------------------------- #

FIELDS = {"top_k": 20, "min_p": 0.05, "repetition_penalty": 1.05}


def test_the_fields_are_stored_and_echoed_in_the_response_object(api) -> None:
    body = {"type": "response", "input": {"model": "demo", "input": "Hello", **FIELDS}}
    reply = api.post("/lmsp/v1/tasks", body)
    assert reply.status_code == 202, reply.content
    task = Task.objects.select_related("response").get(pk=reply.json()["id"])
    assert {name: task.response.request[name] for name in FIELDS} == FIELDS
    echoed = api.get(f"/lmsp/v1/responses/{task.response_id}").json()
    assert {name: echoed[name] for name in FIELDS} == FIELDS

    plain = api.post("/lmsp/v1/tasks", {"type": "response", "input": {"model": "demo", "input": "Hello"}})
    unset = api.get(f"/lmsp/v1/responses/{plain.json()['response_id']}").json()
    assert {name: unset[name] for name in FIELDS} == dict.fromkeys(FIELDS)


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("top_k", -1),
        ("top_k", 1.5),
        ("min_p", 1.01),
        ("min_p", -0.1),
        ("repetition_penalty", 0),
        ("repetition_penalty", 101),
    ],
)
def test_post_responses_refuses_out_of_range_values(api, name: str, value: float) -> None:
    reply = api.post("/lmsp/v1/responses", {"model": "demo", "input": "Hello", name: value})
    problem = assert_problem(reply, 400, "invalid_request")
    assert [error["field"] for error in problem["errors"]] == [name]
    assert "unknown" not in problem["errors"][0]["message"]  # a known field, refused for its value


def test_a_worker_samples_with_the_request_fields(api, running_worker, model: OnnxModel) -> None:
    request = {"model": "demo", "input": "Once upon a time", "max_output_tokens": 24, "temperature": 0}
    answers = {}
    for penalty in (None, 1.3):
        reply = api.post("/lmsp/v1/responses", {**request, "repetition_penalty": penalty})
        assert reply.status_code == 200, reply.content
        answers[penalty] = reply.json()
        assert answers[penalty]["repetition_penalty"] == penalty
    texts = {penalty: body["output"][0]["content"][0]["text"] for penalty, body in answers.items()}
    assert texts[None] != texts[1.3]
    local = model.generate(
        model.prompt_ids(prompt_for(request)),
        sampler_values({**request, "repetition_penalty": 1.3}),
        should_stop=never,
    )
    list(local)
    assert texts[1.3] == local.text()
    task = wait_for_status(api, Task.objects.get(response_id=answers[1.3]["id"]).id, {"succeeded"})
    assert task["response"]["repetition_penalty"] == 1.3
