"""Models as people download them, through the ONNX Runtime backend: each layout gives the recorded tokens.

The folders under ``tests/fixtures/models`` were exported from tiny random
models by the real tools (optimum-onnx, the onnxruntime-genai builder,
``onnxruntime.quantization``; see ``tests/fixtures/README.md``), and
``model_references.json`` holds what transformers (for quantized graphs: the
exporting tool's own runtime) generated greedily from them. Every test loads
a fixture with ``OnnxRuntimeBackend().load(folder, graph=...)`` and runs real
ONNX Runtime sessions; no database is touched. The int8 graph's tokens depend
on the CPU's integer products (``tests/support/quantized.py``): for the graphs
that quantize per call the expected tokens are a plain ONNX Runtime loop's on
this CPU, and the recorded ones are checked with exact products.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from tests.support.quantized import PER_CALL, U8S8_SATURATES, case_ids, cpu_isa, expected_case, recorded_ids
from tests.support.specs import prompt_for
from workers.backends.base import FINISH_EOS, FINISH_LENGTH, SamplingParams, Step
from workers.backends.errors import ModelLoadError
from workers.backends.onnx import OnnxModel, OnnxRuntimeBackend
from workers.backends.sampling import SamplingDefaults

# No database here: the PostgreSQL pass of scripts/test leaves these out (tests/conftest.py).
pytestmark = pytest.mark.database_free

FIXTURES = Path(__file__).resolve().parent / "fixtures"
MODELS = FIXTURES / "models"
REFERENCES: dict[str, dict[str, Any]] = json.loads((FIXTURES / "model_references.json").read_text(encoding="utf-8"))[
    "models"
]
WHOLE = 4096  # above every fixture's prompt: the prompt goes in one call
SMALL_CHUNK = 8
CASES = [
    pytest.param(key, index, id=f"{key}-{index}")
    for key, reference in REFERENCES.items()
    for index in range(len(reference["cases"]))
]
GENAI = [key for key, reference in REFERENCES.items() if reference["layout"] == "genai-builder"]
MERGED = [key for key, reference in REFERENCES.items() if reference["layout"] == "optimum-legacy-merged"]
INT8 = "qwen2-community:int8"
UINT8 = "qwen2-community:uint8"
PER_CALL_CASES = [
    pytest.param(key, index, id=f"{key}-{index}")
    for key in (INT8, UINT8)
    for index in range(len(REFERENCES[key]["cases"]))
]
GENAI_SEARCH_KEYS = ("do_sample", "temperature", "top_k", "top_p", "repetition_penalty", "min_p")

Loader = Callable[[str, int], OnnxModel]


def never() -> bool:
    return False


@pytest.fixture(scope="module")
def load() -> Iterator[Loader]:
    """Each fixture model loaded once per prefill chunk size."""
    loaded: dict[tuple[str, int], OnnxModel] = {}

    def get(key: str, chunk: int) -> OnnxModel:
        if (key, chunk) not in loaded:
            reference = REFERENCES[key]
            backend = OnnxRuntimeBackend(prefill_chunk=chunk)
            loaded[key, chunk] = backend.load(MODELS / reference["folder"], graph=reference["graph"], device="cpu")
        return loaded[key, chunk]

    yield get
    for model in loaded.values():
        model.close()


def case_of(key: str, index: int) -> dict[str, Any]:
    return REFERENCES[key]["cases"][index]


def greedy(case: Mapping[str, Any]) -> SamplingParams:
    return SamplingParams(temperature=0, max_output_tokens=case["request"]["max_output_tokens"])


def token_ids(steps: Sequence[Step]) -> list[int]:
    return [s.token_id for s in steps if s.token_id is not None]


def run(model: OnnxModel, prompt: list[int], params: SamplingParams, limit: int | None = None) -> tuple[Any, list[int]]:
    generation = model.generate(prompt, params, should_stop=never)
    steps: list[Step] = []
    for step in generation:
        steps.append(step)
        if limit is not None and len(token_ids(steps)) == limit:
            break
    return generation, token_ids(steps)


def one_call_logits(model: OnnxModel, ids: Sequence[int]) -> np.ndarray:
    """The last position's logits from one plain ``session.run`` over all ids: no cache, no IOBinding."""
    graph = model.graph
    names = graph.names
    empty = np.zeros((1, graph.kv_heads, 0, graph.head_dim), dtype=graph.kv_dtype)
    feeds: dict[str, np.ndarray] = {
        names.input_ids: np.asarray([ids], dtype=graph.input_ids_dtype),
        names.attention_mask: np.ones((1, len(ids)), dtype=graph.attention_mask_dtype),
        **{name: empty for name in graph.past_names},
    }
    if graph.has_position_ids:
        feeds[names.position_ids] = np.arange(len(ids), dtype=graph.position_ids_dtype)[None, :]
    if graph.use_cache_branch:
        feeds[graph.use_cache_branch] = np.array([False])
    (logits,) = model.session.run([names.logits], feeds)
    return logits[0, -1].astype(np.float32)


