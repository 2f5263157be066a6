"""The prefix cache over real ONNX Runtime sessions: a later row skips what an earlier one computed, and
gives the same tokens as the same request run without any cache.

Every expectation is the request alone (``OnnxGeneration`` iterated by itself,
no engine, no cache), on every fixture layout: chains of turns where each
prompt is the last prompt, its answer and new ids (what an agent sends),
prompts that share only part of an entry, a row that takes a hit while
others decode, and entries evicted for a row's room, even the one a running
row started from. How much came from the cache is what the row's usage
reports (``cached_tokens``), and it follows the rules of
``workers/backends/onnx/prefix_cache.py``: any length on graphs whose
numbers do not depend on how a feed is split, answers included when the row
never shared a call (or the graph keeps rows exact in a batch); whole
``prefill_chunk`` blocks of prompts on float16 graphs; nothing on graphs
that quantize per call.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import pytest

from tests.support.layouts import CHUNK
from tests.test_backend_layouts import REFERENCES
from workers.backends.base import Chunk, EngineObserver, SamplingParams
from workers.backends.onnx.engine import BatchEngine
from workers.backends.onnx.generation import OnnxGeneration
from workers.backends.onnx.model import OnnxModel

# No database here: the PostgreSQL pass of scripts/test leaves these out (tests/conftest.py).
pytestmark = pytest.mark.database_free

LAYOUTS = sorted(REFERENCES)
ROOMY = 1 << 30


def never() -> bool:
    return False


class Observer(EngineObserver):
    def __init__(self) -> None:
        self.hits: list[int] = []
        self.cached: list[int] = []
        self.evicted: list[int] = []
        self.running: list[int] = []
        self.steps: list[int] = []

    def step(self, *, rows: int, seconds: float) -> None:
        self.steps.append(rows)

    def prefix_hit(self, *, tokens: int) -> None:
        self.hits.append(tokens)

    def prefix_cache(self, *, cached_bytes: int, evicted: Any) -> None:
        self.cached.append(cached_bytes)
        self.evicted.extend(evicted)

    def rows(self, *, running: int, waiting: int) -> None:
        self.running.append(running)


def engine_of(model: OnnxModel, *, budget: int = ROOMY, **kwargs: Any) -> BatchEngine:
    return BatchEngine(model, kv_budget_bytes=budget, delta_tokens=4, delta_seconds=0.05, **kwargs)


def ids_of(chunks: list[Chunk]) -> list[int]:
    return [step.token_id for chunk in chunks for step in chunk.steps if step.token_id is not None]


def alone(model: OnnxModel, prompt: list[int], params: SamplingParams) -> list[int]:
    generation = model.generate(prompt, params, should_stop=never)
    return [step.token_id for step in generation if step.token_id is not None]


def run(engine: BatchEngine, model: OnnxModel, prompt: list[int], params: SamplingParams) -> OnnxGeneration:
    """One row through ``engine``, to its end; the generation (its ids, its ``cached_tokens``)."""
    generation = model.generate(prompt, params, should_stop=never)
    chunks = list(engine.submit(generation))
    assert chunks[-1].final and ids_of(chunks) == generation.generated_ids
    return generation


def new_ids(model: OnnxModel, turn: int, count: int) -> list[int]:
    vocab = min(model.vocab_size, 300)
    return [(11 + 17 * turn + 7 * i) % (vocab - 3) + 3 for i in range(count)]


def params_of(seed: int | None, turn: int) -> SamplingParams:
    sampled = {} if seed is None else {"temperature": 0.9, "top_p": 0.95}
    return SamplingParams(max_output_tokens=5 + turn % 3, seed=seed, **({"temperature": 0} | sampled))


def expected_hit(engine: BatchEngine, *, prompt: int, answer: int, answers_cached: bool = True) -> int:
    """What the next turn finds cached after a row of ``prompt`` ids that generated ``answer`` ids."""
    if engine.prefix_cache is None:
        return 0
    if engine.exact_splits:
        return prompt - prompt % CHUNK if prompt >= CHUNK else 0
    # The last generated id was sampled, never fed: the cache holds the ids before it.
    return prompt + answer - 1 if answers_cached else prompt


@pytest.mark.parametrize("seed", [None, 5], ids=["greedy", "seeded"])
@pytest.mark.parametrize("key", LAYOUTS)
def test_each_turn_of_a_chain_hits_the_last_one_and_gives_the_tokens_it_gives_without_a_cache(
    loaded: Callable[[str], OnnxModel], key: str, seed: int | None
) -> None:
    model = loaded(key)
    observer = Observer()
    engine = engine_of(model, max_batch=2, observer=observer)
    prompt = new_ids(model, 0, 21)
    got, expected, cached, hits = [], [], [], []
    try:
        previous: OnnxGeneration | None = None
        for turn in range(6):
            if previous is not None:
                # The agent's next turn: all it sent, the model's answer, and a few new ids (3 to 12).
                prompt = [*previous.prompt_ids, *previous.generated_ids, *new_ids(model, turn, 3 + 3 * turn % 10)]
                hits.append(expected_hit(engine, prompt=previous.prompt_tokens, answer=previous.output_tokens))
            params = params_of(seed, turn)
            generation = run(engine, model, prompt, params)
            got.append(generation.generated_ids)
            cached.append(generation.cached_tokens)
            expected.append(alone(model, prompt, params))
            previous = generation
    finally:
        engine.close()
    assert got == expected
    assert cached == [0, *hits]
    if engine.prefix_cache is None:
        assert model.quantizes_per_call and not observer.hits and not observer.cached
    else:
        assert observer.hits == cached and all(hit > 0 for hit in hits)


@pytest.mark.parametrize("key", ["qwen2-tiny", "llama-genai", "gpt2-tiny", "qwen2-community:fp16"])
def test_a_prompt_that_shares_only_part_of_an_entry_reuses_that_part(
    loaded: Callable[[str], OnnxModel], key: str
) -> None:
    model = loaded(key)
    engine = engine_of(model, max_batch=2)
    first = new_ids(model, 0, 30)
    # 13 ids in common: not a multiple of any block, and far from the entry's end.
    second = [*first[:13], *new_ids(model, 9, 11)]
    params = SamplingParams(temperature=0, max_output_tokens=6)
    try:
        run(engine, model, first, params)
        generation = run(engine, model, second, params)
    finally:
        engine.close()
    assert generation.generated_ids == alone(model, second, params)
    assert generation.cached_tokens == (8 if engine.exact_splits else 13)


@pytest.mark.parametrize("key", ["qwen2-tiny", "llama-genai", "phi3-legacy", "qwen2-community:fp16"])
def test_a_row_that_hits_while_others_decode_joins_them_and_keeps_its_tokens(
    loaded: Callable[[str], OnnxModel], key: str
) -> None:
    """On a graph that pads rows apart, a row that shared calls leaves no answer in the cache (it would
    not be its alone's to the last bit); GroupQueryAttention keeps rows exact, so its answer is kept."""
    model = loaded(key)
    observer = Observer()
    engine = engine_of(model, max_batch=4, observer=observer)
    seeded = SamplingParams(temperature=0.9, top_p=0.95, seed=3, max_output_tokens=8)
    long_rows = SamplingParams(temperature=0, max_output_tokens=60)
    first = new_ids(model, 1, 26)
    hit_submitted = threading.Event()

    def held() -> bool:
        """The model thread waits at the first row's first check until the hit is submitted too: the two
        rows are prefilled first and decode while the hit joins, however slow the machine."""
        hit_submitted.wait(timeout=120)
        return False

    try:
        warm = run(engine, model, first, seeded)
        follow = [*first, *warm.generated_ids, *new_ids(model, 2, 9)]
        # About as long as the hit's prompt, so that it joins their calls instead of a group of its own.
        prompts = [new_ids(model, 3 + n, 38 + 6 * n) for n in range(2)]
        rows = [model.generate(prompts[0], long_rows, should_stop=held)]
        rows.append(model.generate(prompts[1], long_rows, should_stop=never))
        streams = [engine.submit(row) for row in rows]
        hit = model.generate(follow, seeded, should_stop=never)
        streams.append(engine.submit(hit))
        hit_submitted.set()
        got = [ids_of(list(stream)) for stream in streams]
        after = [*follow, *hit.generated_ids, *new_ids(model, 4, 5)]
        last = run(engine, model, after, seeded)
    finally:
        engine.close()
    assert got[:2] == [alone(model, prompt, long_rows) for prompt in prompts]
    assert got[2] == hit.generated_ids == alone(model, follow, seeded)
    assert last.generated_ids == alone(model, after, seeded)
    assert hit.cached_tokens == expected_hit(engine, prompt=len(first), answer=warm.output_tokens)
    if engine.batched and not engine.exact_splits:  # (float16 graphs keep no answers either way)
        assert max(observer.steps) == 3, "the hit shared the decoding rows' calls"
    answers_kept = model.group_query_attention or not engine.batched
    assert last.cached_tokens == expected_hit(
        engine, prompt=len(follow), answer=hit.output_tokens, answers_cached=answers_kept
    )


def test_entries_give_way_to_a_row_that_needs_their_room_even_one_a_running_row_started_from(
    loaded: Callable[[str], OnnxModel],
) -> None:
    model = loaded("qwen2-tiny")
    per_position = model.kv_bytes_per_position
    params = SamplingParams(temperature=0, max_output_tokens=40)
    first = new_ids(model, 5, 30)
    observer = Observer()
    # Two rows of up to 76 positions and 8 more: the second row's room is the cache's.
    engine = engine_of(model, max_batch=4, budget=(2 * 76 + 8) * per_position, observer=observer)
    reached, go = threading.Event(), threading.Event()

    def hold() -> bool:
        """The first row's check before its first call: it is admitted and has not looked the cache up."""
        reached.set()
        go.wait(timeout=30)
        return False

    try:
        warm = run(engine, model, first, SamplingParams(temperature=0, max_output_tokens=5))
        assert engine.prefix_cache is not None and engine.prefix_cache.bytes > 0
        # A row that starts from the whole entry (its tensors as they are), then one that
        # needs the room the cache holds: the entry goes while the first row still runs on it.
        again = [*first, *warm.generated_ids[:-1], *new_ids(model, 6, 2)]
        other = new_ids(model, 7, 29)
        first_row = model.generate(again, params, should_stop=hold)
        first_stream = engine.submit(first_row)
        assert reached.wait(timeout=30)
        second_row = model.generate(other, params, should_stop=never)
        second_stream = engine.submit(second_row)
        go.set()
        first_chunks, second_chunks = list(first_stream), list(second_stream)
    finally:
        engine.close()
    assert ids_of(first_chunks) == first_row.generated_ids == alone(model, again, params)
    assert ids_of(second_chunks) == second_row.generated_ids == alone(model, other, params)
    assert first_row.cached_tokens == len(first) + warm.output_tokens - 1
    assert observer.evicted, "the second row's room came from the cache"
    assert max(observer.running) == 2


def test_without_the_cache_or_without_a_budget_nothing_is_cached(loaded: Callable[[str], OnnxModel]) -> None:
    model = loaded("qwen2-tiny")
    params = SamplingParams(temperature=0, max_output_tokens=5)
    prompt = new_ids(model, 0, 20)
    for engine in (engine_of(model, max_batch=2, prefix_cache=False), engine_of(model, max_batch=2, budget=0)):
        try:
            assert engine.prefix_cache is None
            first = run(engine, model, prompt, params)
            second = run(engine, model, [*prompt, *first.generated_ids, 5, 6], params)
        finally:
            engine.close()
        assert second.cached_tokens == 0
