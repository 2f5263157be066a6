"""Regenerate the tiny random-weight model fixtures under ``tests/fixtures/models``.

Unlike :mod:`fixture_models.demo`, which writes its ONNX graph by hand, every
graph here comes out of the real tools people use to make the models they
download: transformers builds a tiny random model, and optimum-onnx, the
onnxruntime-genai builder and ``onnxruntime.quantization`` turn it into the
folder layouts found on Hugging Face (see ``tests/fixtures/README.md``). The
same script runs each fixture through transformers and through the exporting
tool's own runtime and writes what they generate to
``tests/fixtures/model_references.json``, so the service's output can be
compared with theirs in CI without any of these heavy packages.

Run it with the export environment (``fixture_models/requirements-export.txt``)::

    python -m fixture_models.exports --out tests/fixtures/models \\
        --references tests/fixtures/model_references.json \\
        --genai-python /path/to/genai-venv/bin/python

Everything is seeded; a rerun with the same package versions writes the same
references and files (only optimum's merge_decoders orders the legacy graph's
deduplicated initializers differently from run to run).
No Django here: this module is a plain script.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import torch
import transformers
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig, PreTrainedTokenizerFast

from fixture_models.demo import _CORPUS
from fixture_models.ort_loop import plain_greedy_ids

# Byte tokens plus merges, before a family's special tokens are appended.
BASE_VOCAB_SIZE = 384
MAX_POSITIONS = 256
MAX_NEW_TOKENS = 24
# Greedy decoding of random weights can hit near ties; a seed is accepted only
# when every step's best logit beats the second best by this much, so that
# float noise between runtimes (ORT vs torch, CPU vs CUDA) cannot flip a token.
MIN_MARGIN = 0.1
SEED_TRIES = 400
# A quantized graph's margins are only known after the export; below this, the next seed.
MIN_QUANTIZED_MARGIN = 0.04
# A float16 graph rounds every activation and its logits to float16 (1/1024 of their size): where two
# runtimes or two prefill splits round differently, the logits move by more than an fp32 graph's do.
MIN_FP16_MARGIN = 0.05
FIXTURE_TRIES = 20
MIN_OUTPUT_TOKENS = 12
INT8_CHUNK = 8
# The file name the builder's int4 Phi-3 downloads use, in our model's words.
GENAI_LONG_FILENAME = "llama-tiny-cpu-int4-rtn-block-32-acc-level-4.onnx"
# A folder with several variants (onnx-community) gets the most; the whole tree stays under 5 MB.
MAX_FIXTURE_BYTES = 1408 * 1024
# transformers.js's scripts/quantize.py (how onnx-community makes its variants): bnb4 is NF4 in
# blocks of 64, as bitsandbytes' Linear4bit; q4 and q4f16 blocks of 32.
BNB4_BLOCK = 64

SHORT_REQUEST: dict[str, Any] = {"input": "Tell me a story about the sea.", "max_output_tokens": MAX_NEW_TOKENS}
LONG_REQUEST: dict[str, Any] = {
    "instructions": "You are a helpful assistant. Answer in one short paragraph.",
    "input": (
        "The old lighthouse keeper climbed the spiral stairs every evening at dusk. "
        "What did he write in his notebook on the night of the storm?"
    ),
    "max_output_tokens": MAX_NEW_TOKENS,
}
REQUESTS = (SHORT_REQUEST, LONG_REQUEST)


# --------------------------------------------------------------------------- #
# Tokenizers and chat templates, one per model family
# --------------------------------------------------------------------------- #


@dataclass(frozen=True)
class Family:
    """A model family's special tokens, chat template and sampling defaults."""

    special_tokens: tuple[str, ...]
    chat_template: str
    bos_token: str | None
    eos_token: str
    pad_token: str | None
    # Tokens whose ids go to generation_config.json's eos_token_id, in order.
    eos_tokens: tuple[str, ...]
    sampling: dict[str, Any] = field(default_factory=dict)
    # Llama 3's tokenizer.json prepends BOS on encode(); its template writes BOS too.
    bos_post_processor: bool = False


CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}"
    "{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
LLAMA3_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'"
    " + message['content'] | trim + '<|eot_id|>' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}"
)
PHI3_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'system' %}{{ '<|system|>\\n' + message['content'] + '<|end|>\\n' }}"
    "{% elif message['role'] == 'user' %}{{ '<|user|>\\n' + message['content'] + '<|end|>\\n' }}"
    "{% elif message['role'] == 'assistant' %}{{ '<|assistant|>\\n' + message['content'] + '<|end|>\\n' }}"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% else %}{{ eos_token }}{% endif %}"
)
PLAIN_TEMPLATE = (
    "{% for message in messages %}{{ message['role'] + ': ' + message['content'] + '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ 'assistant:' }}{% endif %}"
)