def copy_fixture(key: str, dst: Path) -> tuple[Path, dict[str, Any]]:
    reference = REFERENCES[key]
    return Path(shutil.copytree(MODELS / reference["folder"], dst)), reference


def assert_load_fails(folder: Path, needle: str, **kwargs: Any) -> str:
    with pytest.raises(ModelLoadError) as caught:
        OnnxRuntimeBackend().load(folder, device="cpu", **kwargs)
    message = str(caught.value)
    assert needle in message and folder.name in message
    assert "\n" not in message and "Traceback" not in message
    return message


# --------------------------------------------------------------------------- #
# Every fixture: prompt, greedy tokens (whole and chunked prefill), resume
# --------------------------------------------------------------------------- #


def test_the_fixtures_cover_every_layout_and_the_quantized_variants() -> None:
    layouts = {reference["layout"] for reference in REFERENCES.values()}
    assert layouts == {"optimum-flat", "onnx-community", "genai-builder", "optimum-legacy-merged"}
    community = {f"qwen2-community:{tag}" for tag in ("int8", "uint8", "q4", "q4f16", "fp16", "bnb4")}
    assert community | {"llama-genai-int4"} <= set(REFERENCES)
    assert all(PER_CALL in case for key in (INT8, UINT8) for case in REFERENCES[key]["cases"])
    # Their tokens depend on the CPU's integer products: the references say which CPU's they are.
    assert all(REFERENCES[key]["recorded_isa"] for key in (INT8, UINT8))


@pytest.mark.parametrize(("key", "index"), CASES)
def test_prompt_ids_equal_the_recorded_ones(load: Loader, key: str, index: int) -> None:
    case = case_of(key, index)
    assert load(key, WHOLE).prompt_ids(prompt_for(case["request"])) == case["prompt_ids"]


@pytest.mark.parametrize(("key", "index"), CASES)
def test_greedy_tokens_with_the_whole_prompt_in_one_call_equal_the_reference(
    load: Loader, key: str, index: int
) -> None:
    # qwen2-* record transformers with repetition_penalty 1.05 from their generation_config.json:
    # it applies with temperature 0 too. A graph that quantizes per call gives this CPU's tokens.
    case = expected_case(key, index, chunk=None)
    generation, ids = run(load(key, WHOLE), case["prompt_ids"], greedy(case))
    assert ids == case["output_ids"]
    assert generation.prompt_tokens == case["prompt_tokens"]
    assert generation.output_tokens == case["output_tokens"]
    assert generation.finish_reason == (FINISH_EOS if case["ended_on_eos"] else FINISH_LENGTH)
    assert generation.text() == case["shown_text"]


@pytest.mark.parametrize(("key", "index"), CASES)
def test_greedy_tokens_with_a_chunked_prefill_equal_the_reference(load: Loader, key: str, index: int) -> None:
    case = case_of(key, index)
    # A dynamically quantized graph computes its activation scales per call:
    # chunks give other tokens than one call, those of onnxruntime's own loop with the same chunks.
    chunk = case[PER_CALL]["chunk_tokens"] if PER_CALL in case else SMALL_CHUNK
    assert len(case["prompt_ids"]) > 2 * chunk  # several calls
    generation, ids = run(load(key, chunk), case["prompt_ids"], greedy(case))
    assert ids == expected_case(key, index, chunk=chunk)["output_ids"]
    assert generation.prompt_tokens == case["prompt_tokens"]


@pytest.mark.parametrize("chunked", [False, True], ids=["whole", "chunked"])
@pytest.mark.parametrize(("key", "index"), PER_CALL_CASES)
def test_exact_integer_products_give_the_recorded_quantized_tokens_on_any_cpu(
    key: str, index: int, chunked: bool
) -> None:
    """The references hold the tokens of exact int32 MatMulInteger products (a VNNI CPU's)."""
    case = case_of(key, index)
    chunk = case[PER_CALL]["chunk_tokens"] if chunked else None
    assert case_ids(key, index, chunk=chunk, exact_u8s8=True) == recorded_ids(case, chunk)


