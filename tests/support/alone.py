"""A request's text generated alone: the reference a batched row is held to.

A row in a batch of the demo graphs gets logits that differ from the same
row alone in the last bits (docs/workers.md: the cache of a shorter row
keeps a masked hole, and the reductions group their terms otherwise).
Seeded sampling turns such a difference into another token only where the
row's one uniform draw lies that close to a cut: the edge between two
tokens' shares of the running sum, or top_p's edge (a token in or out of
the kept set rescales the whole sum). Measured on ``demo:endless``: the
largest difference on a kept token's logit was 6.4e-6; one request of the
batched-worker tests (seed 103, top_p 0.95) reaches 0.95 at its 436th token
1.7e-5 past the edge, and in about one run in ten with varied join times the
edge token fell out, and the draw picked the token ranked next to its own.

:func:`alone_reference` generates a request alone. Given what a batched
row produced (``following``: its text, or its token ids), where that
departs from the alone one at a step whose pick a perturbation of at most :data:`NOISE` per logit turns
into the token it shows, it takes that token and goes on alone from
there (same random stream: one draw per token). A row that sampled another
row's logits or random numbers departs at a step no such noise explains,
and it and the reference differ.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from tests.support.specs import prompt_for, sampler_values
from workers.backends.base import SamplingParams
from workers.backends.detokenizer import StreamDetokenizer
from workers.backends.onnx.generation import OnnxGeneration
from workers.backends.onnx.model import OnnxModel
from workers.backends.sampling import Sampler

# About five times the largest batched-vs-alone difference measured on a kept token's logit.
NOISE = 3e-5


def never() -> bool:
    return False


@dataclass
class Reference:
    """What the request gave alone: its text and token ids, and the steps where it took the followed
    output's token instead of its own (step, its own, taken)."""

    text: str
    ids: list[int]
    flips: list[tuple[int, int, int]] = field(default_factory=list)


def alone_reference(
    model: OnnxModel,
    prompt: Sequence[int],
    params: SamplingParams,
    *,
    following: str | Sequence[int] | None = None,
) -> Reference:
    """The generation of ``prompt`` alone on ``model``; ``following`` (a text, or token ids) as the module says."""
    generation = model.generate(prompt, params, should_stop=never)
    follower = None
    if following is not None:
        follower = _Follower(generation, following)
        generation.sampler = follower  # type: ignore[assignment]  # a generation calls only sample() and get_state()
    text = "".join(step.text for step in generation)
    return Reference(text, list(generation.generated_ids), follower.flips if follower else [])


def alone_text(model: OnnxModel, request: Mapping[str, Any], *, following: str | None = None) -> str:
    """The text of a request body (``input``, sampling fields) generated alone; see :func:`alone_reference`."""
    params = sampler_values(request)
    return alone_reference(model, model.prompt_ids(prompt_for(request)), params, following=following).text


class _Follower:
    """Stands in for the generation's sampler: picks as it does, or as noise could have made it pick."""

    def __init__(self, generation: OnnxGeneration, following: str | Sequence[int]) -> None:
        self.current: Sampler = generation.sampler
        self.generation = generation
        self.following = following if isinstance(following, str) else list(following)
        self.flips: list[tuple[int, int, int]] = []
        self.lost = False

    def __getattr__(self, name: str) -> Any:
        return getattr(self.current, name)

    def _shown(self, token: int) -> bool:
        """Whether the output with ``token`` next is still a start of the followed one."""
        generation = self.generation
        ids = [*generation.generated_ids, token]
        if not isinstance(self.following, str):
            return self.following[: len(ids)] == ids
        offsets = generation.snapshot_state()["detokenizer"]
        new = StreamDetokenizer(generation.model.tokenizer, **offsets).step(ids)
        return self.following.startswith(generation.text() + new)

    def sample(self, logits: np.ndarray) -> int:
        row = np.asarray(logits, dtype=np.float32)
        picked = copy.deepcopy(self.current)
        token = picked.sample(row)
        if not self.lost and not self._shown(token):
            for nudged in _perturbations(row):
                trial = copy.deepcopy(self.current)
                other = trial.sample(nudged)
                if other != token and self._shown(other):
                    self.flips.append((len(self.generation.generated_ids), token, other))
                    picked, token = trial, other
                    break
            else:
                # No noise explains the departure: the reference goes on alone, and the outputs differ.
                self.lost = True
        self.current = picked
        return token


def _perturbations(row: np.ndarray) -> Iterator[np.ndarray]:
    """Logit rows within NOISE of ``row`` that move the cuts furthest: the top ``s`` raised and the rest
    lowered, and the reverse, for every ``s`` over the tokens that carry probability."""
    order = np.argsort(-row, kind="stable")
    live = int(np.count_nonzero(row > row.max() - 60.0)) + 1  # exp(-60) is nothing next to the top token
    for split in range(1, min(live, len(row)) + 1):
        up = np.full(len(row), -NOISE, dtype=np.float64)
        up[order[:split]] = NOISE
        for sign in (1.0, -1.0):
            yield (row + sign * up).astype(np.float32)
