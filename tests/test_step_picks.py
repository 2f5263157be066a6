"""A decode step's greedy picks made where its logits lie (``workers.backends.onnx.step_picks``).

The graph runs on the CPU provider here, as it does on CUDA. Each row's pick is the host sampler's
greedy pick to the bit (ties to the lower id, float16 rows as float32), a row the host sampler refuses
is refused, and the rows asked for whole come back bit for bit.
"""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest

from workers.backends.errors import GenerationError
from workers.backends.onnx.step_picks import StepPicks
from workers.backends.sampling import Sampler, SamplingSettings

WIDTH = 151_936
GREEDY = SamplingSettings(temperature=0.0)


def host_pick(row: np.ndarray) -> int | str:
    """What the host sampler makes of ``row``: its greedy token, or "refused"."""
    try:
        return Sampler(GREEDY, seed=1, vocab_size=len(row)).sample(row)
    except GenerationError:
        return "refused"


def device_pick(best: np.int64, finite: np.bool_) -> int | str:
    """What the engine makes of a row's device pick: the token, or "refused"."""
    try:
        return Sampler(GREEDY, seed=1, vocab_size=WIDTH).best(int(best), finite=bool(finite))
    except GenerationError:
        return "refused"


def rows_of_every_kind(dtype: type) -> np.ndarray:
    rng = np.random.default_rng(5)
    rows = rng.standard_normal((8, WIDTH)).astype(np.float32) * 4
    rows[1, 70_000] = rows[1, 9] = rows[1].max() + 1  # a tie for the peak: the lower id
    rows[2] = np.round(rows[2])  # many ties everywhere
    rows[2, 123] = rows[2].max()  # and at the peak
    rows[3, 50] = np.nan  # a NaN below the peak
    rows[4, 60] = np.inf
    rows[5] = -np.inf
    rows[6, 1000:] = -np.inf  # masked, as padded logits are
    rows[7, WIDTH - 1] = rows[7].max() + 0.5  # the peak at the last id
    return rows.astype(dtype)


@pytest.mark.parametrize("dtype", [np.float32, np.float16], ids=["float32", "float16"])
def test_each_rows_pick_is_the_host_samplers_greedy_pick_and_the_full_rows_come_back_whole(dtype: type) -> None:
    picks = StepPicks(f"tensor({np.dtype(dtype).name})", "cpu", 0, where="the test")
    rows = rows_of_every_kind(dtype)
    logits = rows[:, None, :]  # rows x one position x vocabulary, as a decode step's
    full = np.array([6, 1, 3], dtype=np.int64)
    step = picks.take(ort.OrtValue.ortvalue_from_numpy(logits), full)
    as_host = rows.astype(np.float32)  # what the host path samples from
    expected = [host_pick(row) for row in as_host]
    assert expected[3:6] == ["refused"] * 3 and expected[1] == 9  # the kinds this test means to cover
    assert [device_pick(step.best[i], step.finite[i]) for i in range(len(rows))] == expected
    assert step.rows.dtype == np.float32
    assert step.rows.tobytes() == as_host[full].tobytes()  # bit for bit, NaN included
    # A few bytes a row, plus the rows asked for: not the step's whole logits.
    # Per row an id, a peak, a flag and its highest score with its id; and the three rows.
    assert step.host_bytes == 8 * (8 + 4 + 1 + 4 + 8) + 3 * WIDTH * 4


def test_no_row_asked_for_whole_brings_only_the_picks() -> None:
    picks = StepPicks("tensor(float)", "cpu", 0, where="the test")
    rows = rows_of_every_kind(np.float32)[:, None, :]
    step = picks.take(ort.OrtValue.ortvalue_from_numpy(rows), np.array([], dtype=np.int64))
    assert step.rows.shape == (0, WIDTH)
    assert step.best.tolist()[:3] == [int(np.argmax(rows[i, 0])) for i in range(3)]