FAMILIES: dict[str, Family] = {
    "qwen2": Family(
        special_tokens=("<|endoftext|>", "<|im_start|>", "<|im_end|>"),
        chat_template=CHATML_TEMPLATE,
        bos_token=None,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        eos_tokens=("<|im_end|>", "<|endoftext|>"),
        # Qwen2.5-Instruct's generation_config.json.
        sampling={"do_sample": True, "repetition_penalty": 1.05, "temperature": 0.7, "top_k": 20, "top_p": 0.8},
    ),
    "llama": Family(
        special_tokens=(
            "<|begin_of_text|>",
            "<|end_of_text|>",
            "<|start_header_id|>",
            "<|end_header_id|>",
            "<|eot_id|>",
        ),
        chat_template=LLAMA3_TEMPLATE,
        bos_token="<|begin_of_text|>",
        eos_token="<|eot_id|>",
        pad_token=None,
        eos_tokens=("<|end_of_text|>", "<|eot_id|>"),
        # Llama-3.1-Instruct's generation_config.json.
        sampling={"do_sample": True, "temperature": 0.6, "top_p": 0.9},
        bos_post_processor=True,
    ),
    "phi3": Family(
        special_tokens=("<unk>", "<s>", "</s>", "<|endoftext|>", "<|assistant|>", "<|system|>", "<|end|>", "<|user|>"),
        chat_template=PHI3_TEMPLATE,
        bos_token="<s>",
        eos_token="<|endoftext|>",
        pad_token="<|endoftext|>",
        eos_tokens=("<|endoftext|>", "<|assistant|>", "<|end|>"),
    ),
    "gpt2": Family(
        special_tokens=("<|endoftext|>",),
        chat_template=PLAIN_TEMPLATE,
        bos_token="<|endoftext|>",
        eos_token="<|endoftext|>",
        pad_token=None,
        eos_tokens=("<|endoftext|>",),
    ),
}


def train_base_tokenizer() -> Tokenizer:
    """A byte-level BPE tokenizer of BASE_VOCAB_SIZE tokens, trained on the demo model's text."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=BASE_VOCAB_SIZE,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[],
        show_progress=False,
    )
    tokenizer.train_from_iterator(_CORPUS.splitlines(keepends=True), trainer=trainer)
    if tokenizer.get_vocab_size() != BASE_VOCAB_SIZE:
        raise RuntimeError(f"tokenizer has {tokenizer.get_vocab_size()} tokens, wanted {BASE_VOCAB_SIZE}")
    return tokenizer


def family_tokenizer(base_json: str, family: Family) -> PreTrainedTokenizerFast:
    """The base BPE plus the family's special tokens, as transformers loads it."""
    tokenizer = Tokenizer.from_str(base_json)
    tokenizer.add_special_tokens(
        [
            AddedToken(token, special=True, normalized=False, lstrip=False, rstrip=False)
            for token in family.special_tokens
        ]
    )
    if family.bos_post_processor:
        bos = family.bos_token
        assert bos is not None
        tokenizer.post_processor = processors.Sequence(
            [
                processors.ByteLevel(trim_offsets=False),
                processors.TemplateProcessing(
                    single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, tokenizer.token_to_id(bos))]
                ),
            ]
        )
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token=family.bos_token,
        eos_token=family.eos_token,
        pad_token=family.pad_token,
        unk_token="<unk>" if "<unk>" in family.special_tokens else None,
        chat_template=family.chat_template,
        model_max_length=MAX_POSITIONS,
        clean_up_tokenization_spaces=False,
    )


# --------------------------------------------------------------------------- #
# Tiny transformers models
# --------------------------------------------------------------------------- #

_TINY = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 64}


