"""The batched rows' reference (``tests.support.alone``) follows noise and nothing else.

Outputs are made here by the backend alone with its logits nudged before
each draw: by float noise below the reference's bound (as a batch nudges
them), and by far more (as a row reading another row's logits would).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from tests.support.alone import NOISE, alone_reference
from workers.backends.base import SamplingParams
from workers.backends.onnx import OnnxRuntimeBackend
from workers.backends.onnx.model import OnnxModel

# No database here: the PostgreSQL pass of scripts/test leaves these out (tests/conftest.py).
pytestmark = pytest.mark.database_free

PROMPT = list(range(5, 29))
PARAMS = SamplingParams(max_output_tokens=400, seed=7, temperature=0.9, top_p=0.95)


def never() -> bool:
    return False


@pytest.fixture(scope="module")
def model(endless_model_dir: Path) -> Iterator[OnnxModel]:
    loaded = OnnxRuntimeBackend().load(endless_model_dir, device="cpu")
    yield loaded
    loaded.close()


def nudged(model: OnnxModel, scale: float, seed: int) -> tuple[list[int], str]:
    """Ids and text of the generation alone with uniform noise of ``scale`` added to every logits row."""
    generation = model.generate(PROMPT, PARAMS, should_stop=never)
    accept, rng = generation.accept, np.random.default_rng(seed)

    def noisy(logits: np.ndarray):
        return accept(logits + rng.uniform(-scale, scale, logits.shape).astype(np.float32))

    generation.accept = noisy  # type: ignore[method-assign]
    text = "".join(step.text for step in generation)
    return list(generation.generated_ids), text


def test_its_own_output_is_followed_without_a_flip(model):
    plain = alone_reference(model, PROMPT, PARAMS)
    followed = alone_reference(model, PROMPT, PARAMS, following=plain.text)
    assert (followed.ids, followed.text, followed.flips) == (plain.ids, plain.text, [])


def test_outputs_that_noise_below_its_bound_turned_are_followed_token_for_token(model):
    plain = alone_reference(model, PROMPT, PARAMS)
    flipped = 0
    for seed in range(8):
        ids, text = nudged(model, NOISE / 2, seed)
        by_ids = alone_reference(model, PROMPT, PARAMS, following=ids)
        by_text = alone_reference(model, PROMPT, PARAMS, following=text)
        assert by_ids.ids == ids and by_text.text == text, seed
        flipped += ids != plain.ids
        assert (ids != plain.ids) == bool(by_ids.flips), seed
    # Enough of the nudged runs took another token somewhere that following was really tried.
    assert flipped >= 2


def test_outputs_of_other_logits_or_another_random_stream_are_not_followed(model):
    plain = alone_reference(model, PROMPT, PARAMS)
    ids, text = nudged(model, 0.5, seed=0)
    assert ids != plain.ids
    assert alone_reference(model, PROMPT, PARAMS, following=ids).ids == plain.ids
    assert alone_reference(model, PROMPT, PARAMS, following=text).text == plain.text
    other_seed = SamplingParams(max_output_tokens=400, seed=8, temperature=0.9, top_p=0.95)
    other = alone_reference(model, PROMPT, other_seed)
    assert alone_reference(model, PROMPT, PARAMS, following=other.ids).ids == plain.ids
