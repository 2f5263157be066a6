"""Constrained decoding over real ONNX Runtime sessions: the JSON is valid, and a row's tokens are its own.

Each schema's output is checked with ``jsonschema`` (greedy and seeded); rows
that carry a grammar, in a batch of 8 beside rows that do not, give exactly
the tokens of the same request run alone; a constrained generation resumed
from a snapshot continues token for token; and a constraint that cannot go
on fails its row instead of letting it run unconstrained. The grammars are
the ones the service builds from a request (``tasks_app.generation.structured_output``).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import numpy as np
import pytest

from tasks_app.generation.structured_output import constraint_grammar
from tests.support.specs import prompt_for, spec_of
from tests.test_backend_layouts import MODELS, REFERENCES
from tests.test_engine import Request, alone, fresh_engine, ids_of, never, run_together
from workers.backends.base import FINISH_EOS, SamplingParams
from workers.backends.constraints import OutputConstraint
from workers.backends.errors import GenerationError
from workers.backends.onnx import OnnxRuntimeBackend
from workers.backends.onnx.model import OnnxModel

# No database here: the PostgreSQL pass of scripts/test leaves these out (tests/conftest.py).
pytestmark = pytest.mark.database_free

OBJECT = {"type": "object", "additionalProperties": False}
SCHEMAS: dict[str, dict[str, Any]] = {
    "nested objects": {
        **OBJECT,
        "properties": {
            "inner": {
                **OBJECT,
                "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0, "maximum": 9}},
                "required": ["ok", "n"],
            },
            "label": {"type": "string", "maxLength": 10},
        },
        "required": ["inner", "label"],
    },
    "arrays": {
        **OBJECT,
        "properties": {"tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 3}},
        "required": ["tags"],
    },
    "enums": {
        **OBJECT,
        "properties": {"color": {"enum": ["red", "green", "blue"]}, "size": {"enum": [1, 2, 3]}},
        "required": ["color", "size"],
    },
    "anyOf": {
        **OBJECT,
        "properties": {
            "v": {
                "anyOf": [
                    {"type": "integer", "minimum": -5, "maximum": 5},
                    {"type": "string", "pattern": "^[a-z]{2,5}$"},
                ]
            }
        },
        "required": ["v"],
    },
    "bounded numbers": {
        **OBJECT,
        "properties": {
            "t": {"type": "number", "minimum": -10, "maximum": 10, "multipleOf": 0.25},
            "k": {"type": "integer", "exclusiveMinimum": 100, "maximum": 120},
        },
        "required": ["t", "k"],
    },
    "string patterns": {
        **OBJECT,
        "properties": {"code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"}},
        "required": ["code"],
    },
    "array of objects": {
        "type": "array",
        "items": {
            **OBJECT,
            "properties": {"id": {"type": "integer", "minimum": 1, "maximum": 99}, "done": {"type": "boolean"}},
            "required": ["id", "done"],
        },
        "minItems": 2,
        "maxItems": 2,
    },
}
SAMPLING = {"greedy": {"temperature": 0}, "seeded": {"temperature": 0.9, "top_p": 0.95, "seed": 21}}


def grammar_of(schema: dict[str, Any] | None) -> str:
    text_format = {"type": "json_schema", "name": "out", "schema": schema} if schema else {"type": "json_object"}
    grammar = constraint_grammar(spec_of({"text": {"format": text_format}}).constraint)
    assert grammar is not None
    return grammar


@pytest.fixture(scope="module")
def demo(demo_models_root: Path) -> Iterator[OnnxModel]:
    model = OnnxRuntimeBackend(prefill_chunk=8, intra_op_threads=1).load(demo_models_root / "demo", device="cpu")
    yield model
    model.close()


def prompt(model: OnnxModel, text: str = "Describe the weather as JSON.") -> list[int]:
    return model.prompt_ids(prompt_for({"input": text}))


@pytest.mark.parametrize("sampling", SAMPLING)
@pytest.mark.parametrize("name", SCHEMAS)
def test_every_output_of_a_schema_parses_and_validates(demo: OnnxModel, name: str, sampling: str) -> None:
    schema = SCHEMAS[name]
    params = SamplingParams(max_output_tokens=300, grammar=grammar_of(schema), **SAMPLING[sampling])
    generation = demo.generate(prompt(demo), params, should_stop=never)
    list(generation)
    # The demo model writes word salad, and left alone it writes no JSON at all (checked below).
    assert generation.finish_reason == FINISH_EOS
    jsonschema.validate(json.loads(generation.text()), schema)


def test_the_same_prompts_without_a_constraint_give_no_json(demo: OnnxModel) -> None:
    """What the tests above prove is the constraint's doing, not the model's."""
    for sampling in SAMPLING.values():
        generation = demo.generate(prompt(demo), SamplingParams(max_output_tokens=300, **sampling), should_stop=never)
        list(generation)
        with pytest.raises(ValueError):
            json.loads(generation.text())


@pytest.mark.parametrize("key", ["qwen2-tiny", "llama-tiny", "phi3-tiny"])
def test_json_object_gives_an_object_on_each_tokenizer(key: str) -> None:
    """Random weights over three real tokenizers' vocabularies (the demo model never closes a free key)."""
    reference = REFERENCES[key]
    model = OnnxRuntimeBackend(prefill_chunk=8).load(
        MODELS / reference["folder"], graph=reference["graph"], device="cpu"
    )
    try:
        for sampling in SAMPLING.values():
            params = SamplingParams(max_output_tokens=200, grammar=grammar_of(None), **sampling)
            generation = model.generate(prompt(model, "What is the weather in Paris?"), params, should_stop=never)
            list(generation)
            assert generation.finish_reason == FINISH_EOS
            assert isinstance(json.loads(generation.text()), dict)
    finally:
        model.close()


