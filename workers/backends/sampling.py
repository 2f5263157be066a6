"""Token sampling as transformers applies it, with a private, snapshot-able random generator.

A logits row goes through what ``transformers`` 4.57's ``generate`` builds in
``_get_logits_processor``, in its order, with OpenAI's frequency and presence
penalties (which transformers lacks) where vLLM applies them: the repetition
penalty, then the frequency and presence penalties (all three always, greedy
decoding included), then, only when sampling, temperature, top_k, top_p and
min_p; greedy takes the argmax after the penalties. So greedy output equals
``model.generate(do_sample=False)`` with the same generation config (and
those two penalties off).

The frequency and presence penalties count generated ids only, never the
prompt: an id generated ``c > 0`` times so far loses
``c * frequency_penalty + presence_penalty``, in float32 and frequency first,
as vLLM subtracts them. Both are off at 0, which costs nothing.

Every generation owns one ``numpy.random.Generator`` (PCG64) seeded from the
request's seed, or from a random seed that is recorded so the run can be
repeated. Sampling draws exactly one number per sampled token and greedy
decoding draws none, so saving the generator state after any step and
restoring it later continues the very same random stream: that is what makes
a resumed generation token-for-token equal to an uninterrupted one. The
penalties' memory (which ids were seen, how often each was generated) needs
no snapshot: it is the prompt plus the generated ids, which a resumed
generation passes back in.
"""

from __future__ import annotations

import os
import secrets
import threading
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np

from workers.backends.base import SamplingParams
from workers.backends.errors import GenerationError

DEFAULT_TEMPERATURE = 1.0
DEFAULT_TOP_P = 1.0
# Outside this range a penalised float32 score can overflow (or every repeated
# token vanish); transformers takes any positive number, no model ships one near these.
MIN_REPETITION_PENALTY = 0.01
MAX_REPETITION_PENALTY = 100.0
# OpenAI's range for the frequency and presence penalties.
MIN_OPENAI_PENALTY = -2.0
MAX_OPENAI_PENALTY = 2.0