def model_config(
    arch: str, tokenizer: PreTrainedTokenizerFast, family: Family, overrides: dict[str, Any]
) -> transformers.PretrainedConfig:
    """A tiny config of ``arch`` whose token ids match the tokenizer."""
    ids = {
        "vocab_size": len(tokenizer),
        "bos_token_id": tokenizer.convert_tokens_to_ids(family.bos_token) if family.bos_token else None,
        "eos_token_id": tokenizer.convert_tokens_to_ids(family.eos_token),
        "pad_token_id": tokenizer.convert_tokens_to_ids(family.pad_token) if family.pad_token else None,
    }
    # A large initializer_range spreads the logits so that greedy argmax has clear margins.
    if arch == "qwen2":
        return transformers.Qwen2Config(
            **_TINY, **ids, num_key_value_heads=2, max_position_embeddings=MAX_POSITIONS,
            initializer_range=1.0, rope_theta=1000000.0, tie_word_embeddings=False, use_sliding_window=False,
            **overrides,
        )  # fmt: skip
    if arch == "llama":
        return transformers.LlamaConfig(
            **_TINY, **ids, num_key_value_heads=2, max_position_embeddings=MAX_POSITIONS,
            initializer_range=1.0, rope_theta=500000.0, tie_word_embeddings=False, **overrides,
        )  # fmt: skip
    if arch == "phi3":
        # As Phi-3-mini: no GQA. (optimum-onnx 0.1's ORTModelForCausalLM sizes a Phi3 past by
        # num_attention_heads, so a GQA Phi3 export cannot run there.)
        return transformers.Phi3Config(
            **_TINY, **ids, num_key_value_heads=4, max_position_embeddings=MAX_POSITIONS,
            original_max_position_embeddings=MAX_POSITIONS, sliding_window=None, initializer_range=1.0,
            tie_word_embeddings=False, **overrides,
        )  # fmt: skip
    if arch == "gpt2":
        return transformers.GPT2Config(
            n_embd=_TINY["hidden_size"], n_layer=_TINY["num_hidden_layers"], n_head=_TINY["num_attention_heads"],
            n_inner=_TINY["intermediate_size"], n_positions=MAX_POSITIONS, vocab_size=ids["vocab_size"],
            bos_token_id=ids["bos_token_id"], eos_token_id=ids["eos_token_id"], initializer_range=1.0, **overrides,
        )  # fmt: skip
    raise ValueError(f"unknown architecture {arch}")


def generation_config(tokenizer: PreTrainedTokenizerFast, family: Family, config: Any) -> GenerationConfig:
    eos_ids = [tokenizer.convert_tokens_to_ids(token) for token in family.eos_tokens]
    return GenerationConfig(
        bos_token_id=config.bos_token_id,
        eos_token_id=eos_ids if len(eos_ids) > 1 else eos_ids[0],
        pad_token_id=config.pad_token_id,
        **family.sampling,
    )


def messages_for(request: dict[str, Any]) -> list[dict[str, str]]:
    messages = []
    if request.get("instructions"):
        messages.append({"role": "system", "content": request["instructions"]})
    messages.append({"role": "user", "content": request["input"]})
    return messages


def prompt_ids(tokenizer: Any, request: dict[str, Any]) -> list[int]:
    ids = tokenizer.apply_chat_template(messages_for(request), add_generation_prompt=True, tokenize=True)
    if isinstance(ids, dict):  # transformers 5 returns a BatchEncoding
        ids = ids["input_ids"]
    return [int(i) for i in ids]


def greedy_generate(model: Any, ids: list[int], max_new_tokens: int) -> tuple[list[int], float]:
    """``model.generate(do_sample=False)`` with the model's generation config: new ids, smallest margin."""
    input_ids = torch.tensor([ids], dtype=torch.long)
    with torch.no_grad():
        out = model.generate(
            input_ids,
            attention_mask=torch.ones_like(input_ids),
            do_sample=False,
            max_new_tokens=max_new_tokens,
            return_dict_in_generate=True,
            output_scores=True,
        )
    new = [int(t) for t in out.sequences[0, len(ids) :]]
    return new, min(_margin(score[0].numpy()) for score in out.scores)


def _margin(scores: np.ndarray) -> float:
    top2 = np.sort(scores.astype(np.float64))[-2:]
    return float(top2[1] - top2[0])


@dataclass
class Built:
    """A tiny transformers model saved as a Hugging Face folder, with its tokenizer."""

    arch: str
    seed: int
    hf_dir: Path
    model: Any
    tokenizer: PreTrainedTokenizerFast
    margin: float