@pytest.mark.parametrize("sampling", SAMPLING)
def test_constrained_rows_in_a_batch_of_8_beside_unconstrained_ones_give_their_tokens_alone(
    demo: OnnxModel, sampling: str
) -> None:
    grammars = [grammar_of(SCHEMAS[name]) for name in ("nested objects", "arrays", "bounded numbers", "anyOf")]
    requests = []
    for index in range(8):
        grammar = grammars[index // 2] if index % 2 == 0 else None
        params = SamplingParams(max_output_tokens=40 + 7 * index, grammar=grammar, **SAMPLING[sampling])
        text = f"Row {index}: tell me about the sea and the {'forest' if index % 3 else 'moon'}."
        requests.append(Request(prompt(demo, text), params, delay=0.002 * index, hold_for=8 if index == 0 else 0))
    expected = [alone(demo, r.prompt, r.params) for r in requests]
    engine = fresh_engine(demo, max_batch=8)
    try:
        got = [ids_of(chunks) for chunks in run_together(engine, demo, requests)]
    finally:
        engine.close()
    assert got == expected
    # The constrained rows are JSON (or a cut prefix of it, at their token limit); the others are not.
    texts = [demo.tokenizer.decode(ids[:-1] if ids and ids[-1] in demo.eos_token_ids else ids) for ids in got]
    assert all(text.startswith("{") for text in texts[::2])
    assert not any(text.startswith("{") for text in texts[1::2])


def test_a_resumed_constrained_generation_continues_token_for_token(demo: OnnxModel) -> None:
    params = SamplingParams(max_output_tokens=200, grammar=grammar_of(SCHEMAS["nested objects"]), **SAMPLING["seeded"])
    uninterrupted = demo.generate(prompt(demo), params, should_stop=never)
    list(uninterrupted)
    generation = demo.generate(prompt(demo), params, should_stop=never)
    steps = iter(generation)
    for _ in range(9):  # inside the object, past its first key
        next(steps)
    snapshot = json.loads(json.dumps(generation.snapshot()))
    resumed = demo.resume(snapshot, params, should_stop=never)
    list(resumed)
    assert resumed.generated_ids == uninterrupted.generated_ids
    assert resumed.text() == uninterrupted.text()
    jsonschema.validate(json.loads(resumed.text()), SCHEMAS["nested objects"])


def test_a_snapshot_whose_tokens_break_the_grammar_does_not_resume(demo: OnnxModel) -> None:
    """A grammar that changed under a running task (another schema, another library) fails the row."""
    free = demo.generate(prompt(demo), SamplingParams(max_output_tokens=5, temperature=0), should_stop=never)
    list(free)
    params = SamplingParams(max_output_tokens=50, grammar=grammar_of(SCHEMAS["enums"]), temperature=0)
    with pytest.raises(GenerationError, match="do not satisfy the output constraint"):
        demo.resume(free.snapshot(), params, should_stop=never)


def test_a_finished_grammar_allows_only_the_end_and_a_dead_end_fails(demo: OnnxModel) -> None:
    constraint = OutputConstraint(demo.constraint_tokenizer(), grammar_of(SCHEMAS["enums"]))
    for token in demo.tokenizer.encode('{"color":"red","size":2}', add_special_tokens=False).ids:
        constraint.consume(token)
    logits = np.zeros(demo.vocab_size, dtype=np.float32)
    allowed = np.flatnonzero(np.isfinite(constraint.masked(logits)))
    assert set(allowed) == set(demo.eos_token_ids)
    # Every allowed token scored -inf by the model: nothing can be sampled, and the row fails.
    fresh = OutputConstraint(demo.constraint_tokenizer(), grammar_of(SCHEMAS["enums"]))
    with pytest.raises(GenerationError, match="allows no token"):
        fresh.masked(np.full(demo.vocab_size, -np.inf, dtype=np.float32))
    with pytest.raises(GenerationError, match="rejected token"):
        fresh.consume(demo.tokenizer.token_to_id("a"))


PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
    "required": ["name", "age"],
}


def _takes(demo: OnnxModel, schema: dict[str, Any], text: str) -> bool:
    """Whether the grammar the service compiles for ``schema`` takes the whole of ``text``."""
    constraint = OutputConstraint(demo.constraint_tokenizer(), grammar_of(schema))
    try:
        for token in demo.tokenizer.encode(text, add_special_tokens=False).ids:
            constraint.consume(token)
    except GenerationError:
        return False
    return constraint.matcher.is_accepting()


@pytest.mark.parametrize(
    ("schema", "extra_key"),
    [
        pytest.param(PERSON, False, id="unset: only its keys (decision 0011)"),
        pytest.param({**PERSON, "additionalProperties": True}, True, id="true: any keys"),
        pytest.param({**PERSON, "additionalProperties": {"type": "integer"}}, True, id="a schema: keys of it"),
        pytest.param({"type": "object"}, True, id="no properties: any keys"),
        pytest.param({"allOf": [PERSON]}, True, id="an allOf branch: left as it says"),
    ],
)
def test_an_object_takes_keys_it_does_not_name_only_where_the_schema_says_so(
    demo: OnnxModel, schema: dict[str, Any], extra_key: bool
) -> None:
    assert (
        _takes(
            demo,
            {"type": "object", "properties": {"p": schema}, "required": ["p"]},
            '{"p":{"name":"Al","age":3,"x":4}}',
        )
        is extra_key
    )
    if "properties" in schema:
        assert _takes(demo, schema, '{"name":"Al","age":3}')
