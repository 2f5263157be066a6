"""Token sampling with a private, snapshot-able random generator.

Every generation owns one ``numpy.random.Generator`` (PCG64) seeded from the
request's seed, or from a random seed that is recorded so the run can be
repeated. Sampling draws exactly one number per sampled token and greedy
decoding draws none, so saving the generator state after any step and
restoring it later continues the very same random stream: that is what makes
a resumed generation token-for-token equal to an uninterrupted one.
"""

from __future__ import annotations

import secrets
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from workers.backends.errors import GenerationError

DEFAULT_TEMPERATURE = 1.0
DEFAULT_TOP_P = 1.0


@dataclass(frozen=True)
class SamplingDefaults:
    """What a model's ``generation_config.json`` says when a request leaves a knob unset."""

    temperature: float | None = None
    top_p: float | None = None
    do_sample: bool | None = None

    @classmethod
    def from_generation_config(cls, config: Mapping[str, Any]) -> SamplingDefaults:
        temperature = config.get("temperature")
        top_p = config.get("top_p")
        do_sample = config.get("do_sample")
        return cls(
            temperature=float(temperature) if isinstance(temperature, int | float) else None,
            top_p=float(top_p) if isinstance(top_p, int | float) else None,
            do_sample=do_sample if isinstance(do_sample, bool) else None,
        )

    def resolve(self, temperature: float | None, top_p: float | None) -> tuple[float, float]:
        """The temperature and top_p a generation uses.

        The request wins; else the model's generation config; a config that
        says ``do_sample: false`` means greedy unless the request asked for a
        temperature; else 1.0 for both (plain sampling over the full vocabulary).
        """
        if temperature is None:
            if self.do_sample is False:
                temperature = 0.0
            elif self.temperature is not None:
                temperature = self.temperature
            else:
                temperature = DEFAULT_TEMPERATURE
        if top_p is None:
            top_p = self.top_p if self.top_p is not None else DEFAULT_TOP_P
        temperature, top_p = float(temperature), float(top_p)
        if not np.isfinite(temperature) or temperature < 0:
            raise GenerationError(f"temperature must be a finite number >= 0, got {temperature}")
        if not np.isfinite(top_p) or not 0 < top_p <= 1:
            raise GenerationError(f"top_p must be in (0, 1], got {top_p}")
        return temperature, top_p


def new_seed() -> int:
    """A random seed that still fits a signed 64-bit integer (JSON and SQL friendly)."""
    return secrets.randbits(63)


class Sampler:
    """Picks the next token from a logits row: greedy at temperature 0, else nucleus sampling."""

    def __init__(self, *, temperature: float, top_p: float, seed: int | None = None) -> None:
        self.temperature = float(temperature)
        self.top_p = float(top_p)
        self.seed = new_seed() if seed is None else int(seed)
        self.rng = np.random.Generator(np.random.PCG64(self.seed))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def sample(self, logits: np.ndarray) -> int:
        """One token id from a 1-D logits row; draws exactly one random number unless greedy."""
        row = np.asarray(logits, dtype=np.float64).reshape(-1)
        if self.greedy:
            return int(np.argmax(row))
        scaled = row / self.temperature
        scaled -= scaled.max()
        probs = np.exp(scaled)
        total = probs.sum()
        if not np.isfinite(total) or total <= 0:
            raise GenerationError("the model produced logits that are not finite numbers")
        probs /= total
        if self.top_p >= 1.0:
            # No nucleus to cut: draw over the whole vocabulary in id order, no sort needed.
            order = np.arange(len(probs))
            cumulative = np.cumsum(probs)
            keep = len(order)
        else:
            order, cumulative = self._nucleus(probs)
            # The smallest prefix whose mass reaches top_p; at least one token.
            keep = min(int(np.searchsorted(cumulative, self.top_p, side="left")) + 1, len(order))
        kept = cumulative[:keep]
        draw = self.rng.random() * kept[-1]
        index = min(int(np.searchsorted(kept, draw, side="right")), keep - 1)
        return int(order[index])

    def _nucleus(self, probs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Ids by falling probability (ties by id) and their running sum, far enough to reach top_p.

        Sorting a 150k vocabulary costs ~20 ms a token; the nucleus is usually
        a few dozen ids. So take every id at least as likely as the k-th most
        likely one (all ties included, so the order is exactly a prefix of the
        full stable sort) and grow k until their mass reaches top_p.
        """
        size = len(probs)
        k = min(64, size)
        while True:
            if k >= size // 2:  # most of the vocabulary: one full sort is cheaper
                order = np.argsort(-probs, kind="stable")
                return order, np.cumsum(probs[order])
            threshold = np.partition(probs, size - k)[size - k]
            candidates = np.flatnonzero(probs >= threshold)
            order = candidates[np.argsort(-probs[candidates], kind="stable")]
            cumulative = np.cumsum(probs[order])
            if cumulative[-1] >= self.top_p:
                return order, cumulative
            k *= 8

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