def build_hf_model(fixture: Fixture, base_json: str, work: Path, seed: int) -> Built:
    """The first seed from ``seed`` on whose greedy outputs have margins >= MIN_MARGIN."""
    arch, name = fixture.arch, fixture.folder
    family = FAMILIES[arch]
    tokenizer = family_tokenizer(base_json, family)
    config = model_config(arch, tokenizer, family, dict(fixture.config_overrides))
    for attempt in range(seed, seed + SEED_TRIES):
        torch.manual_seed(attempt)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
        model.generation_config = generation_config(tokenizer, family, config)
        runs = [greedy_generate(model, prompt_ids(tokenizer, r), r["max_output_tokens"]) for r in REQUESTS]
        margin = min(run[1] for run in runs)
        # A text that ends after a few tokens would leave chunked decoding and resuming untested.
        long_enough = all(len(run[0]) >= MIN_OUTPUT_TOKENS for run in runs)
        # Where the fixture asks for it, the short request ends on EOS before max_output_tokens.
        eos_ids = set(np.atleast_1d(model.generation_config.eos_token_id).tolist())
        ends = runs[0][0][-1] in eos_ids and len(runs[0][0]) < REQUESTS[0]["max_output_tokens"]
        if (
            margin >= MIN_MARGIN
            and long_enough
            and ends == fixture.short_ends_on_eos
            # PostgreSQL's text columns cannot hold NUL: a reference text must not contain one.
            and all("\x00" not in tokenizer.decode(run[0]) for run in runs)
        ):
            break
    else:
        raise RuntimeError(f"{name}: no seed in {seed}..{seed + SEED_TRIES} gives margins >= {MIN_MARGIN}")
    hf_dir = work / "hf" / name
    model.save_pretrained(hf_dir)
    tokenizer.save_pretrained(hf_dir)
    return Built(arch=arch, seed=attempt, hf_dir=hf_dir, model=model, tokenizer=tokenizer, margin=margin)


# --------------------------------------------------------------------------- #
# Exports
# --------------------------------------------------------------------------- #


def optimum_export(hf_dir: Path, out: Path, **kwargs: Any) -> None:
    from optimum.exporters.onnx import main_export

    main_export(str(hf_dir), output=out, task="text-generation-with-past", device="cpu", dtype="fp32", **kwargs)


def resave_external(src: Path, dst: Path) -> None:
    """Write ``src`` as ``dst`` with its weights in ``<dst name>_data``, as onnx-community names them."""
    model = onnx.load(str(src))
    dst.parent.mkdir(parents=True, exist_ok=True)
    onnx.save_model(
        model,
        str(dst),
        save_as_external_data=True,
        all_tensors_to_one_file=True,
        location=dst.name + "_data",
        size_threshold=1024,
    )


def export_flat(built: Built, out: Path) -> None:
    optimum_export(built.hf_dir, out)


def export_community(built: Built, out: Path, work: Path) -> None:
    from onnxruntime.quantization import QuantType, quantize_dynamic
    from onnxruntime.quantization.matmul_bnb4_quantizer import MatMulBnb4Quantizer
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

    flat = work / "community-flat"
    optimum_export(built.hf_dir, flat)
    out.mkdir(parents=True)
    for item in flat.iterdir():
        if item.suffix not in {".onnx", ".onnx_data"} and item.name != "chat_template.jinja":
            shutil.copy2(item, out / item.name)
    # Older onnx-community uploads keep the chat template inside tokenizer_config.json.
    AutoTokenizer.from_pretrained(flat).save_pretrained(out, save_jinja_files=False)
    onnx_dir = out / "onnx"
    resave_external(flat / "model.onnx", onnx_dir / "model.onnx")

    int8 = work / "community-int8.onnx"
    quantize_dynamic(flat / "model.onnx", int8, weight_type=QuantType.QInt8)
    resave_external(int8, onnx_dir / "model_int8.onnx")

    quantizer = MatMulNBitsQuantizer(onnx.load(str(flat / "model.onnx")), block_size=32, is_symmetric=True)
    quantizer.process()
    q4 = work / "community-q4.onnx"
    onnx.save_model(quantizer.model.model, str(q4))
    resave_external(q4, onnx_dir / "model_q4.onnx")

    uint8 = work / "community-uint8.onnx"
    quantize_dynamic(flat / "model.onnx", uint8, weight_type=QuantType.QUInt8)
    resave_external(uint8, onnx_dir / "model_uint8.onnx")

    fp16 = work / "community-fp16.onnx"
    onnx.save_model(float16_graph(flat / "model.onnx"), str(fp16))
    resave_external(fp16, onnx_dir / "model_fp16.onnx")

    # As transformers.js makes q4f16: the q4 graph, then converted to float16.
    q4f16 = work / "community-q4f16.onnx"
    onnx.save_model(float16_graph(q4), str(q4f16))
    resave_external(q4f16, onnx_dir / "model_q4f16.onnx")

    bnb4_quantizer = MatMulBnb4Quantizer(
        onnx.load(str(flat / "model.onnx")), quant_type=MatMulBnb4Quantizer.NF4, block_size=BNB4_BLOCK
    )
    bnb4_quantizer.process()
    bnb4 = work / "community-bnb4.onnx"
    onnx.save_model(bnb4_quantizer.model.model, str(bnb4))
    resave_external(bnb4, onnx_dir / "model_bnb4.onnx")