@pytest.mark.parametrize("index", range(len(REFERENCES[INT8]["cases"])))
def test_int8_tokens_are_the_recorded_ones_only_where_the_cpu_adds_its_products_exactly(index: int) -> None:
    # Where MLAS sums uint8 x int8 products pairwise into saturating int16 (AVX2, AVX-512 without
    # VNNI), onnxruntime's own loop does not give the recorded tokens; everywhere else it does.
    saturates = cpu_isa() in U8S8_SATURATES
    assert (case_ids(INT8, index, chunk=None) != case_of(INT8, index)["output_ids"]) == saturates


@pytest.mark.parametrize(
    ("flags", "isa"),
    [
        ("fpu sse2 sse4_1 avx fma avx2 bmi2 sha_ni vaes", "avx2"),
        ("sse4_1 avx fma avx2 avx_vnni", "avx-vnni"),
        ("avx fma avx2 avx512f avx512dq avx512bw avx512vl", "avx512"),
        ("avx fma avx2 avx_vnni avx512f avx512dq avx512bw avx512vl avx512_vnni", "avx512-vnni"),
        ("avx2 fma avx512f avx512dq avx512bw avx512vl avx512_vnni amx_bf16 amx_tile amx_int8", "amx"),
        ("sse2 sse4_1 sse4_2", "sse2"),
    ],
)
def test_the_cpus_instruction_set_is_read_from_its_flags(flags: str, isa: str) -> None:
    assert cpu_isa(f"processor\t: 0\nflags\t\t: {flags}\nbugs\t\t: spectre_v1\n") == isa


@pytest.mark.parametrize("chunk", [WHOLE, SMALL_CHUNK], ids=["whole", "chunked"])
@pytest.mark.parametrize(
    "params",
    [SamplingParams(temperature=0, max_output_tokens=24), SamplingParams(seed=1234, max_output_tokens=24)],
    ids=["greedy", "sampled-with-the-model-defaults"],
)
@pytest.mark.parametrize("key", list(REFERENCES))
def test_resume_from_a_snapshot_mid_way_continues_token_for_token(
    load: Loader, key: str, params: SamplingParams, chunk: int
) -> None:
    model = load(key, chunk)
    prompt = REFERENCES[key]["cases"][-1]["prompt_ids"]
    whole, whole_ids = run(model, prompt, params)
    k = len(whole_ids) // 2
    assert k >= 2

    first, first_ids = run(model, prompt, params, limit=k)
    snapshot = json.loads(json.dumps(first.snapshot()))
    resumed = model.resume(snapshot, params, should_stop=never)
    rest = token_ids(list(resumed))
    assert first_ids + rest == whole_ids
    assert resumed.text() == whole.text()
    assert resumed.finish_reason == whole.finish_reason


# --------------------------------------------------------------------------- #
# Layouts
# --------------------------------------------------------------------------- #


def test_onnx_community_variants_load_from_the_parent_folder(load: Loader) -> None:
    variants = [key for key, reference in REFERENCES.items() if reference["layout"] == "onnx-community"]
    assert {REFERENCES[key]["graph"] for key in variants} >= {"onnx/model.onnx", "onnx/model_int8.onnx"}
    for key in variants:
        model = load(key, WHOLE)
        folder = MODELS / REFERENCES[key]["folder"]
        assert not (folder / "onnx" / "config.json").exists()  # the side files are the parent's
        assert model.name == folder.name and model.graph_file == REFERENCES[key]["graph"]
        assert model.eos_token_ids == set(REFERENCES[key]["generation_config"]["eos_token_id"])


def test_a_missing_graph_or_one_outside_the_folder_is_named(tmp_path: Path) -> None:
    folder = MODELS / REFERENCES["qwen2-community"]["folder"]
    message = assert_load_fails(folder, "has no onnx/model_q8f16.onnx", graph="onnx/model_q8f16.onnx")
    assert str(MODELS) not in message  # the path inside the folder, not the host's
    assert_load_fails(folder, "not a path inside the model folder", graph="../qwen2-tiny/model.onnx")

    no_config, _ = copy_fixture("qwen2-tiny", tmp_path / "no-config")
    (no_config / "config.json").unlink()
    assert_load_fails(no_config, "has no config.json")


