"""A decode step's picks made where the logits lie: greedy rows on the device, the others' rows on the host.

With the step-picks graph (``step_picks``), a step's plain greedy rows send
only their best scores (and the scores of the ids their penalties change);
the other rows come to the host whole and are sampled there. Here are the
three parts of such a step the batch engine runs: which rows pick on the
device, the session call that sends what they need, and every row's pick
in order, the device rows' worked out from their candidates.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from workers.backends.errors import GenerationError
from workers.backends.onnx.kv_batch import KVBatch
from workers.backends.onnx.step_picks import StepLogits

if TYPE_CHECKING:
    from workers.backends.onnx.generation import OnnxGeneration


def device_gathers(generations: Sequence[OnnxGeneration], width: int) -> dict[int, np.ndarray]:
    """The rows a step picks on the device (greedy, unconstrained), each with its penalised ids."""
    gathers = {}
    for index, generation in enumerate(generations):
        if generation.picks_on_device:
            try:
                gathers[index] = generation.sampler.penalised_ids(width)
            except GenerationError:
                continue  # an id past the row: the host sampler says so, as it would alone
    return gathers


def feed_with_picks(
    batch: KVBatch, ids: np.ndarray, rows: int, gathers: dict[int, np.ndarray], full: list[int]
) -> StepLogits:
    """The step's call with the picks graph: each device row's highest scores, enough that one at
    least is not penalised, and its penalised ids' scores; the ``full`` rows whole."""
    k = max(len(penalised) for penalised in gathers.values()) + 1
    gather = np.zeros((rows, k - 1), dtype=np.int64)
    for index, penalised in gathers.items():
        gather[index, : len(penalised)] = penalised
    return batch.feed_step(ids, full_rows=np.array(full, dtype=np.int64), k=k, gather=gather)


def merged_picks(
    batch: KVBatch,
    generations: Sequence[OnnxGeneration],
    step: StepLogits,
    gathers: dict[int, np.ndarray],
    full: list[int],
    sampled: list[int | GenerationError],
) -> list[int | GenerationError]:
    """Every row's pick in order: the device rows' from their candidates, the others' from the pool."""
    width = step.width
    by_index: dict[int, int | GenerationError | None] = dict(zip(full, sampled, strict=True))
    for index, penalised in gathers.items():
        by_index[index] = _device_pick(generations[index], step, index, penalised, width)
    again = [index for index, pick in by_index.items() if pick is None]
    if again:
        # The candidates could not tell (a tie past the list): those rows come whole after all.
        try:
            whole = list(zip(again, batch.step_rows(np.array(again, dtype=np.int64)), strict=True))
        except GenerationError as exc:
            whole, by_index = [], {**by_index, **dict.fromkeys(again, exc)}
        for index, row_logits in whole:
            try:
                by_index[index] = generations[index].pick(row_logits)
            except GenerationError as exc:
                by_index[index] = exc
    picks: list[int | GenerationError] = []
    for index in range(len(generations)):
        pick = by_index[index]
        assert pick is not None
        picks.append(pick)
    return picks


def _device_pick(
    generation: OnnxGeneration, step: StepLogits, index: int, penalised: np.ndarray, width: int
) -> int | GenerationError | None:
    """A greedy row's pick from what the device sent (None: the row must come whole), or its error, as
    ``SamplingPool.run`` gives them."""
    sampler = generation.sampler
    try:
        if not len(penalised):
            return sampler.best(int(step.best[index]), finite=bool(step.finite[index]))
        return sampler.best_of_candidates(
            ids=penalised,
            raw=step.gathered[index, : len(penalised)],
            top_values=step.top_values[index],
            top_ids=step.top_ids[index],
            nan=bool(step.nan[index]),
            width=width,
        )
    except GenerationError as exc:
        return exc