def float16_graph(src: Path) -> onnx.ModelProto:
    """``src`` converted by onnxruntime's float16 converter, inputs and outputs included.

    As onnx-community's fp16 and q4f16 files: the KV cache in and out and the
    logits are float16 (their config.json tells transformers.js
    ``kv_cache_dtype: float16``); the id inputs stay int64.
    """
    from onnxruntime.transformers.float16 import convert_float_to_float16

    return convert_float_to_float16(onnx.load(str(src)), keep_io_types=False)


def export_genai(built: Built, out: Path, work: Path, precision: str, genai_python: str, filename: str | None) -> None:
    command = [
        genai_python, "-m", "onnxruntime_genai.models.builder",
        "-i", str(built.hf_dir.resolve()), "-o", str(out.resolve()), "-p", precision, "-e", "cpu",
        "-c", str(work.resolve() / f"genai-cache-{precision}"),
    ]  # fmt: skip
    if filename:
        command += ["--extra_options", f"filename={filename}"]
    subprocess.run(command, check=True, cwd=work)
    # The case: a folder with genai_config.json only.
    for side in ("config.json", "generation_config.json"):
        (out / side).unlink(missing_ok=True)


def export_legacy(built: Built, out: Path, work: Path) -> None:
    """Optimum's pre-1.14 layout: decoder_model.onnx + decoder_with_past_model.onnx, merged on an If."""
    from optimum.exporters.tasks import TasksManager
    from optimum.onnx import merge_decoders

    constructor = TasksManager.get_exporter_config_constructor(
        exporter="onnx",
        model_type=built.model.config.model_type,
        task="text-generation-with-past",
        library_name="transformers",
    )
    # Takes no past, but returns the present: the first step of a legacy export.
    no_past_config = constructor(built.model.config, use_past=True, use_past_in_inputs=False)
    no_past = work / "legacy-no-past"
    optimum_export(built.hf_dir, no_past, custom_onnx_configs={"model": no_past_config})
    with_past = work / "legacy-with-past"
    optimum_export(built.hf_dir, with_past)
    decoder = work / "decoder_model.onnx"
    decoder_with_past = work / "decoder_with_past_model.onnx"
    shutil.copy2(no_past / "model.onnx", decoder)
    shutil.copy2(with_past / "model.onnx", decoder_with_past)
    out.mkdir(parents=True)
    merge_decoders(decoder, decoder_with_past, save_path=out / "decoder_model_merged.onnx", strict=True)
    for item in with_past.iterdir():
        if item.suffix not in {".onnx", ".onnx_data"}:
            shutil.copy2(item, out / item.name)


# --------------------------------------------------------------------------- #
# Reference runtimes
# --------------------------------------------------------------------------- #


def optimum_generate(folder: Path, file_name: str, ids: list[int], max_new_tokens: int) -> tuple[list[int], float]:
    from optimum.onnxruntime import ORTModelForCausalLM

    # file_name is matched by base name anywhere under the folder (onnx/model_q4.onnx too), and config.json
    # and generation_config.json come from the top. With subfolder="onnx" optimum would find config.json at the
    # top, but not generation_config.json: it then generates without the repetition penalty.
    model = ORTModelForCausalLM.from_pretrained(folder, file_name=Path(file_name).name, use_cache=True)
    if model.generation_config.to_diff_dict() != GenerationConfig.from_pretrained(folder).to_diff_dict():
        raise RuntimeError(f"optimum did not load {folder}/generation_config.json")
    return greedy_generate(model, ids, max_new_tokens)


def genai_generate(folder: Path, ids: list[int], max_new_tokens: int) -> tuple[list[int], float]:
    import onnxruntime_genai as og

    model = og.Model(str(folder))
    params = og.GeneratorParams(model)
    params.set_search_options(do_sample=False, max_length=len(ids) + max_new_tokens)
    generator = og.Generator(model, params)
    generator.append_tokens(np.asarray([ids], dtype=np.int32))
    new: list[int] = []
    margin = float("inf")
    while not generator.is_done() and len(new) < max_new_tokens:
        margin = min(margin, _margin(np.asarray(generator.get_logits()).reshape(-1)))
        generator.generate_next_token()
        new.append(int(generator.get_next_tokens()[0]))
    return new, margin


