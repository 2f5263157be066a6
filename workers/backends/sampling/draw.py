"""A sampled token: temperature, top_k, top_p and min_p, then one uniform draw, as transformers computes them.

The warpers run in ``generate``'s order (temperature, top_k, top_p, min_p)
over the penalised row, and the token is the one a single uniform number
picks from the kept ids' running sum. Only work that cannot change a bit is
saved (docs/sampling.md): the arithmetic is the plain formulas', operation
for operation.
"""

from __future__ import annotations

import numpy as np

from workers.backends.errors import GenerationError
from workers.backends.sampling.scratch import Scratch, thread_scratch
from workers.backends.sampling.settings import SamplingSettings

# Where top_k looks for its k-th largest score first: within this many logits of the peak.
_TOP_K_MARGIN = np.float32(10.0)
# Where the nucleus looks first, as exponentials relative to the peak's 1.0, each cut lower than the last.
_NUCLEUS_CUTS = (1e-4, 1e-9, 1e-30)
# Up to this many ids the stable sort is as fast as checking for ties.
_STABLE_SORT_BELOW = 512


def draw(row: np.ndarray, settings: SamplingSettings, rng: np.random.Generator) -> int:
    """One id from the kept ids by one uniform draw over their running sum.

    The float64 arithmetic of the plain formulas (scale, subtract the
    peak, exp, divide by the total over the whole row), operation for
    operation, so the running sum, and with it the token a given random
    number picks, is the same to the bit. Only work that cannot change a
    bit is saved: fresh arrays of the vocabulary's size (their page
    faults cost more than the arithmetic), passes that only look for the
    peak or the cut's few candidates (done on the float32 row or on a
    short list), and dividing ids that no cut keeps.
    """
    temperature = settings.temperature
    size = len(row)
    scratch = thread_scratch(size)
    # Dividing by a positive temperature never reverses two scores, so the scaled row's peak
    # is the float32 row's peak, scaled: that pass reads half the bytes. NaN if any score is;
    # +inf or all -inf are not a distribution either.
    peak32 = row.max()
    peak = np.float64(peak32) if temperature == 1.0 else np.float64(peak32) / temperature
    if not np.isfinite(peak):
        raise GenerationError("the model produced logits that are not finite numbers")
    top_k = _top_k(row, peak32, scratch, settings) if 0 < settings.top_k < size else None
    scores = scratch.scores
    np.copyto(scores, row)
    if temperature != 1.0:  # x / 1.0 is x
        np.divide(scores, temperature, out=scores)
    scores -= peak
    np.exp(scores, out=scores)
    total = scores.sum()
    if not np.isfinite(total) or total <= 0:
        raise GenerationError("the model produced logits that are not finite numbers")
    order, cumulative = kept(scores, top_k, total, scratch, settings)
    point = rng.random() * cumulative[-1]
    index = min(int(np.searchsorted(cumulative, point, side="right")), len(order) - 1)
    return int(order[index])


def _top_k(row: np.ndarray, peak32: np.floating, scratch: Scratch, settings: SamplingSettings) -> np.ndarray:
    """The ids top_k keeps: every scaled score at least the k-th largest (ties with it stay), in id order.

    Widening to float64 and dividing by a positive temperature never
    reverses two scores, so the k-th largest scaled score is the float32
    row's k-th largest, scaled. It is found among the scores near the
    peak when at least k are there (a short partition instead of one over
    the vocabulary), provided nothing below that floor scales up to the
    threshold; else over the whole row.
    """
    k, temperature = settings.top_k, settings.temperature
    floor32 = peak32 - _TOP_K_MARGIN
    candidates = np.flatnonzero(row >= floor32)
    if len(candidates) >= k:
        values = row[candidates]
        kth = np.partition(values, len(values) - k)[len(values) - k]
        threshold = np.float64(kth) / temperature
        if np.float64(floor32) / temperature < threshold:
            return candidates[values.astype(np.float64) / temperature >= threshold]
    kth_index = len(row) - k
    np.copyto(scratch.partitioned, row)
    scratch.partitioned.partition(kth_index)
    threshold = np.float64(scratch.partitioned[kth_index]) / temperature
    scaled = np.divide(row, temperature, out=scratch.spare, dtype=np.float64)
    return np.flatnonzero(scaled >= threshold)


