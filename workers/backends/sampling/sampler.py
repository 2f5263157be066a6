"""The sampler of one generation (:class:`Sampler`): its penalties, its draw, its snapshot-able random stream.

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

import secrets
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from workers.backends.errors import GenerationError
from workers.backends.sampling.draw import draw
from workers.backends.sampling.penalties import Penalties
from workers.backends.sampling.settings import SamplingSettings


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
        self.penalties = Penalties(
            settings, context_ids=context_ids, generated_ids=generated_ids, vocab_size=vocab_size
        )

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
        self.penalties.remember(token)
        return token

    def penalised_ids(self, width: int) -> np.ndarray:
        """The ids whose scores the penalties change now (sorted, each once): what a device pick gathers."""
        return self.penalties.ids(width)

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
        the better of the best penalised id (the penalty applied here as :meth:`Penalties.apply` applies it,
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
            values = self.penalties.values_at(ids, raw, width)
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
        self.penalties.remember(token)
        return token

    def sample(self, logits: np.ndarray) -> int:
        """One token id from a 1-D logits row; draws exactly one random number unless greedy."""
        row = self.penalties.apply(logits)
        if self.greedy:
            token = int(np.argmax(row))
            # argmax takes a NaN as the largest score: an fp16 overflow would
            # otherwise become a token silently. One element checked, not the row.
            if not np.isfinite(row[token]):
                raise GenerationError("the model produced logits that are not finite numbers")
        else:
            token = draw(row, self.settings, self.rng)
        self.penalties.remember(token)
        return token

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


def _as_int(value: int | str) -> int:
    return value if isinstance(value, int) else int(value, 0)