# --------------------------------------------------------------------------- #
# The fixtures
# --------------------------------------------------------------------------- #


@dataclass(frozen=True)
class Variant:
    """One model as the service registers it: a graph in a fixture folder and how to check it."""

    name: str
    graph: str
    # "transformers", "optimum" or "onnxruntime-genai": whose tokens are the reference.
    reference: str
    checks: tuple[str, ...] = ()
    # Dynamically quantized (int8, uint8): also record a prefill in chunks, which gives other tokens.
    quantizes_per_call: bool = False
    min_margin: float = MIN_QUANTIZED_MARGIN


@dataclass(frozen=True)
class Fixture:
    folder: str
    arch: str
    seed: int
    layout: str
    variants: tuple[Variant, ...]
    export: Callable[..., None]
    tool: str
    config_overrides: tuple[tuple[str, Any], ...] = ()
    short_ends_on_eos: bool = False


def _flat(folder: str, arch: str, seed: int, *, short_ends_on_eos: bool = False) -> Fixture:
    return Fixture(
        short_ends_on_eos=short_ends_on_eos,
        folder=folder,
        arch=arch,
        seed=seed,
        layout="optimum-flat",
        variants=(Variant(folder, "model.onnx", "transformers", ("optimum",)),),
        export=lambda built, out, work, _args: export_flat(built, out),
        tool="optimum.exporters.onnx.main_export (task text-generation-with-past, fp32)",
    )


def _genai(
    folder: str, precision: str, reference: str, filename: str | None, *, short_ends_on_eos: bool = False
) -> Fixture:
    tool = f"python -m onnxruntime_genai.models.builder -p {precision} -e cpu"
    return Fixture(
        folder=folder,
        arch="llama",
        seed=600,
        layout="genai-builder",
        variants=(
            Variant(
                folder,
                filename or "model.onnx",
                reference,
                ("onnxruntime-genai",) if reference == "transformers" else (),
            ),
        ),
        export=lambda built, out, work, args: export_genai(built, out, work, precision, args.genai_python, filename),
        tool=f"{tool} --extra_options filename={filename}" if filename else tool,
        config_overrides=GENAI_OVERRIDES,
        short_ends_on_eos=short_ends_on_eos,
    )


# head_dim 16, not hidden_size / heads = 8: onnxruntime's GroupQueryAttention (the builder's
# attention op) wants a multiple of 16. The flat llama-tiny keeps 8: optimum-onnx 0.1's
# ORTModelForCausalLM sizes the past by hidden_size / heads and ignores head_dim.
GENAI_OVERRIDES: tuple[tuple[str, Any], ...] = (("head_dim", 16),)

FIXTURES: tuple[Fixture, ...] = (
    _flat("qwen2-tiny", "qwen2", 100, short_ends_on_eos=True),
    Fixture(
        folder="qwen2-community",
        arch="qwen2",
        seed=200,
        layout="onnx-community",
        variants=(
            Variant("qwen2-community", "onnx/model.onnx", "transformers", ("optimum",)),
            Variant("qwen2-community:int8", "onnx/model_int8.onnx", "optimum", quantizes_per_call=True),
            Variant("qwen2-community:q4", "onnx/model_q4.onnx", "optimum"),
            # Checked after the three above, so that a seed they reject is still rejected first.
            Variant("qwen2-community:fp16", "onnx/model_fp16.onnx", "optimum", min_margin=MIN_FP16_MARGIN),
            Variant("qwen2-community:q4f16", "onnx/model_q4f16.onnx", "optimum", min_margin=MIN_FP16_MARGIN),
            Variant("qwen2-community:uint8", "onnx/model_uint8.onnx", "optimum", quantizes_per_call=True),
            Variant("qwen2-community:bnb4", "onnx/model_bnb4.onnx", "optimum"),
        ),
        export=lambda built, out, work, _args: export_community(built, out, work),
        tool=(
            "optimum main_export (fp32), re-saved with external data; int8: onnxruntime.quantization.quantize_dynamic "
            "(QInt8); q4: onnxruntime.quantization MatMulNBitsQuantizer (4 bits, block 32, symmetric); "
            "uint8: quantize_dynamic (QUInt8); fp16: onnxruntime.transformers.float16.convert_float_to_float16 "
            "(float16 inputs and outputs); q4f16: the q4 graph through the same converter; "
            "bnb4: onnxruntime.quantization MatMulBnb4Quantizer (NF4, block 64)"
        ),
    ),
    _flat("llama-tiny", "llama", 300),
    _flat("phi3-tiny", "phi3", 400),
    _flat("gpt2-tiny", "gpt2", 500),
    _genai("llama-genai", "fp32", "transformers", None, short_ends_on_eos=True),
    _genai("llama-genai-int4", "int4", "onnxruntime-genai", GENAI_LONG_FILENAME),
    Fixture(
        folder="phi3-legacy",
        arch="phi3",
        seed=700,
        layout="optimum-legacy-merged",
        variants=(Variant("phi3-legacy", "decoder_model_merged.onnx", "transformers", ("optimum",)),),
        export=lambda built, out, work, _args: export_legacy(built, out, work),
        tool=(
            "optimum main_export twice (no past in / present out, and with past) + optimum.onnx.merge_decoders; "
            "only decoder_model_merged.onnx kept"
        ),
    ),
)


