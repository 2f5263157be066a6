"""The repetition, frequency and presence penalties of one generation, and the ids they remember.

The repetition penalty sees every id of the context (the prompt) and every
generated one: ``score < 0 ? score * p : score / p``, as transformers'
``RepetitionPenaltyLogitsProcessor``. The frequency and presence penalties
count generated ids only: an id generated ``c > 0`` times so far loses
``c * frequency_penalty + presence_penalty``, in float32 and frequency
first, as vLLM subtracts them. All three apply in that order, in float32,
whether the row is sampled or taken greedily; each is off at its neutral
value, which costs nothing.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from workers.backends.errors import GenerationError
from workers.backends.sampling.scratch import thread_scratch
from workers.backends.sampling.settings import SamplingSettings


class Penalties:
    """What one generation's penalties do to a row, and the ids they have seen so far.

    ``context_ids`` are the ids before the generation (the prompt), which
    only the repetition penalty sees; ``generated_ids`` those a resumed
    generation made before it stopped, which the repetition penalty sees and
    the frequency and presence penalties count. ``vocab_size`` bounds both.
    """

    def __init__(
        self,
        settings: SamplingSettings,
        *,
        context_ids: Sequence[int] = (),
        generated_ids: Sequence[int] = (),
        vocab_size: int,
    ) -> None:
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

    def ids(self, width: int) -> np.ndarray:
        """The ids whose scores the penalties change now (sorted, each once): what a device pick gathers."""
        seen = self._seen_so_far(width) if self._penalised else None
        counted = self._counted_so_far(width) if self._counted else None
        parts = [ids for ids in (seen, counted) if ids is not None]
        return np.unique(np.concatenate(parts)) if parts else np.empty(0, dtype=np.int64)

    def values_at(self, ids: np.ndarray, raw: np.ndarray, width: int) -> np.ndarray:
        """The scores at ``ids`` (sorted) after the penalties, as :meth:`apply` computes them in the row."""
        values = np.array(raw, dtype=np.float32)
        seen = self._seen_so_far(width) if self._penalised else None
        counted = self._counted_so_far(width) if self._counted else None
        seen_at = None if seen is None else np.searchsorted(ids, seen)
        counted_at = None if counted is None else np.searchsorted(ids, counted)
        self._apply(values, seen_at, counted, counted_at)
        return values

    def apply(self, logits: np.ndarray) -> np.ndarray:
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
        penalised = thread_scratch(len(row)).penalised  # never write into the caller's (the session's) buffer
        np.copyto(penalised, row)
        self._apply(penalised, seen, counted, counted)
        return penalised

    def remember(self, token: int) -> None:
        """``token`` was picked: the repetition penalty sees it from now on, the others count it."""
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

    def _apply(
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


def _token_ids(ids: Sequence[int], width: int) -> np.ndarray:
    values = np.asarray(ids, dtype=np.int64)
    if values.size and (values.min() < 0 or values.max() >= width):
        raise GenerationError(f"token ids must lie in 0..{width - 1}")
    return values