@pytest.mark.parametrize("key", GENAI)
def test_a_genai_builder_folder_loads_from_its_genai_config_alone(load: Loader, key: str) -> None:
    folder = MODELS / REFERENCES[key]["folder"]
    assert not (folder / "config.json").exists() and not (folder / "generation_config.json").exists()
    genai = json.loads((folder / "genai_config.json").read_text(encoding="utf-8"))
    section, decoder, search = genai["model"], genai["model"]["decoder"], genai["search"]
    assert decoder["filename"] == REFERENCES[key]["graph"]

    model = load(key, WHOLE)
    eos = section["eos_token_id"]
    assert model.eos_token_ids == set(eos if isinstance(eos, list) else [eos])
    assert model.context_length == section["context_length"]
    assert model.vocab_size == section["vocab_size"]
    assert (model.graph.kv_heads, model.graph.head_dim, model.graph.layers) == (
        decoder["num_key_value_heads"],
        decoder["head_size"],
        decoder["num_hidden_layers"],
    )
    # The search section is the generation config: the sampler's defaults come from it.
    mapped = {name: search[name] for name in GENAI_SEARCH_KEYS if name in search}
    assert {name: model.generation_config[name] for name in mapped} == mapped
    assert model.defaults == SamplingDefaults.from_generation_config(mapped)


def _rename_io(model: onnx.ModelProto, renames: Mapping[str, str]) -> None:
    """Rename graph inputs/outputs everywhere they are used (top-level graph only)."""
    graph = model.graph
    for value in [*graph.input, *graph.output]:
        if value.name in renames:
            value.name = renames[value.name]
    for node in graph.node:
        node.input[:] = [renames.get(name, name) for name in node.input]
        node.output[:] = [renames.get(name, name) for name in node.output]


@pytest.mark.parametrize("key", GENAI)
def test_a_genai_folder_names_its_decoder_and_its_io(load: Loader, key: str, tmp_path: Path) -> None:
    """Another file name and other IO names in genai_config.json: the backend follows them."""
    folder, reference = copy_fixture(key, tmp_path / "renamed")
    genai_path = folder / "genai_config.json"
    genai = json.loads(genai_path.read_text(encoding="utf-8"))
    decoder = genai["model"]["decoder"]
    graph = onnx.load(str(folder / decoder["filename"]))
    layers = decoder["num_hidden_layers"]
    renames = {"input_ids": "tokens", "attention_mask": "mask", "logits": "scores"}
    for layer in range(layers):
        for kind, short in (("key", "k"), ("value", "v")):
            renames[f"past_key_values.{layer}.{kind}"] = f"cache_in.{layer}.{short}"
            renames[f"present.{layer}.{kind}"] = f"cache_out.{layer}.{short}"
    _rename_io(graph, renames)
    onnx.save(graph, str(folder / "decoder-renamed.onnx"), save_as_external_data=True, location="renamed.data")
    decoder["filename"] = "decoder-renamed.onnx"
    decoder["inputs"].update(
        input_ids="tokens", attention_mask="mask", past_key_names="cache_in.%d.k", past_value_names="cache_in.%d.v"
    )
    decoder["outputs"].update(logits="scores", present_key_names="cache_out.%d.k", present_value_names="cache_out.%d.v")
    genai_path.write_text(json.dumps(genai), encoding="utf-8")

    model = OnnxRuntimeBackend(prefill_chunk=SMALL_CHUNK).load(folder, graph="decoder-renamed.onnx", device="cpu")
    assert model.graph.past_names[:2] == ("cache_in.0.k", "cache_in.0.v")
    case = reference["cases"][-1]
    assert run(model, case["prompt_ids"], greedy(case))[1] == case["output_ids"]


@pytest.mark.parametrize("key", MERGED)
def test_the_legacy_merged_decoder_is_fed_as_optimum_feeds_it(load: Loader, key: str) -> None:
    """use_cache_branch False on the first call (with an empty past), True on every call after."""
    model = load(key, SMALL_CHUNK)
    assert model.graph.use_cache_branch == "use_cache_branch"
    prompt = REFERENCES[key]["cases"][0]["prompt_ids"]
    decoder = model.decoder()
    ids = list(prompt)
    logits = decoder.feed(ids)  # chunks of 4: the later ones take the cache branch
    for _ in range(6):
        np.testing.assert_allclose(logits, one_call_logits(model, ids), rtol=1e-4, atol=1e-4)
        ids.append(int(np.argmax(logits)))
        logits = decoder.feed(ids[-1:])