def _runtime_outputs(
    variant: Variant, built: Built, folder: Path, ids: list[int], limit: int
) -> dict[str, tuple[list[int], float]]:
    """Greedy ids and smallest margin from transformers and from each runtime the variant names."""
    runs = {"transformers": greedy_generate(built.model, ids, limit)}
    for runtime in {variant.reference, *variant.checks} - {"transformers"}:
        if runtime == "optimum":
            runs[runtime] = optimum_generate(folder, variant.graph, ids, limit)
        else:
            runs[runtime] = genai_generate(folder, ids, limit)
    output = runs[variant.reference][0]
    for runtime in variant.checks:
        if runs[runtime][0] != output:
            raise RuntimeError(f"{variant.name}: {runtime} gives {runs[runtime][0]}, {variant.reference} {output}")
    return runs


def _chunked_prefill(graph: Path, gen: dict[str, Any], ids: list[int], output: list[int]) -> dict[str, Any]:
    """A plain KV loop over a dynamically quantized graph, the prompt whole and in chunks."""
    eos = gen["eos_token_id"] if isinstance(gen["eos_token_id"], list) else [gen["eos_token_id"]]
    penalty = float(gen.get("repetition_penalty") or 1.0)

    def loop(max_new_tokens: int, chunk: int | None) -> list[int]:
        return plain_greedy_ids(
            graph,
            prompt_ids=ids,
            max_new_tokens=max_new_tokens,
            chunk=chunk,
            repetition_penalty=penalty,
            eos_token_ids=eos,
        )

    whole = loop(len(output), None)
    if whole != output:
        raise RuntimeError(f"{graph}: a whole-prompt ORT loop gives {whole}, optimum {output}")
    chunked = loop(MAX_NEW_TOKENS, INT8_CHUNK)
    return {"chunk_tokens": INT8_CHUNK, "output_ids": chunked, "equals_reference": chunked == output}


def run_variant(
    fixture: Fixture, variant: Variant, built: Built, folder: Path, reference_gen: dict[str, Any]
) -> dict[str, Any]:
    """Every request through the reference runtime, checked against the others."""
    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    eos = (
        reference_gen["eos_token_id"]
        if isinstance(reference_gen["eos_token_id"], list)
        else [reference_gen["eos_token_id"]]
    )
    cases = []
    margins = []
    for request in REQUESTS:
        ids = prompt_ids(built.tokenizer, request)
        rendered = built.tokenizer.apply_chat_template(
            messages_for(request), add_generation_prompt=True, tokenize=False
        )
        # The fixture's own tokenizer.json must agree with transformers on the prompt.
        if tokenizer.encode(rendered, add_special_tokens=False).ids != ids:
            raise RuntimeError(f"{variant.name}: tokenizer.json encodes the prompt differently")
        limit = request["max_output_tokens"]
        runs = _runtime_outputs(variant, built, folder, ids, limit)
        output, margin = runs[variant.reference]
        ended = bool(output) and output[-1] in eos
        if "\x00" in tokenizer.decode(output):
            # The seed search checks transformers' text only; a quantized graph can still write one.
            raise WeakReference(f"{variant.name}: the reference text has a NUL, which PostgreSQL cannot store")
        if margin < variant.min_margin:
            raise WeakReference(f"{variant.name}: a top-2 margin of {margin:.4f} in {variant.reference}")
        case: dict[str, Any] = {
            "request": request,
            "prompt_ids": ids,
            "prompt_tokens": len(ids),
            "output_ids": output,
            "output_tokens": len(output),
            "ended_on_eos": ended,
            "text": tokenizer.decode(output[:-1] if ended else output),
            "min_top2_margin": round(margin, 6),
            "checked_against": sorted(variant.checks),
        }
        if variant.reference != "transformers":
            case["transformers_fp32_output_ids"] = runs["transformers"][0]
        if variant.quantizes_per_call:
            case["ort_chunked_prefill"] = _chunked_prefill(folder / variant.graph, reference_gen, ids, output)
        cases.append(case)
        margins.append(margin)
    return {
        "folder": fixture.folder,
        "layout": fixture.layout,
        "architecture": fixture.arch,
        "graph": variant.graph,
        "tool": fixture.tool,
        "seed": built.seed,
        "reference_runtime": variant.reference,
        "generation_config": reference_gen,
        "min_top2_margin": round(min(margins), 6),
        "cases": cases,
    }


