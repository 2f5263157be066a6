"""The batch engine over real ONNX Runtime sessions: rows join and leave, and each row's tokens are its own.

Every row is compared with the same request run alone (``OnnxGeneration``
iterated by itself, the path of a generation outside any batch): greedy and
seeded sampling, rows submitted at different moments so that they join a
running batch mid-way and leave it at different steps (different prompt
lengths and token limits), on every model layout the backend loads and on
the demo models. The fixtures' references (``model_references.json``) hold
the exporting tools' own greedy tokens; a batch of all of them must give
those too.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from fixture_models.demo import build_demo_model
from tasks_app.generation.structured_output import constraint_grammar
from tests.support.layouts import CHUNK
from tests.support.quantized import expected_case
from tests.support.specs import spec_of
from tests.test_backend_layouts import MODELS, REFERENCES, case_of
from workers.backends.base import FINISH_CANCELLED, Chunk, EngineObserver, SamplingParams
from workers.backends.errors import GenerationError
from workers.backends.onnx import OnnxRuntimeBackend
from workers.backends.onnx.engine import BatchEngine
from workers.backends.onnx.model import OnnxModel

# No database here: the PostgreSQL pass of scripts/test leaves these out (tests/conftest.py).
pytestmark = pytest.mark.database_free

LAYOUTS = sorted(REFERENCES)


def never() -> bool:
    return False


@dataclass
class Observer(EngineObserver):
    """Records what the engine reports (the EngineObserver interface)."""

    steps: list[int] = field(default_factory=list)
    prefills: list[int] = field(default_factory=list)
    waits: list[float] = field(default_factory=list)
    running: list[int] = field(default_factory=list)
    closed: bool = False
    # With an engine: (rows decoding, groups) at each step, read on the model thread as it steps, so that no
    # step goes unseen however late a reader's thread runs on a loaded machine.
    engine: Any = None
    shapes: list[tuple[int, int]] = field(default_factory=list)

    def step(self, *, rows: int, seconds: float) -> None:
        self.steps.append(rows)
        if self.engine is not None:
            now = self.engine.snapshot()
            self.shapes.append((now["decoding"], now["groups"]))

    def prefill(self, *, tokens: int, seconds: float) -> None:
        self.prefills.append(tokens)

    def queue_wait(self, seconds: float) -> None:
        self.waits.append(seconds)

    def kv(self, *, in_use: int, budget: int) -> None:
        assert not budget or in_use <= budget

    def rows(self, *, running: int, waiting: int) -> None:
        self.running.append(running)

    def masks(self, *, rows: int, seconds: float) -> None:
        pass

    def close(self) -> None:
        self.closed = True


def fresh_engine(model: OnnxModel, *, max_batch: int = 3, budget: int = 0, **kwargs: Any) -> BatchEngine:
    """An engine of its own for one test (the model's cached one keeps its first settings)."""
    return BatchEngine(model, max_batch=max_batch, kv_budget_bytes=budget, delta_tokens=4, delta_seconds=0.05, **kwargs)


def ids_of(chunks: Sequence[Chunk]) -> list[int]:
    return [step.token_id for chunk in chunks for step in chunk.steps if step.token_id is not None]


def alone(model: OnnxModel, prompt: list[int], params: SamplingParams) -> list[int]:
    generation = model.generate(prompt, params, should_stop=never)
    return [step.token_id for step in generation if step.token_id is not None]


@dataclass
class Request:
    prompt: list[int]
    params: SamplingParams
    delay: float = 0.0
    should_stop: Callable[[], bool] = never
    # The model thread waits, at this row's first check, until this many rows were submitted:
    # on a fast model a row can end before a later one arrives, and then no batch ever forms.
    hold_for: int = 0


def run_together(engine: BatchEngine, model: OnnxModel, requests: Sequence[Request]) -> list[list[Chunk]]:
    """Submit each request from its own thread (as task threads do), after its delay; every row's chunks."""
    results: list[list[Chunk]] = [[] for _ in requests]
    errors: list[BaseException] = []
    submitted = threading.Condition()
    count = [0]

    def held(request: Request) -> Callable[[], bool]:
        waited = [False]

        def should_stop() -> bool:
            if not waited[0]:
                waited[0] = True
                with submitted:
                    # Generous: on a loaded machine the other threads' generations (a grammar to compile)
                    # took more than 10 s to be submitted, and the rows then joined one by one.
                    submitted.wait_for(lambda: count[0] >= request.hold_for, timeout=120)
            return request.should_stop()

        return should_stop

    def submit(index: int, request: Request) -> None:
        time.sleep(request.delay)
        try:
            stop = held(request) if request.hold_for else request.should_stop
            generation = model.generate(request.prompt, request.params, should_stop=stop)
            stream = engine.submit(generation)
            with submitted:
                count[0] += 1
                submitted.notify_all()
            results[index].extend(stream)
        except BaseException as exc:  # surfaced below, with the others
            errors.append(exc)

    threads = [threading.Thread(target=submit, args=pair) for pair in enumerate(requests)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert not errors, errors
    return results


def beside(
    engine: BatchEngine, model: OnnxModel, requests: Sequence[Request], side: Callable[[], None]
) -> list[list[int]]:
    """``side`` in a thread of its own while ``requests`` run as in :func:`run_together`; their ids."""
    try:
        thread = threading.Thread(target=side)
        thread.start()
        got = [ids_of(chunks) for chunks in run_together(engine, model, requests)]
        thread.join(timeout=60)
    finally:
        engine.close()
    return got


def rows_brought_whole(model: OnnxModel, monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, int]]:
    """Watches the model's step-picks graph: for each call, its rows and how many it brought to the host whole."""
    picks = model.open_step_picks()
    take = picks.take
    whole: list[tuple[int, int]] = []

    def watched(logits: Any, full: Any, **more: Any) -> Any:
        whole.append((int(logits.shape()[0]), len(full)))
        return take(logits, full, **more)

    monkeypatch.setattr(picks, "take", watched)
    return whole


def varied(model: OnnxModel, *, seed: int | None, mixed: bool = False) -> list[Request]:
    """Prompts of different lengths, limits that end rows at different steps, staggered starts;
    ``mixed``: every other row greedy, the rest seeded with ``seed``."""
    vocab = min(model.vocab_size, 300)
    requests = []
    for index, length in enumerate((31, 9, 47, 5, 22, 16)):
        prompt = [(7 + 13 * index + 5 * i) % (vocab - 3) + 3 for i in range(length)]
        sampled = {} if seed is None else {"temperature": 0.9, "top_p": 0.95}
        if mixed and index % 2 == 0:
            # Greedy rows, which a step picks on the device: with the penalty the generation config may
            # set (qwen2's 1.05, picked from candidates), one without, and one with frequency and presence.
            sampled = [{}, {"repetition_penalty": 1.0}, {"frequency_penalty": 0.6, "presence_penalty": 0.3}][index // 2]
        params = SamplingParams(max_output_tokens=6 + 5 * index, seed=seed, **({"temperature": 0} | sampled))
        requests.append(Request(prompt, params, delay=0.003 * index, hold_for=3 if index == 0 else 0))
    return requests


@pytest.mark.parametrize(
    ("seed", "device_picks"), [(None, False), (11, False), (11, True)], ids=["greedy", "seeded", "mixed-device-picks"]
)
@pytest.mark.parametrize("key", LAYOUTS)
def test_rows_joining_and_leaving_give_the_tokens_of_each_request_alone(
    loaded: Callable[[str], OnnxModel], key: str, seed: int | None, device_picks: bool, monkeypatch
) -> None:
    """Device picks (what CUDA runs, here on the CPU provider): greedy rows picked by the step-picks
    graph (penalised ones from their candidates), the seeded rows beside them sampled on the host from
    the rows it brought whole."""
    model = loaded(key)
    requests = varied(model, seed=seed, mixed=device_picks)
    expected = [alone(model, r.prompt, r.params) for r in requests]
    observer = Observer()
    engine = fresh_engine(model, observer=observer, device_picks=device_picks)
    whole = rows_brought_whole(model, monkeypatch) if device_picks else []
    try:
        got = [ids_of(chunks) for chunks in run_together(engine, model, requests)]
    finally:
        engine.close()
    assert got == expected
    if device_picks:  # the greedy rows' steps were picked on the device
        assert whole
    # Six requests through three places: never more than three rows at once, and (batchable
    # graphs) rows decoded together, so rows joined a running batch and left it.
    assert max(observer.running) <= 3 and len(observer.waits) == 6
    if model.batchable:
        assert max(observer.steps) > 1


@pytest.mark.parametrize("key", LAYOUTS)
def test_a_batch_of_the_reference_requests_gives_the_exporting_tools_tokens(
    loaded: Callable[[str], OnnxModel], key: str
) -> None:
    model = loaded(key)
    reference = REFERENCES[key]
    cases = [case_of(key, i) for i in range(len(reference["cases"]))]
    requests = [
        Request(
            case["prompt_ids"],
            SamplingParams(temperature=0, max_output_tokens=case["request"]["max_output_tokens"]),
            delay=0.002 * i,
        )
        for i, case in enumerate(cases)
    ]
    expected = [alone(model, r.prompt, r.params) for r in requests]
    engine = fresh_engine(model)
    try:
        got = [ids_of(chunks) for chunks in run_together(engine, model, requests)]
    finally:
        engine.close()
    assert got == expected
    # The recorded tokens; for int8/uint8 (whose tokens depend on the CPU's integer kernels and
    # the prefill split) those of a plain onnxruntime loop on this CPU with chunks of 8.
    assert got == [expected_case(key, i, chunk=CHUNK)["output_ids"] for i in range(len(cases))]


def test_the_demo_models_rows_equal_alone_greedy_and_seeded(demo_models_root: Path) -> None:
    model = OnnxRuntimeBackend(prefill_chunk=CHUNK, intra_op_threads=1).load(demo_models_root / "demo", device="cpu")
    try:
        for seed in (None, 5):
            requests = varied(model, seed=seed)
            expected = [alone(model, r.prompt, r.params) for r in requests]
            engine = fresh_engine(model, max_batch=4)
            try:
                got = [ids_of(chunks) for chunks in run_together(engine, model, requests)]
            finally:
                engine.close()
            assert got == expected
    finally:
        model.close()


@pytest.mark.parametrize("key", ["qwen2-tiny", "llama-genai", "qwen2-community:fp16", "phi3-legacy"])
def test_a_resumed_generation_joins_a_running_batch_and_continues_token_for_token(
    loaded: Callable[[str], OnnxModel], key: str
) -> None:
    model = loaded(key)
    params = SamplingParams(temperature=0.8, seed=3, max_output_tokens=24)
    generation = model.generate(list(range(10, 40)), params, should_stop=never)
    steps = iter(generation)
    for _ in range(9):
        next(steps)
    snapshot = generation.snapshot()
    rest = [step.token_id for step in steps if step.token_id is not None]
    others = varied(model, seed=None)[:3]
    expected_others = [alone(model, r.prompt, r.params) for r in others]
    engine = fresh_engine(model, max_batch=4)
    resumed_chunks: list[Chunk] = []

    def resume() -> None:
        time.sleep(0.01)  # the others are decoding by now
        resumed = model.resume(snapshot, params, should_stop=never)
        resumed_chunks.extend(engine.submit(resumed))

    assert beside(engine, model, others, resume) == expected_others
    assert ids_of(resumed_chunks) == rest


def test_a_cancelled_row_stops_within_one_step_and_the_others_keep_their_tokens(
    loaded: Callable[[str], OnnxModel],
) -> None:
    model = loaded("qwen2-tiny")
    requests = varied(model, seed=None)[:3]
    expected = [alone(model, r.prompt, r.params) for r in requests]
    cancel = threading.Event()
    engine = fresh_engine(model, max_batch=4)
    outcome: dict[str, Any] = {}

    def cancel_after_three_tokens() -> None:
        params = SamplingParams(temperature=0, max_output_tokens=200)
        generation = model.generate(list(range(3, 30)), params, should_stop=cancel.is_set)
        chunks = []
        for chunk in engine.submit(generation):
            chunks.append(chunk)
            if sum(c.tokens for c in chunks) >= 3 and not cancel.is_set():
                outcome["at_cancel"] = generation.output_tokens
                cancel.set()
        outcome["at_end"], outcome["reason"] = generation.output_tokens, generation.finish_reason
        outcome["last"] = chunks[-1]

    assert beside(engine, model, requests, cancel_after_three_tokens) == expected
    assert outcome["reason"] == FINISH_CANCELLED and outcome["last"].final
    # At most the step already under way when the flag was set.
    assert outcome["at_end"] - outcome["at_cancel"] <= 1


def test_a_stopped_row_leaves_and_the_others_are_undisturbed(loaded: Callable[[str], OnnxModel]) -> None:
    model = loaded("llama-tiny")
    requests = varied(model, seed=7)[:4]
    expected = [alone(model, r.prompt, r.params) for r in requests]
    engine = fresh_engine(model, max_batch=5)
    finals: list[Chunk] = []

    def stopped_early() -> None:
        generation = model.generate(
            list(range(4, 20)), SamplingParams(temperature=0, max_output_tokens=300), should_stop=never
        )
        stream = engine.submit(generation)
        for chunk in stream:
            if chunk.tokens:
                stream.stop()  # as a task thread does when its compare-and-set lost
            finals.append(chunk)
        assert generation.output_tokens < 300

    assert beside(engine, model, requests, stopped_early) == expected
    assert finals[-1].final


def long_prompt_beside_rows(prefill_share: float) -> tuple[list[int], set[int]]:
    """Two rows decoding, then a 200-token prompt joins: each row's tokens are checked against the request
    alone; the long prompt's prefill calls, and the numbers of groups seen while it ran."""
    # A large prefill chunk: alone, the long prompt would go in one call.
    model = OnnxRuntimeBackend(prefill_chunk=512, intra_op_threads=1).load(MODELS / "qwen2-tiny", device="cpu")
    long_prompt = [(i * 7) % 300 + 3 for i in range(200)]
    requests = [
        Request(list(range(5, 15)), SamplingParams(temperature=0, max_output_tokens=400)),
        Request(list(range(8, 20)), SamplingParams(temperature=0, max_output_tokens=400)),
    ]
    long_params = SamplingParams(temperature=0, max_output_tokens=20)
    observer = Observer()
    engine = fresh_engine(model, max_batch=3, observer=observer, prefill_share=prefill_share)
    observer.engine = engine
    decoding = threading.Barrier(3)
    results: list[list[int]] = [[], []]

    def row(index: int) -> None:
        request = requests[index]
        generation = model.generate(request.prompt, request.params, should_stop=never)
        for n, chunk in enumerate(engine.submit(generation)):
            results[index].extend(step.token_id for step in chunk.steps if step.token_id is not None)
            if n == 1:
                decoding.wait(timeout=30)  # both rows are decoding: now the long prompt comes

    try:
        threads = [threading.Thread(target=row, args=(i,)) for i in range(2)]
        for thread in threads:
            thread.start()
        decoding.wait(timeout=30)
        long_generation = model.generate(long_prompt, long_params, should_stop=never)
        long_ids = ids_of(list(engine.submit(long_generation)))
        for thread in threads:
            thread.join(timeout=60)
        expected = [alone(model, r.prompt, r.params) for r in requests]
        expected_long = alone(model, long_prompt, long_params)
    finally:
        engine.close()
        model.close()
    assert results == expected and long_ids == expected_long
    # The numbers of groups the steps decoded in: the two short rows joined together, in one.
    groups = {groups for _, groups in observer.shapes}
    short_calls, long_calls = observer.prefills[:2], observer.prefills[2:]
    assert sorted(short_calls) == [10, 12]
    assert sum(long_calls) == len(long_prompt)
    return long_calls, groups


def test_a_long_prompt_joins_in_slices_beside_decoding_rows() -> None:
    long_calls, groups = long_prompt_beside_rows(prefill_share=0.9)
    # The long prompt went in several calls while the rows decoded, none of them the whole prompt.
    assert len(long_calls) > 1
    # 210 positions beside rows of ~20-60: it decodes in a group of its own rather than making
    # the short rows attend over its width on every step.
    assert 2 in groups


def test_a_larger_prefill_share_fills_a_long_prompt_in_fewer_larger_slices() -> None:
    """LMSP_PREFILL_SHARE: the prompt's slices are sized to that share of a decode step."""
    small, _ = long_prompt_beside_rows(prefill_share=0.2)
    large, _ = long_prompt_beside_rows(prefill_share=100)
    assert len(large) < len(small)
    assert max(large) > max(small)


def test_a_graph_that_quantizes_per_call_never_shares_a_call(loaded: Callable[[str], OnnxModel]) -> None:
    model = loaded("qwen2-community:int8")
    assert not model.batchable
    requests = varied(model, seed=None)[:3]
    expected = [alone(model, r.prompt, r.params) for r in requests]
    engine = fresh_engine(model)
    try:
        assert not engine.batched
        got = [ids_of(chunks) for chunks in run_together(engine, model, requests)]
    finally:
        engine.close()
    assert got == expected


def test_the_kv_budget_holds_rows_back_in_order_and_refuses_what_never_fits(
    loaded: Callable[[str], OnnxModel],
) -> None:
    model = loaded("qwen2-tiny")
    per_position = model.kv_bytes_per_position
    # Room for two rows of (10 + 40) positions, not three.
    budget = 2 * 50 * per_position
    requests = [
        Request(list(range(3, 13)), SamplingParams(temperature=0, max_output_tokens=40), delay=0.002 * i)
        for i in range(4)
    ]
    expected = [alone(model, r.prompt, r.params) for r in requests]
    observer = Observer()
    engine = fresh_engine(model, max_batch=8, budget=budget, observer=observer)
    try:
        got = [ids_of(chunks) for chunks in run_together(engine, model, requests)]
        too_big = model.generate(list(range(3, 13)), SamplingParams(max_output_tokens=200), should_stop=never)
        with pytest.raises(GenerationError, match="LMSP_KV_CACHE_BYTES"):
            list(engine.submit(too_big))
    finally:
        engine.close()
    assert got == expected
    assert max(observer.running) == 2 and any(wait > 0 for wait in observer.waits)


def test_a_drain_ends_running_rows_interrupted_and_refuses_new_ones(loaded: Callable[[str], OnnxModel]) -> None:
    model = loaded("qwen2-tiny")
    engine = fresh_engine(model)
    try:
        long = SamplingParams(temperature=0, max_output_tokens=250)
        drained = threading.Event()
        rows: list[Any] = []

        def held_until_drained() -> bool:
            # Once it has its first token, the row waits for the drain: on a fast machine it would
            # otherwise reach its end of sequence before the test thread, woken by the first chunk, drains.
            if rows and rows[0].output_tokens:
                drained.wait(timeout=10)
            return False

        generation = model.generate(list(range(3, 13)), long, should_stop=held_until_drained)
        rows.append(generation)
        stream = engine.submit(generation)
        chunks = []
        for chunk in stream:
            chunks.append(chunk)
            if len(chunks) == 1:
                engine.drain(grace_seconds=0)
                drained.set()
        assert chunks[-1].final and chunks[-1].interrupted
        assert generation.finish_reason is None and generation.output_tokens < 250
        late = model.generate(list(range(3, 13)), SamplingParams(temperature=0), should_stop=never)
        (only,) = list(engine.submit(late))
        assert only.interrupted and late.output_tokens == 0
    finally:
        engine.close()


def test_closing_the_model_ends_its_rows_with_an_error_instead_of_leaving_them_waiting() -> None:
    model = OnnxRuntimeBackend(prefill_chunk=CHUNK).load(MODELS / "qwen2-tiny", device="cpu")
    engine = model.engine(max_batch=2, kv_budget_bytes=0, delta_tokens=4, delta_seconds=0.05)
    long = SamplingParams(temperature=0, max_output_tokens=250)
    closed = threading.Event()
    rows: list[Any] = []

    def held_until_closed() -> bool:
        # Once its first chunk is out, the row waits for the close: on a fast machine it would
        # otherwise make all its tokens before the test thread, woken by that chunk, closes the model.
        if rows and rows[0].output_tokens > 4:
            closed.wait(timeout=10)
        return False

    generation = model.generate(list(range(3, 13)), long, should_stop=held_until_closed)
    rows.append(generation)
    stream = engine.submit(generation)
    iterator = iter(stream)
    next(iterator)
    model.close()
    closed.set()
    with pytest.raises(GenerationError, match="unloaded"):
        for _ in iterator:
            pass


def test_the_cache_stays_where_the_session_computed_it(loaded: Callable[[str], OnnxModel]) -> None:
    model = loaded("llama-genai")
    engine = fresh_engine(model)
    seen: list[dict[str, Any]] = []

    def watch() -> None:
        for _ in range(200):
            state = engine.snapshot()
            if state["decoding"]:
                seen.append(state)
            time.sleep(0.001)

    try:
        watcher = threading.Thread(target=watch)
        watcher.start()
        run_together(engine, model, varied(model, seed=None)[:3])
        watcher.join()
    finally:
        engine.close()
    assert seen and all(state["cache_on_device"] for state in seen if state["cache_bytes"])


def test_a_broken_model_thread_fails_its_rows_and_the_next_rows_get_a_new_engine(monkeypatch) -> None:
    model = OnnxRuntimeBackend(prefill_chunk=CHUNK).load(MODELS / "qwen2-tiny", device="cpu")
    try:
        settings = {"max_batch": 2, "kv_budget_bytes": 0, "delta_tokens": 4, "delta_seconds": 0.05}
        engine = model.engine(**settings)
        params = SamplingParams(temperature=0, max_output_tokens=20)
        prompt = list(range(3, 13))
        expected = alone(model, prompt, params)
        # A fault no real input makes: a bug in the model thread (not an inference error).
        with monkeypatch.context() as patch:
            patch.setattr(BatchEngine, "_decode_step", lambda self, now: 1 / 0)
            with pytest.raises(GenerationError, match="batch engine"):
                list(engine.submit(model.generate(prompt, params, should_stop=never)))
        assert not engine.running
        with pytest.raises(GenerationError, match="batch engine"):
            list(engine.submit(model.generate(prompt, params, should_stop=never)))
        replacement = model.engine(**settings)
        assert replacement is not engine
        assert ids_of(list(replacement.submit(model.generate(prompt, params, should_stop=never)))) == expected
    finally:
        model.close()


@pytest.fixture(scope="module")
def wide(tmp_path_factory: pytest.TempPathFactory) -> Iterator[OnnxModel]:
    """The bench's wide model: demo's shape, 151,936 logits a row (as Qwen's), so the step samples on threads."""
    folder = tmp_path_factory.mktemp("wide")
    build_demo_model(folder, size="wide", endless=True)
    model = OnnxRuntimeBackend(prefill_chunk=CHUNK).load(folder, device="cpu")
    yield model
    model.close()


@pytest.mark.parametrize("device_picks", [False, True], ids=["host", "device-picks"])
def test_rows_sampled_on_several_threads_at_a_real_vocabulary_give_the_tokens_of_each_request_alone(
    wide: OnnxModel, device_picks: bool, monkeypatch
) -> None:
    """Seeded, greedy, penalised and grammar-bound rows in one step, shared out over three sampling threads.

    With device picks the greedy row is picked by the step-picks graph and only the other four rows'
    151,936 logits come to the host."""
    assert wide.vocab_size == 151936
    grammar = constraint_grammar(spec_of({"text": {"format": {"type": "json_object"}}}).constraint)
    params = [
        SamplingParams(max_output_tokens=30, temperature=0.7, top_p=0.9, seed=1),
        SamplingParams(max_output_tokens=24, temperature=0),
        SamplingParams(max_output_tokens=28, temperature=0.8, top_k=40, repetition_penalty=1.1, seed=2),
        SamplingParams(max_output_tokens=20, temperature=1.0, frequency_penalty=0.7, seed=3),
        SamplingParams(max_output_tokens=26, temperature=0.7, top_p=0.95, grammar=grammar, seed=4),
    ]
    requests = [
        Request([3 + (5 * index + 11 * i) % 400 for i in range(9 + 4 * index)], p, hold_for=5 if index == 0 else 0)
        for index, p in enumerate(params)
    ]
    expected = [alone(wide, r.prompt, r.params) for r in requests]
    observer = Observer()
    engine = fresh_engine(wide, max_batch=5, observer=observer, sampling_threads=3, device_picks=device_picks)
    whole = rows_brought_whole(wide, monkeypatch) if device_picks else []
    try:
        got = [ids_of(chunks) for chunks in run_together(engine, wide, requests)]
    finally:
        engine.close()
    assert got == expected
    assert all(len(ids) == p.max_output_tokens for ids, p in zip(got[:4], params[:4], strict=True))
    assert max(observer.steps) == 5  # every row in one step, so the step's rows went to the pool together
    assert all(token < 512 for ids in got for token in ids)  # the padded logits are never sampled
    if device_picks:
        # Every step of the greedy row but the engine's first (which learns the logits' width) was picked on the
        # device, and every other row of its call brought whole. Which rows shared a call is the threads' timing.
        assert len(whole) >= params[1].max_output_tokens - 2
        assert all(brought == rows - 1 for rows, brought in whole), whole
        assert max(rows for rows, _ in whole) > 1