PENALTIES = [
    {"repetition_penalty": 1.3},
    {"repetition_penalty": 0.7},  # raises the seen ids' scores
    {"frequency_penalty": 0.8, "presence_penalty": 0.5},
    {"repetition_penalty": 1.1, "frequency_penalty": -0.4},  # a negative frequency penalty raises too
]


@pytest.mark.parametrize("penalty", PENALTIES, ids=lambda p: ",".join(f"{k}={v}" for k, v in p.items()))
def test_a_penalised_greedy_rows_pick_from_its_candidates_is_the_host_samplers_or_none(penalty) -> None:
    """The penalised ids' scores and the row's |penalised|+1 highest scores decide the penalised argmax,
    or say they cannot (a tie running past the list): never another token."""
    width = 4096
    picks = StepPicks("tensor(float)", "cpu", 0, where="the test")
    rng = np.random.default_rng(11)
    settings = SamplingSettings(temperature=0.0, **penalty)
    told, undecided = 0, 0
    for case in range(60):
        row = rng.standard_normal(width).astype(np.float32) * 3
        if case % 3 == 1:
            row = np.round(row)  # ties everywhere, at the list's end too
        elif case % 3 == 2:
            row[rng.choice(width, 5, replace=False)] = row.max()  # a tie for the peak
        top = np.argsort(-row, kind="stable")[:40]
        # Penalised ids among the highest scores (where they compete) and elsewhere.
        context = [int(i) for i in rng.choice(top, 6 + case % 9)] + [int(i) for i in rng.integers(0, width, 5)]
        generated = [int(i) for i in rng.choice(top, 1 + case % 4)]
        host = Sampler(settings, seed=1, context_ids=context, generated_ids=generated, vocab_size=width)
        device = Sampler(settings, seed=1, context_ids=context, generated_ids=generated, vocab_size=width)
        expected = host.sample(row)
        ids = device.penalised_ids(width)
        assert len(ids)
        step = picks.take(
            ort.OrtValue.ortvalue_from_numpy(row[None, None, :]),
            np.array([], dtype=np.int64),
            k=len(ids) + 1,
            gather=ids[None, :],
        )
        got = device.best_of_candidates(
            ids=ids,
            raw=step.gathered[0],
            top_values=step.top_values[0],
            top_ids=step.top_ids[0],
            nan=bool(step.nan[0]),
            width=width,
        )
        if got is None:
            undecided += 1
            # Only where the best other score ties the list's last: the candidates cannot know the lowest id.
            outside = ~np.isin(step.top_ids[0], ids)
            assert not outside.any() or step.top_values[0][np.argmax(outside)] == step.top_values[0][-1]
            continue
        told += 1
        assert got == expected, case
    assert told >= 30  # most rows are decided by their candidates


def test_a_penalised_greedy_row_whose_candidates_cannot_tell_comes_whole_and_a_nan_is_refused() -> None:
    settings = SamplingSettings(temperature=0.0, repetition_penalty=1.2)
    sampler = Sampler(settings, seed=1, context_ids=[0, 1], vocab_size=16)
    ids = sampler.penalised_ids(16)
    assert ids.tolist() == [0, 1]
    raw = np.array([5, 5], dtype=np.float32)
    # Ids 0 and 1 (penalised to 4.17), then twelve ids at 3: which is the lowest is past the list.
    undecided = {"ids": ids, "raw": raw, "top_values": np.array([5, 5, 3], np.float32), "width": 16}
    assert sampler.best_of_candidates(**undecided, top_ids=np.array([1, 0, 9]), nan=False) is None
    # A best other id above the list's last decides (4.5 over the penalised 4.17); a NaN anywhere is
    # refused as the host refuses it.
    decided = {**undecided, "top_values": np.array([5, 5, 4.5, 3], np.float32), "top_ids": np.array([1, 0, 9, 4])}
    assert sampler.best_of_candidates(**decided, nan=False) == 9
    with pytest.raises(GenerationError, match="not finite"):
        sampler.best_of_candidates(**decided, nan=True)