def kept(
    scores: np.ndarray, top_k: np.ndarray | None, total: np.floating, scratch: Scratch, settings: SamplingSettings
) -> tuple[np.ndarray, np.ndarray]:
    """The ids left after top_k, top_p and min_p, in draw order, and their running sum.

    ``scores`` are the exponentials, which divided by ``total`` are the
    probabilities; only the ids a cut may keep are divided (a quotient is
    the same whichever ids are divided with it). With a cut that needs an
    order, ids come by falling probability (ties by id); with only min_p
    (or nothing) to apply, in id order: no sort. ``scores`` may be
    overwritten.
    """
    top_p, min_p = settings.top_p, settings.min_p
    if top_k is not None:
        # Divided before the sort: two ids whose quotients round to one value tie, as in the full row.
        selected = scores[top_k] / total
        by_rank = _falling(selected)
        order, ranked = top_k[by_rank], selected[by_rank]
        cumulative = np.cumsum(ranked)
        # TopPLogitsWarper renormalises over what top_k left.
        target = top_p * cumulative[-1]
    elif top_p < 1.0:
        order, ranked, cumulative = _nucleus(scores, total, top_p)
        target = top_p
    else:
        probs = np.divide(scores, total, out=scores)
        if min_p > 0.0:
            order = np.flatnonzero(probs >= min_p * probs.max())
            return order, np.cumsum(probs[order])
        return scratch.ids, np.cumsum(probs, out=scratch.spare)
    if top_p < 1.0:
        # The smallest prefix whose mass reaches top_p; at least one token.
        keep = min(int(np.searchsorted(cumulative, target, side="left")) + 1, len(order))
        order, cumulative, ranked = order[:keep], cumulative[:keep], ranked[:keep]
    if min_p > 0.0:
        # A prefix too: the order falls, and its first id is the most likely one.
        keep = int(np.count_nonzero(ranked >= min_p * ranked[0]))
        order, cumulative = order[:keep], cumulative[:keep]
    return order, cumulative


def _nucleus(scores: np.ndarray, total: np.floating, top_p: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Ids by falling probability (ties by id), their probabilities and running sum, far enough to reach top_p.

    Sorting a 150k vocabulary costs ~20 ms a token; the nucleus is usually
    a few dozen ids. So take the ids whose exponential is at least a cut
    (one pass over the row), keep those whose probability lies strictly
    above the cut's own quotient (every id left out has a probability at
    most that, dividing by the total being monotonic), and look for the
    nucleus among them; lower the cut until their mass reaches top_p.
    Whatever set is sorted holds every id at least as likely as its least
    likely member, so its order is exactly a prefix of the full stable
    sort, ties included.
    """
    for cut in _NUCLEUS_CUTS:
        candidates = np.flatnonzero(scores >= cut)
        if len(candidates) > len(scores) // 2:  # most of the vocabulary: one full sort is cheaper
            break
        probs = scores[candidates] / total
        above = probs > np.float64(cut) / total
        if not above.all():
            candidates, probs = candidates[above], probs[above]
        found = _leading(candidates, probs, top_p)
        if found is not None:
            return found
    probs = np.divide(scores, total, out=scores)
    order = _falling(probs)
    ranked = probs[order]
    return order, ranked, np.cumsum(ranked)


def _leading(ids: np.ndarray, probs: np.ndarray, top_p: float) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """The most likely of ``ids`` (in id order) by falling probability, their probabilities and running
    sum, far enough that the sum reaches ``top_p``; None if all of them do not.

    The k most likely ids and every tie with the k-th (so again every id at
    least that likely), k growing from 64: a peaked row sorts dozens of ids,
    not the thousands a low cut lets through. The running sum's own last
    value decides, as the cut that follows reads that sum.
    """
    count = len(probs)
    k = 64
    while True:
        if k < count:
            kth = np.partition(probs, count - k)[count - k]
            chosen = probs >= kth
            some_ids, some = ids[chosen], probs[chosen]
        else:
            some_ids, some = ids, probs
        by_rank = _falling(some)
        ranked = some[by_rank]
        cumulative = np.cumsum(ranked)
        if cumulative.size and cumulative[-1] >= top_p:
            return some_ids[by_rank], ranked, cumulative
        if k >= count:
            return None
        k *= 8


def _falling(probs: np.ndarray) -> np.ndarray:
    """The order of ``probs`` from the largest, ties by position: a stable sort's, computed faster.

    NumPy's default (SIMD) sort takes a fifth of the stable sort's time on
    thousands of ids, but puts tied values in any order; ties are common (a
    model's float16 or bfloat16 logits repeat values). So sort once, then
    sort (group of equal values, position) as one integer key, unique and
    so in one order whatever the sort.
    """
    keys = -probs
    count = len(keys)
    if count <= _STABLE_SORT_BELOW:
        return np.argsort(keys, kind="stable")
    order = np.argsort(keys)
    ranked = keys[order]
    starts = np.empty(count, dtype=bool)
    starts[0] = True
    np.not_equal(ranked[1:], ranked[:-1], out=starts[1:])
    if starts.all():
        return order
    group = np.cumsum(starts) - 1
    return np.sort(group * count + order) % count
