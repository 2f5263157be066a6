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
    assert step.host_bytes == 8 * 8 + 8 * 4 + 8 + 3 * WIDTH * 4  # ids, peaks, flags, the three rows


def test_no_row_asked_for_whole_brings_only_the_picks() -> None:
    picks = StepPicks("tensor(float)", "cpu", 0, where="the test")
    rows = rows_of_every_kind(np.float32)[:, None, :]
    step = picks.take(ort.OrtValue.ortvalue_from_numpy(rows), np.array([], dtype=np.int64))
    assert step.rows.shape == (0, WIDTH)
    assert step.best.tolist()[:3] == [int(np.argmax(rows[i, 0])) for i in range(3)]


def test_a_row_with_a_penalty_is_not_picked_from_its_argmax() -> None:
    penalised = SamplingSettings(temperature=0.0, repetition_penalty=1.2)
    sampler = Sampler(penalised, seed=1, vocab_size=10)
    assert not sampler.plain_greedy
    with pytest.raises(ValueError, match="without penalties"):
        sampler.best(3, finite=True)