def _reference_generation(fixture: Fixture, folder: Path, built: Built) -> dict[str, Any]:
    """The generation settings the references used, from the files the fixture ships."""
    gen = built.model.generation_config.to_diff_dict()
    gen.pop("transformers_version", None)
    if fixture.layout == "genai-builder":
        search = json.loads((folder / "genai_config.json").read_text())["search"]
        gen = {**gen, "genai_config_search": search}
    return gen


def file_list(folder: Path) -> list[dict[str, Any]]:
    return [
        {"path": path.relative_to(folder).as_posix(), "bytes": path.stat().st_size}
        for path in sorted(folder.rglob("*"))
        if path.is_file()
    ]


class WeakReference(Exception):
    """A reference that a tiny float difference could flip, or that the service could not store."""


def build_fixture(fixture: Fixture, base_json: str, folder: Path, tmp: Path, args: Any) -> dict[str, Any]:
    """Export the fixture and record its references; another seed while a quantized graph's are weak."""
    seed = fixture.seed
    for _ in range(FIXTURE_TRIES):
        work = tmp / f"{fixture.folder}-{seed}"
        work.mkdir()
        built = build_hf_model(fixture, base_json, work, seed)
        shutil.rmtree(folder, ignore_errors=True)
        fixture.export(built, folder, work, args)
        size = sum(item["bytes"] for item in file_list(folder))
        if size > MAX_FIXTURE_BYTES:
            raise RuntimeError(f"{fixture.folder} is {size} bytes, over {MAX_FIXTURE_BYTES}")
        gen = _reference_generation(fixture, folder, built)
        try:
            return {
                variant.name: {**run_variant(fixture, variant, built, folder, gen), "files": file_list(folder)}
                for variant in fixture.variants
            }
        except WeakReference as weak:
            print(f"{weak}; trying the next seed", flush=True)
            seed = built.seed + 1
    raise RuntimeError(f"{fixture.folder}: no seed in {FIXTURE_TRIES} tries gives strong references")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="folder to write the model folders into")
    parser.add_argument("--references", type=Path, required=True, help="JSON file to write the references to")
    parser.add_argument(
        "--genai-python",
        default=os.environ.get("GENAI_BUILDER_PYTHON", sys.executable),
        help="python with onnxruntime-genai's builder and the transformers it needs",
    )
    parser.add_argument("--only", nargs="*", help="fixture folders to rebuild (default: all)")
    args = parser.parse_args(argv)

    torch.use_deterministic_algorithms(True)
    base_json = train_base_tokenizer().to_str()
    references: dict[str, Any] = {}
    if args.only and args.references.exists():
        references = json.loads(args.references.read_text())["models"]
    args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="lmsp-exports-") as tmp:
        for fixture in FIXTURES:
            if not args.only or fixture.folder in args.only:
                references.update(build_fixture(fixture, base_json, args.out / fixture.folder, Path(tmp), args))
    document = {
        "generated_by": "python -m fixture_models.exports",
        "versions": _versions(),
        "max_new_tokens": MAX_NEW_TOKENS,
        "min_margin_required": MIN_MARGIN,
        "models": references,
    }
    args.references.write_text(json.dumps(document, indent=1, ensure_ascii=False) + "\n")
    return 0


def _versions() -> dict[str, str]:
    import importlib.metadata

    names = (
        "torch",
        "transformers",
        "optimum",
        "optimum-onnx",
        "onnx",
        "onnxruntime",
        "onnxruntime-genai",
        "tokenizers",
    )
    return {name: importlib.metadata.version(name) for name in names}


if __name__ == "__main__":
    sys.exit(main())