@dataclass(frozen=True)
class SamplingSettings:
    """What one generation samples with, every knob resolved; the neutral values switch a step off."""

    temperature: float = DEFAULT_TEMPERATURE
    """0 is greedy decoding (argmax), which skips every step below but the penalty."""
    top_p: float = DEFAULT_TOP_P
    top_k: int = 0
    """0 keeps the whole vocabulary."""
    min_p: float = 0.0
    """0 keeps every token; else those at least ``min_p`` times as likely as the most likely one."""
    repetition_penalty: float = 1.0
    """1.0 is off; every id already in the context (the prompt too) gets ``score < 0 ? score * p : score / p``."""
    frequency_penalty: float = 0.0
    """0 is off; every generated id's score loses ``count * frequency_penalty`` (the prompt's ids are not counted)."""
    presence_penalty: float = 0.0
    """0 is off; every id generated at least once loses ``presence_penalty``."""

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass(frozen=True)
class SamplingDefaults:
    """What a model's ``generation_config.json`` says when a request leaves a knob unset."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    do_sample: bool | None = None

    @classmethod
    def from_generation_config(cls, config: Mapping[str, Any]) -> SamplingDefaults:
        """The sampling keys of a ``generation_config.json``; a key of the wrong JSON type counts as unset."""
        top_k = _number(config.get("top_k"))
        do_sample = config.get("do_sample")
        return cls(
            temperature=_number(config.get("temperature")),
            top_p=_number(config.get("top_p")),
            top_k=int(top_k) if top_k is not None and top_k.is_integer() else None,
            min_p=_number(config.get("min_p")),
            repetition_penalty=_number(config.get("repetition_penalty")),
            do_sample=do_sample if isinstance(do_sample, bool) else None,
        )

    def resolve(self, params: SamplingParams) -> SamplingSettings:
        """The settings a generation uses.

        The request wins; else the model's generation config; a config that
        says ``do_sample: false`` means greedy unless the request asked for a
        temperature (its repetition penalty still applies, as in transformers);
        else the neutral value (temperature and top_p 1.0: plain sampling over
        the whole vocabulary; top_k, min_p and the penalties off). The
        frequency and presence penalties come from the request alone: a
        generation config has no such keys.
        """
        if params.temperature is not None:
            temperature = _Knob(params.temperature, "the request")
        elif self.do_sample is False:
            temperature = _Knob(0.0, "the model's generation_config.json")
        else:
            temperature = self._knob(None, self.temperature, DEFAULT_TEMPERATURE)
        top_p = self._knob(params.top_p, self.top_p, DEFAULT_TOP_P)
        top_k = self._knob(params.top_k, self.top_k, 0)
        min_p = self._knob(params.min_p, self.min_p, 0.0)
        penalty = self._knob(params.repetition_penalty, self.repetition_penalty, 1.0)
        frequency = self._knob(params.frequency_penalty, None, 0.0)
        presence = self._knob(params.presence_penalty, None, 0.0)
        temperature.check(
            "temperature", np.isfinite(temperature.value) and temperature.value >= 0, "a finite number >= 0"
        )
        top_p.check("top_p", 0 < top_p.value <= 1, "in (0, 1]")
        top_k.check("top_k", float(top_k.value).is_integer() and top_k.value >= 0, "an integer >= 0")
        min_p.check("min_p", 0 <= min_p.value <= 1, "in [0, 1]")
        penalty.check(
            "repetition_penalty",
            MIN_REPETITION_PENALTY <= penalty.value <= MAX_REPETITION_PENALTY,
            f"in [{MIN_REPETITION_PENALTY}, {MAX_REPETITION_PENALTY:g}]",
        )
        openai_range = f"in [{MIN_OPENAI_PENALTY:g}, {MAX_OPENAI_PENALTY:g}]"
        for name, knob in (("frequency_penalty", frequency), ("presence_penalty", presence)):
            knob.check(name, MIN_OPENAI_PENALTY <= knob.value <= MAX_OPENAI_PENALTY, openai_range)
        return SamplingSettings(
            temperature=float(temperature.value),
            top_p=float(top_p.value),
            top_k=int(top_k.value),
            min_p=float(min_p.value),
            repetition_penalty=float(penalty.value),
            frequency_penalty=float(frequency.value),
            presence_penalty=float(presence.value),
        )

    @staticmethod
    def _knob(requested: float | None, configured: float | None, neutral: float) -> _Knob:
        if requested is not None:
            return _Knob(requested, "the request")
        if configured is not None:
            return _Knob(configured, "the model's generation_config.json")
        return _Knob(neutral, "the default")


@dataclass(frozen=True)
class _Knob:
    """One resolved value and where it came from, so an error can say whom to fix."""

    value: float
    source: str

    def check(self, name: str, valid: bool | np.bool_, domain: str) -> None:
        if not valid:
            raise GenerationError(f"{name} must be {domain}, got {self.value} (from {self.source})")


def _number(value: Any) -> float | None:
    # bool is an int in Python, but ``true`` is no number in a JSON config.
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


def new_seed() -> int:
    """A random seed that still fits a signed 64-bit integer (JSON and SQL friendly)."""
    return secrets.randbits(63)


class Sampler:
    """Picks the next token from a logits row and remembers it for the penalties.

    ``context_ids`` are the ids before the generation (the prompt), which
    only the repetition penalty sees; ``generated_ids`` those a resumed
    generation made before it stopped, which the repetition penalty sees and
    the frequency and presence penalties count. ``vocab_size`` bounds both.
    Every token :meth:`sample` returns joins the generated ids.
    """

    def __init__(
        self,
        settings: SamplingSettings,
        *,
        seed: int | None = None,
        context_ids: Sequence[int] = (),
        generated_ids: Sequence[int] = (),
        vocab_size: int,
    ) -> None:
        self.settings = settings
        self.seed = new_seed() if seed is None else int(seed)
        self.rng = np.random.Generator(np.random.PCG64(self.seed))
        width = max(int(vocab_size), 0)
        self._penalty = np.float32(settings.repetition_penalty)
        self._penalised = settings.repetition_penalty != 1.0
        # The seen ids as a mask (a new id costs O(1)) and as an index array
        # (a step costs O(distinct ids), never a pass over the history).
        self._seen = np.zeros(width, dtype=bool)
        self._seen_ids = np.empty(0, dtype=np.int64)
        self._new_ids: list[int] = []
        if self._penalised and (len(context_ids) or len(generated_ids)):
            ids = _token_ids([*context_ids, *generated_ids], width)
            self._seen[ids] = True
            self._seen_ids = np.flatnonzero(self._seen)
        # Float32 like the logits, so each subtraction rounds as vLLM's does.
        self._frequency = np.float32(settings.frequency_penalty)
        self._presence = np.float32(settings.presence_penalty)
        self._counted = settings.frequency_penalty != 0.0 or settings.presence_penalty != 0.0
        # The same two views of the generated ids, with how often each came: a
        # token costs O(1), a step O(distinct generated ids). Nothing at all when off.
        self._counts = np.zeros(width if self._counted else 0, dtype=np.int64)
        self._counted_ids = np.empty(0, dtype=np.int64)
        self._new_counted: list[int] = []
        if self._counted and len(generated_ids):
            ids, counts = np.unique(_token_ids(generated_ids, width), return_counts=True)
            self._counts[ids] = counts
            self._counted_ids = ids

    @property
    def greedy(self) -> bool:
        return self.settings.greedy

    def best(self, token: int, *, finite: bool) -> int:
        """:meth:`sample` for a greedy row whose penalties change no id yet (:meth:`penalised_ids` is
        empty), given its argmax (found where the row lies) and whether the row is a distribution (no
        NaN, a finite peak: what ``sample`` checks)."""
        if not self.greedy:
            raise ValueError("only a greedy row is picked from its argmax")
        if not finite:
            raise GenerationError("the model produced logits that are not finite numbers")
        self._remember(token)
        return token

    def penalised_ids(self, width: int) -> np.ndarray:
        """The ids whose scores the penalties change now (sorted, each once): what a device pick gathers."""
        seen = self._seen_so_far(width) if self._penalised else None
        counted = self._counted_so_far(width) if self._counted else None
        parts = [ids for ids in (seen, counted) if ids is not None]
        return np.unique(np.concatenate(parts)) if parts else np.empty(0, dtype=np.int64)

    def best_of_candidates(
        self,
        *,
        ids: np.ndarray,
        raw: np.ndarray,
        top_values: np.ndarray,
        top_ids: np.ndarray,
        nan: bool,
        width: int,
    ) -> int | None:
        """:meth:`sample` for a greedy row with penalties, from what the device sent instead of the row.

        ``ids`` are :meth:`penalised_ids`, ``raw`` their scores; ``top_values``/``top_ids`` the row's
        highest scores (more than ``ids``: at least one is not penalised). The penalised row's argmax is
        the better of the best penalised id (the penalty applied here as :meth:`_penalise` applies it,
        float32 op for op) and the best other id, which is the highest listed id outside ``ids``; equal
        scores go to the lower id, as ``np.argmax``. None when the list cannot tell (its last score ties
        the best other one, or every listed id is penalised): the row must come whole.
        """
        if not self.greedy:
            raise ValueError("only a greedy row is picked from its candidates")
        if nan:
            raise GenerationError("the model produced logits that are not finite numbers")
        token, score = -1, np.float32(np.nan)
        if len(ids):
            values = self._penalised_values(ids, raw, width)
            at = int(np.argmax(values))
            token, score = int(ids[at]), values[at]
        outside = ~np.isin(top_ids, ids)
        complete = len(top_ids) >= width
        if outside.any():
            first = int(np.argmax(outside))
            top = top_values[first]
            if top == top_values[-1] and not complete:
                return None
            other = int(top_ids[outside & (top_values == top)].min())
            if token < 0 or top > score or (top == score and other < token):
                token, score = other, top
        elif not complete:
            return None
        if token < 0 or not np.isfinite(score):
            raise GenerationError("the model produced logits that are not finite numbers")
        self._remember(token)
        return token

    def _penalised_values(self, ids: np.ndarray, raw: np.ndarray, width: int) -> np.ndarray:
        """The scores at ``ids`` (sorted) after the penalties, as :meth:`_penalise` computes them in the row."""
        values = np.array(raw, dtype=np.float32)
        seen = self._seen_so_far(width) if self._penalised else None
        counted = self._counted_so_far(width) if self._counted else None
        seen_at = None if seen is None else np.searchsorted(ids, seen)
        counted_at = None if counted is None else np.searchsorted(ids, counted)
        self._apply_penalties(values, seen_at, counted, counted_at)
        return values

    def _apply_penalties(
        self, values: np.ndarray, seen_at: np.ndarray | None, counted: np.ndarray | None, counted_at: np.ndarray | None
    ) -> None:
        """The penalties, in place: repetition at ``seen_at``, then frequency and presence at ``counted_at``
        (where the ids ``counted`` are); float32, in this order, wherever ``values`` holds the scores."""
        if seen_at is not None:
            scores = values[seen_at]
            values[seen_at] = np.where(scores < 0, scores * self._penalty, scores / self._penalty)
        if counted is not None and counted_at is not None:
            scores = values[counted_at]
            # Two subtractions, frequency first, as vLLM rounds them; a zero term would change no bit.
            if self._frequency:
                scores -= self._frequency * self._counts[counted].astype(np.float32)
            if self._presence:
                scores -= self._presence
            values[counted_at] = scores

    def sample(self, logits: np.ndarray) -> int:
        """One token id from a 1-D logits row; draws exactly one random number unless greedy."""
        row = self._penalise(logits)
        if self.greedy:
            token = int(np.argmax(row))
            # argmax takes a NaN as the largest score: an fp16 overflow would
            # otherwise become a token silently. One element checked, not the row.
            if not np.isfinite(row[token]):
                raise GenerationError("the model produced logits that are not finite numbers")
        else:
            token = self._draw(row)
        self._remember(token)
        return token

    def _penalise(self, logits: np.ndarray) -> np.ndarray:
        """The row as float32 (transformers casts the logits so) with the penalties applied.

        In float32 like ``RepetitionPenaltyLogitsProcessor`` (and vLLM's
        frequency and presence penalties), so a greedy pick between two nearly
        equal scores goes the same way. A penalised row lives in this thread's
        scratch: valid until the thread's next draw.
        """
        row = np.asarray(logits, dtype=np.float32).reshape(-1)
        seen = self._seen_so_far(len(row)) if self._penalised else None
        counted = self._counted_so_far(len(row)) if self._counted else None
        if seen is None and counted is None:
            return row
        penalised = _scratch(len(row)).penalised  # never write into the caller's (the session's) buffer
        np.copyto(penalised, row)
        self._apply_penalties(penalised, seen, counted, counted)
        return penalised

    def _seen_so_far(self, width: int) -> np.ndarray | None:
        """The ids the repetition penalty applies to, None if none yet."""
        if self._new_ids:
            self._seen_ids = np.concatenate([self._seen_ids, np.asarray(self._new_ids, dtype=np.int64)])
            self._new_ids.clear()
        if not self._seen_ids.size:
            return None
        if len(self._seen) > width and self._seen[width:].any():
            raise GenerationError(f"the model's logits row has {width} entries, fewer than its token ids")
        return self._seen_ids

    def _counted_so_far(self, width: int) -> np.ndarray | None:
        """The ids generated so far, each once, None if none yet."""
        if self._new_counted:
            self._counted_ids = np.concatenate([self._counted_ids, np.asarray(self._new_counted, dtype=np.int64)])
            self._new_counted.clear()
        if not self._counted_ids.size:
            return None
        if self._counted_ids.max() >= width:
            raise GenerationError(f"the model's logits row has {width} entries, fewer than its token ids")
        return self._counted_ids

    def _remember(self, token: int) -> None:
        if self._penalised:
            if token >= len(self._seen):  # a logits row wider than the tokenizer's ids
                self._seen = np.concatenate([self._seen, np.zeros(token + 1 - len(self._seen), dtype=bool)])
            if not self._seen[token]:
                self._seen[token] = True
                self._new_ids.append(token)
        if self._counted:
            if token >= len(self._counts):
                self._counts = np.concatenate([self._counts, np.zeros(token + 1 - len(self._counts), dtype=np.int64)])
            if not self._counts[token]:
                self._new_counted.append(token)
            self._counts[token] += 1

    def _draw(self, row: np.ndarray) -> int:
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
        settings = self.settings
        temperature = settings.temperature
        size = len(row)
        scratch = _scratch(size)
        # Dividing by a positive temperature never reverses two scores, so the scaled row's peak
        # is the float32 row's peak, scaled: that pass reads half the bytes. NaN if any score is;
        # +inf or all -inf are not a distribution either.
        peak32 = row.max()
        peak = np.float64(peak32) if temperature == 1.0 else np.float64(peak32) / temperature
        if not np.isfinite(peak):
            raise GenerationError("the model produced logits that are not finite numbers")
        top_k = self._top_k(row, peak32, scratch) if 0 < settings.top_k < size else None
        scores = scratch.scores
        np.copyto(scores, row)
        if temperature != 1.0:  # x / 1.0 is x
            np.divide(scores, temperature, out=scores)
        scores -= peak
        np.exp(scores, out=scores)
        total = scores.sum()
        if not np.isfinite(total) or total <= 0:
            raise GenerationError("the model produced logits that are not finite numbers")
        order, cumulative = self._kept(scores, top_k, total, scratch)
        draw = self.rng.random() * cumulative[-1]
        index = min(int(np.searchsorted(cumulative, draw, side="right")), len(order) - 1)
        return int(order[index])

    def _top_k(self, row: np.ndarray, peak32: np.floating, scratch: _Scratch) -> np.ndarray:
        """The ids top_k keeps: every scaled score at least the k-th largest (ties with it stay), in id order.

        Widening to float64 and dividing by a positive temperature never
        reverses two scores, so the k-th largest scaled score is the float32
        row's k-th largest, scaled. It is found among the scores near the
        peak when at least k are there (a short partition instead of one over
        the vocabulary), provided nothing below that floor scales up to the
        threshold; else over the whole row.
        """
        k, temperature = self.settings.top_k, self.settings.temperature
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

    def _kept(
        self, scores: np.ndarray, top_k: np.ndarray | None, total: np.floating, scratch: _Scratch
    ) -> tuple[np.ndarray, np.ndarray]:
        """The ids left after top_k, top_p and min_p, in draw order, and their running sum.

        ``scores`` are the exponentials, which divided by ``total`` are the
        probabilities; only the ids a cut may keep are divided (a quotient is
        the same whichever ids are divided with it). With a cut that needs an
        order, ids come by falling probability (ties by id); with only min_p
        (or nothing) to apply, in id order: no sort. ``scores`` may be
        overwritten.
        """
        top_p, min_p = self.settings.top_p, self.settings.min_p
        if top_k is not None:
            # Divided before the sort: two ids whose quotients round to one value tie, as in the full row.
            selected = scores[top_k] / total
            by_rank = _falling(selected)
            order, ranked = top_k[by_rank], selected[by_rank]
            cumulative = np.cumsum(ranked)
            # TopPLogitsWarper renormalises over what top_k left.
            target = top_p * cumulative[-1]
        elif top_p < 1.0:
            order, ranked, cumulative = self._nucleus(scores, total)
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

    def _nucleus(self, scores: np.ndarray, total: np.floating) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
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
        top_p = self.settings.top_p
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

    def get_state(self) -> dict[str, Any]:
        """The generator state as JSON-able data.

        It is ``bit_generator.state`` with its two 128-bit integers written as
        hex strings: JSON parsers outside Python (and SQLite's JSON functions)
        would round such integers to floats.
        """
        state = self.rng.bit_generator.state
        inner = state["state"]
        return {**state, "state": {"state": hex(inner["state"]), "inc": hex(inner["inc"])}}

    def set_state(self, state: Mapping[str, Any]) -> None:
        """Restore a state from :meth:`get_state` (plain integers are accepted too)."""
        try:
            inner = state["state"]
            restored = {
                **state,
                "state": {"state": _as_int(inner["state"]), "inc": _as_int(inner["inc"])},
            }
            self.rng.bit_generator.state = restored
        except (KeyError, TypeError, ValueError) as exc:
            raise GenerationError(f"the snapshot's random generator state is not valid: {exc}") from None


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


# Below this many logits a row samples in microseconds: handing it to another thread costs more.
POOL_MIN_WIDTH = 16_384


def automatic_sampling_threads() -> int:
    """Half the cores, at least 2 and at most 8 (1 on one core).

    The other half runs the session's own threads and the task threads; on
    two cores the model thread waits while a step samples, so two sampling
    threads take both cores only for that moment.
    """
    cores = os.cpu_count() or 1
    return 1 if cores < 2 else max(2, min(8, cores // 2))


class SamplingPool:
    """Samples the rows of one decode step, on several threads when the rows are wide.

    Each row's work at a real vocabulary is a handful of whole-row float64
    passes (scale, exp, sum) that NumPy runs without the GIL, so rows on
    different cores run side by side. Rows are dealt out in contiguous
    shares, one per thread; a row's token depends only on its own logits,
    settings and random stream (the work arrays are per thread), so which
    thread samples it changes no bit. One thread samples in the caller's.
    """

    def __init__(self, *, threads: int) -> None:
        self.threads = max(1, threads)
        self._pool = (
            ThreadPoolExecutor(max_workers=self.threads - 1, thread_name_prefix="lmsp-sampling")
            if self.threads > 1
            else None
        )

    def run(
        self, picks: Sequence[Callable[[], int]], *, width: int, sampled: Sequence[bool] | None = None
    ) -> list[int | GenerationError]:
        """Each pick's token, or the ``GenerationError`` that failed it (which fails only its row).

        ``sampled`` marks the picks that sample (the others take an argmax:
        one pass, cheaper than handing it to a thread); only those are shared
        out, and only when at least two are. Default: all of them.
        """
        if self._pool is None or width < POOL_MIN_WIDTH:
            return _run_share(picks)
        costly = [i for i in range(len(picks)) if sampled is None or sampled[i]]
        shares = min(self.threads, len(costly))
        if shares <= 1:
            return _run_share(picks)
        size = -(-len(costly) // shares)
        pieces = [costly[start : start + size] for start in range(0, len(costly), size)]
        futures = [self._pool.submit(_run_share, [picks[i] for i in piece]) for piece in pieces[1:]]
        shared = {i for piece in pieces[1:] for i in piece}
        inline = [i for i in range(len(picks)) if i not in shared]
        results: dict[int, int | GenerationError] = dict(
            zip(inline, _run_share([picks[i] for i in inline]), strict=True)
        )
        for piece, future in zip(pieces[1:], futures, strict=True):
            results.update(zip(piece, future.result(), strict=True))
        return [results[i] for i in range(len(picks))]

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)


def _run_share(picks: Sequence[Callable[[], int]]) -> list[int | GenerationError]:
    results: list[int | GenerationError] = []
    for pick in picks:
        try:
            results.append(pick())
        except GenerationError as exc:
            results.append(exc)
    return results


def _token_ids(ids: Sequence[int], width: int) -> np.ndarray:
    values = np.asarray(ids, dtype=np.int64)
    if values.size and (values.min() < 0 or values.max() >= width):
        raise GenerationError(f"token ids must lie in 0..{width - 1}")
    return values


def _as_int(value: int | str) -> int:
    return value if isinstance(value, int) else int(value, 0)


class _Scratch:
    """One thread's work arrays for rows of one size.

    A fresh array of the vocabulary's size per step costs its page faults
    (at 151,936 ids, more than the float64 arithmetic on it); one set per
    thread serves every sampler the thread runs, one row at a time.
    """

    def __init__(self, size: int) -> None:
        self.scores = np.empty(size, dtype=np.float64)
        self.spare = np.empty(size, dtype=np.float64)
        self.partitioned = np.empty(size, dtype=np.float32)
        self.penalised = np.empty(size, dtype=np.float32)
        self.ids = np.arange(size)
        self.ids.flags.writeable = False


_SCRATCH_SIZES = 4
# Where top_k looks for its k-th largest score first: within this many logits of the peak.
_TOP_K_MARGIN = np.float32(10.0)
# Where the nucleus looks first, as exponentials relative to the peak's 1.0, each cut lower than the last.
_NUCLEUS_CUTS = (1e-4, 1e-9, 1e-30)
# Up to this many ids the stable sort is as fast as checking for ties.
_STABLE_SORT_BELOW = 512
_scratch_by_thread = threading.local()


def _scratch(size: int) -> _Scratch:
    """This thread's work arrays for rows of ``size`` ids (a worker's models have a few sizes)."""
    sets: dict[int, _Scratch] | None = getattr(_scratch_by_thread, "sets", None)
    if sets is None:
        sets = _scratch_by_thread.sets = {}
    scratch = sets.get(size)
    if scratch is None:
        if len(sets) >= _SCRATCH_SIZES:
            sets.clear()
        scratch = sets[size] = _Scratch(size)
    return scratch