@pytest.mark.parametrize("graph", ["decoder_model.onnx", "decoder_with_past_model.onnx", "onnx/decoder_model.onnx"])
def test_the_legacy_unmerged_pair_is_refused_with_what_to_do(graph: str) -> None:
    folder = MODELS / REFERENCES[MERGED[0]]["folder"]
    message = assert_load_fails(folder, "legacy unmerged export", graph=graph)
    assert graph in message
    assert "decoder_model_merged.onnx" in message and "text-generation-with-past" in message


# --------------------------------------------------------------------------- #
# Prefill in one call; what the graph declares
# --------------------------------------------------------------------------- #


def test_int8_logits_depend_on_the_prefill_split_so_the_prompt_goes_in_one_call(load: Loader) -> None:
    prompt = REFERENCES[INT8]["cases"][-1]["prompt_ids"]
    int8 = load(INT8, WHOLE)
    one_call = one_call_logits(int8, prompt)
    np.testing.assert_allclose(int8.decoder().feed(prompt), one_call, rtol=0, atol=1e-6)

    # What the backend fed before: all but the last token, then the last one alone.
    old = int8.decoder()
    old.feed(prompt[:-1])
    assert np.abs(old.feed(prompt[-1:]) - one_call).max() > 0.05

    # fp32 does not care how the prompt is split; int8 and uint8 make a resume replay its steps one call each.
    fp32 = load("qwen2-community", WHOLE)
    assert int8.replays_steps and load(UINT8, WHOLE).replays_steps and not fp32.replays_steps
    assert not any(load(f"qwen2-community:{tag}", WHOLE).replays_steps for tag in ("q4", "bnb4"))
    split = fp32.decoder()
    split.feed(prompt[:-1])
    np.testing.assert_allclose(split.feed(prompt[-1:]), one_call_logits(fp32, prompt), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("key", ["qwen2-community:fp16", "qwen2-community:q4f16"])
def test_float16_logits_depend_on_the_split_so_a_resume_replays_its_steps(load: Loader, key: str) -> None:
    """One call over the prompt and the ids generated so far rounds otherwise than the steps did."""
    model = load(key, WHOLE)
    assert model.graph.float16 and model.replays_steps
    case = case_of(key, 1)
    prompt, output = case["prompt_ids"], case["output_ids"]
    steps = model.decoder()
    steps.feed(prompt)
    differing = 0
    for k in range(1, len(output)):
        row = steps.feed(output[k - 1 : k])
        differing += not np.array_equal(row, one_call_logits(model, prompt + output[:k]))
    assert differing > 0


def _declared_as(model: onnx.ModelProto, name: str, element: int, *, output: bool) -> None:
    """Re-declare graph input or output ``name`` as ``element``, with a Cast to what the graph computes."""
    graph = model.graph
    values = graph.output if output else graph.input
    value = next(v for v in values if v.name == name)
    inner = f"{name}_as_computed"
    if output:
        for node in graph.node:
            node.output[:] = [inner if o == name else o for o in node.output]
        graph.node.append(helper.make_node("Cast", [inner], [name], to=element))
    else:
        computed = value.type.tensor_type.elem_type
        for node in graph.node:
            node.input[:] = [inner if i == name else i for i in node.input]
        graph.node.insert(0, helper.make_node("Cast", [name], [inner], to=computed))
    value.type.tensor_type.elem_type = element


@pytest.mark.parametrize("chunk", [WHOLE, SMALL_CHUNK], ids=["whole", "chunked"])
def test_float16_logits_and_int32_ids_are_handled_as_the_graph_declares(tmp_path: Path, chunk: int) -> None:
    folder, reference = copy_fixture("qwen2-tiny", tmp_path / "declared")
    model_path = folder / reference["graph"]
    graph = onnx.load(str(model_path))
    _declared_as(graph, "logits", TensorProto.FLOAT16, output=True)
    for name in ("input_ids", "attention_mask", "position_ids"):
        _declared_as(graph, name, TensorProto.INT32, output=False)
    onnx.save(graph, str(model_path))

    model = OnnxRuntimeBackend(prefill_chunk=chunk).load(folder, graph=reference["graph"], device="cpu")
    assert model.graph.logits_type == "tensor(float16)"
    assert model.graph.input_ids_dtype is np.int32 and model.graph.position_ids_dtype is np.int32
    for case in reference["cases"]:
        logits = model.decoder().feed(case["prompt_ids"])
        assert logits.dtype == np.float32 and logits.shape == (model.vocab_size,)
        assert run(model, case["prompt_ids"], greedy(case))[1] == case["output_ids"]
