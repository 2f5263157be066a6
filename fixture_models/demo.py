"""Build a tiny, randomly initialised Qwen2-style language model for demos and tests.

The files written by :func:`build_demo_model` follow the layout that Hugging Face
Optimum / onnx-community exports use for decoder-only models (``model.onnx`` with
``input_ids`` / ``attention_mask`` / ``position_ids`` / ``past_key_values.*``
inputs and ``logits`` / ``present.*`` outputs, plus the HF ``config.json``,
``generation_config.json`` and tokenizer files).  That lets the generation code
be exercised end to end - tokenizer, chat template, prefill, KV-cache decode,
padding - without downloading any weights.

The model is a real transformer (RMSNorm, RoPE, grouped-query attention, SwiGLU),
just with random weights, so its text is gibberish.  Two deliberate tweaks make
it useful for tests:

* every special token gets a large negative logit bias, so a free generation
  never stops on its own (tests need long generations to cancel or crash);
* the lm_head is scaled up and tokens that are UTF-8 fragments or control
  characters are discouraged, so greedy decoding wanders through many
  different, mostly readable tokens instead of repeating one.

Everything is deterministic: the same size and seed give byte-identical files
in any process.  Only onnx, numpy, tokenizers and the standard library are used
(the chat template is stored as text; jinja2 is needed only to render it).
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper
from tokenizers import (
    AddedToken,
    Tokenizer,
    decoders,
    models,
    pre_tokenizers,
    processors,
    trainers,
)

__all__ = [
    "CHAT_TEMPLATE",
    "DEMO_SIZES",
    "EOS_TOKEN",
    "PAD_TOKEN",
    "SPECIAL_TOKENS",
    "DemoSize",
    "build_demo_model",
]

# Opset 17 / IR 8 is old enough for every onnxruntime release we may meet and new
# enough for LessOrEqual (16) and Softmax over a single axis (13).
OPSET = 17
IR_VERSION = 8

ROPE_THETA = 10000.0
RMS_NORM_EPS = 1e-6
MAX_POSITION_EMBEDDINGS = 8192

ENDOFTEXT_TOKEN = "<|endoftext|>"
IM_START_TOKEN = "<|im_start|>"
IM_END_TOKEN = "<|im_end|>"
# Appended after the BPE vocabulary, in this order, like Qwen2 does.
SPECIAL_TOKENS: tuple[str, ...] = (ENDOFTEXT_TOKEN, IM_START_TOKEN, IM_END_TOKEN)
BOS_TOKEN = ENDOFTEXT_TOKEN
EOS_TOKEN = IM_END_TOKEN
PAD_TOKEN = ENDOFTEXT_TOKEN

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n'}}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

# Masked attention scores get this added.  Large enough that exp() underflows to
# exactly 0, finite so that a fully masked row (a left-padding query) still
# gives a uniform softmax instead of NaN.
_MASK_VALUE = -1e9
# Logit bias on special tokens: they can never win, even at high temperature.
_SPECIAL_TOKEN_LOGIT_BIAS = -1e4
# Logit bias on tokens that are not valid UTF-8 on their own or contain control
# characters, so that the decoded gibberish is mostly readable.
_UNREADABLE_TOKEN_LOGIT_BIAS = -3.0


@dataclass(frozen=True)
class DemoSize:
    """Shape hyper-parameters of one demo model variant."""

    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError("num_heads must be a multiple of num_kv_heads")
        if self.head_dim % 2:
            raise ValueError("head_dim must be even for rotary embeddings")
        if self.vocab_size <= 256 + len(SPECIAL_TOKENS):
            raise ValueError("vocab_size must leave room for the 256 byte tokens")


DEMO_SIZES: dict[str, DemoSize] = {
    # Fast enough for unit tests (~0.6 MB of weights).
    "demo": DemoSize(
        hidden_size=64,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        intermediate_size=176,
        vocab_size=512,
    ),
    # Benchmark variants: heavier per token, same architecture.
    "small": DemoSize(
        hidden_size=256,
        num_layers=4,
        num_heads=8,
        num_kv_heads=2,
        head_dim=32,
        intermediate_size=704,
        vocab_size=1024,
    ),
    "base": DemoSize(
        hidden_size=512,
        num_layers=8,
        num_heads=8,
        num_kv_heads=4,
        head_dim=64,
        intermediate_size=1408,
        vocab_size=2048,
    ),
}


# Training text for the BPE tokenizer.  Mixed scripts on purpose: accented Latin,
# CJK and emoji give multi-byte UTF-8 sequences that get merged into tokens, so
# the tokenizer exercises the same byte-level edge cases as a real one.
_CORPUS = """\
The old lighthouse keeper climbed the spiral stairs every evening at dusk. He carried a
brass lantern, a thermos of strong tea and a notebook in which he wrote down the weather,
the ships he saw and, sometimes, a short poem about the sea.
On clear nights the beam swept across the bay and touched the fishing boats that were
returning home. The sailors waved at the tower, although they knew that nobody could see
them from so far away.
When the storm arrived in November, the waves rose higher than the harbour wall. Windows
rattled, the power failed twice, and the keeper spent the whole night polishing the lens
by candlelight so that the light would not go dark.
Computers are very good at following instructions, but they are not good at guessing what
you meant. A program does exactly what it was told to do, which is why a single missing
character can stop an entire system from working.
To train a language model, researchers collect a large amount of text, split it into
tokens and teach the network to predict the next token. The model learns grammar, facts
and style from the statistics of the data.
A tokenizer turns a string into a list of integers. Byte-level tokenizers can represent
any input, because every possible byte has its own token, and frequent sequences of bytes
are merged into longer tokens.
Generation happens one token at a time. After the prompt has been processed, the model
keeps a cache of keys and values for every layer, so that each new step only needs to look
at the newest token.
The kitchen smelled of cinnamon, butter and fresh apples. Grandmother rolled the dough on
the wooden table while the children argued about who would get the largest slice of the
pie.
In the spring the garden was full of tulips, daffodils and bright green leaves. Bees moved
from flower to flower, and a blackbird sang from the top of the cherry tree every morning.
The train left the station at seven minutes past nine. Passengers read newspapers, looked
at their phones or watched the fields, rivers and small villages slide past the windows.
Mathematics describes patterns. A circle has no corners, a triangle has three, and the sum
of the angles in a triangle on a flat plane is always one hundred and eighty degrees.
Water boils at one hundred degrees Celsius at sea level, but at a lower temperature on top
of a high mountain, because the air pressure there is lower.
She opened the letter slowly, read the first line twice and then laughed so loudly that
the cat jumped off the sofa and ran into the garden.
The museum was quiet on Monday mornings. Visitors walked between the paintings, stopped in
front of the portraits and whispered, as if the people in the pictures might hear them.
Rivers carry sand and stones from the mountains to the ocean. Over thousands of years they
carve deep valleys, build wide deltas and change the shape of entire continents.
Please remember to save your work before you close the application. If the server
restarts, any changes that were not saved will be lost.
Error handling matters: a well designed service reports what went wrong, retries when it
is safe to do so and never leaves a request hanging forever.
The conference started with a keynote about open source software, continued with workshops
on databases and testing, and ended with a long dinner by the river.
Numbers such as 3.14159, 2.71828, 1024, 65536 and 1,000,000 appear often in technical
documents, together with dates like 2024-03-15 and times like 18:45.
"Where are you going?" asked the fox. "To the end of the forest," replied the rabbit,
"where the tall trees stop and the meadow begins."
Der alte Bäcker stand jeden Morgen um vier Uhr auf, um frisches Brot, Brötchen und Brezeln
für das ganze Dorf zu backen. Die Straßen waren still, nur die Vögel sangen.
Im Winter liegt oft Schnee auf den Dächern, und die Kinder bauen große Schneemänner im
Garten. Danach trinken sie heiße Schokolade und wärmen ihre Füße am Ofen.
Die Universität hat eine große Bibliothek mit über zwei Millionen Büchern. Studenten
können dort lernen, lesen und in Ruhe über schwierige Fragen nachdenken.
Grüße aus München! Das Wetter ist schön, die Berge sind nah, und übermorgen fahren wir mit
dem Zug nach Österreich.
Le petit café au coin de la rue ouvre à sept heures. On y sert des croissants, du pain au
chocolat et un café très fort que les habitués boivent debout au comptoir.
L'été dernier, nous avons passé deux semaines en Provence. Les champs de lavande étaient
magnifiques, et le marché du samedi était plein de fromages, de fruits et de fleurs.
Élise a écrit une longue lettre à sa sœur pour lui raconter son voyage en Norvège : les
fjords, les forêts, la neige et le soleil de minuit.
Ça ne fait rien, répondit-il, nous irons à la plage demain. Où est le problème ? Il fera
peut-être encore plus beau.
La bibliothèque municipale organise chaque mois une soirée de lecture où les enfants
découvrent des contes, des poèmes et des histoires d'aventure.
El mercado abre temprano y se llena de colores: naranjas, limones, tomates y pimientos. La
señora del puesto de flores saluda a todos con una sonrisa.
我们明天早上八点在火车站见面，然后一起去山里散步。天气预报说会是晴天，所以记得带上帽子和水。
这个图书馆有很多书，学生们每天都来这里学习和读书。安静的环境让人可以专心思考。
春天来了，公园里的花都开了，孩子们在草地上跑来跑去，老人们坐在长椅上聊天。
今日はとても良い天気ですね。午後は友達と一緒に公園へ行って、桜の花を見る予定です。
東京の駅はいつも人が多くて、電車は時間通りに来ます。朝のコーヒーを飲みながら、新聞を読む人もいます。
오늘은 날씨가 정말 좋습니다. 우리는 한강 공원에서 자전거를 타고 점심을 먹었습니다.
Emoji make messages more expressive 😀 🎉 🚀 🌍 ❤️ 👍 🙂 🍕 ☕ 📚 ✨ 🔥 and sometimes they replace
whole words: I ❤️ ☕ in the morning 🌅.
Thanks for the update 👍 The release is ready 🚀 and the tests are green ✅. Let's celebrate
with pizza 🍕 and cake 🎂!
Mixed text is common on the web: café, naïve, résumé, jalapeño, Zürich, Kraków, São Paulo,
Ærøskøbing, 東京, 北京, and 서울 all appear in the same article.
def greet(name: str) -> str:
    return f"Hello, {name}!"
for i in range(10):
    print(i * i)
{"user": "alice", "active": true, "roles": ["admin", "editor"], "score": 42.5}
The quick brown fox jumps over the lazy dog. Pack my box with five dozen liquor jugs. How
vexingly quick daft zebras jump!
Once upon a time, in a kingdom beside a silver lake, there lived a clever young princess
who preferred building machines to attending royal balls.
She designed a clock that could tell the time, the weather and the phase of the moon, and
a small mechanical bird that sang a different song every hour.
The king did not understand her inventions, but the people of the kingdom loved them, and
travellers came from distant lands to see the singing bird.
Every autumn the farmers brought their harvest to the square: pumpkins, potatoes, onions,
carrots, barley and wheat. Musicians played, and the festival lasted until midnight.
Good software is written for people first and computers second. Clear names, small
functions and honest comments make code easier to read, to test and to change.
The astronomer pointed the telescope at a faint smudge of light. It was a galaxy, millions
of light years away, made of billions of stars like our own sun.
Ocean currents move warm water from the equator towards the poles and cold water back
again, which shapes the climate of every coastline on the planet.
He forgot his umbrella on the bus, of course, on the one day when it rained from morning
until night without stopping for a single minute.
"""  # noqa: RUF001 - full-width CJK punctuation is intended


# --------------------------------------------------------------------------- #
# Tokenizer
# --------------------------------------------------------------------------- #


def _train_tokenizer(vocab_size: int) -> Tokenizer:
    """Train a byte-level BPE tokenizer whose total size is exactly ``vocab_size``."""
    tokenizer = Tokenizer(models.BPE())
    # No normalizer: decode(encode(text)) must give back the exact input bytes.
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(SPECIAL_TOKENS),
        # Every byte gets a token even if the corpus never uses it, so any
        # input string can be encoded.
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[],
        show_progress=False,
    )
    tokenizer.train_from_iterator(_CORPUS.splitlines(keepends=True), trainer=trainer)
    tokenizer.add_special_tokens(
        [
            AddedToken(
                token,
                special=True,
                normalized=False,
                lstrip=False,
                rstrip=False,
                single_word=False,
            )
            for token in SPECIAL_TOKENS
        ]
    )
    actual = tokenizer.get_vocab_size(with_added_tokens=True)
    if actual != vocab_size:
        # The corpus ran out of merges; extend _CORPUS rather than pad the vocab.
        raise RuntimeError(f"tokenizer has {actual} tokens, wanted {vocab_size}")
    return tokenizer


def _logit_bias(tokenizer: Tokenizer, vocab_size: int) -> np.ndarray:
    """Per-token additive logit bias (see module docstring for why)."""
    bias = np.zeros(vocab_size, dtype=np.float32)
    byte_decoder = {char: byte for byte, char in _bytes_to_unicode().items()}
    for token, token_id in tokenizer.get_vocab(with_added_tokens=False).items():
        raw = bytes(byte_decoder[char] for char in token)
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            # A fragment of a multi-byte character: still possible, just rarer.
            bias[token_id] = _UNREADABLE_TOKEN_LOGIT_BIAS
            continue
        if any(not char.isprintable() and char != "\n" for char in text):
            bias[token_id] = _UNREADABLE_TOKEN_LOGIT_BIAS
    for token in SPECIAL_TOKENS:
        bias[tokenizer.token_to_id(token)] = _SPECIAL_TOKEN_LOGIT_BIAS
    return bias


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table used by the ByteLevel pre-tokenizer."""
    printable = list(range(ord("!"), ord("~") + 1))
    printable += list(range(ord("¡"), ord("¬") + 1))
    printable += list(range(ord("®"), ord("ÿ") + 1))
    table = {byte: chr(byte) for byte in printable}
    extra = 0
    for byte in range(256):
        if byte not in table:
            table[byte] = chr(256 + extra)
            extra += 1
    return table


# --------------------------------------------------------------------------- #
# ONNX graph
# --------------------------------------------------------------------------- #


class _GraphBuilder:
    """Accumulates nodes and initializers with deterministic, readable names."""

    def __init__(self) -> None:
        self.nodes: list[onnx.NodeProto] = []
        self.initializers: list[TensorProto] = []
        self._constants: dict[tuple[str, bytes, tuple[int, ...]], str] = {}
        self._names: set[str] = set()

    def weight(self, name: str, array: np.ndarray) -> str:
        self.initializers.append(numpy_helper.from_array(array, name))
        return name

    def constant(self, value: Any, dtype: type = np.int64) -> str:
        """A small shared constant (shapes, axes, scalars), created once.

        Emitted as a Constant node rather than an initializer: with
        size_threshold=0 every initializer moves to model.onnx_data, and
        onnxruntime's shape inference cannot read a Reshape target shape from
        external data.  Optimum exports keep these as Constant nodes too.
        """
        array = np.asarray(value, dtype=dtype)
        key = (array.dtype.str, array.tobytes(), array.shape)
        if key not in self._constants:
            name = f"/Constant_{len(self._constants)}_output_0"
            self.nodes.append(
                helper.make_node(
                    "Constant",
                    [],
                    [name],
                    name=f"/Constant_{len(self._constants)}",
                    value=numpy_helper.from_array(array),
                )
            )
            self._constants[key] = name
        return self._constants[key]

    def op(
        self,
        op_type: str,
        inputs: Sequence[str],
        name: str,
        *,
        output: str | None = None,
        **attrs: Any,
    ) -> str:
        """Add one single-output node called ``name``; returns the output's name."""
        if name in self._names:
            raise ValueError(f"duplicate node name {name}")
        self._names.add(name)
        out = output or f"{name}_output_0"
        self.nodes.append(helper.make_node(op_type, list(inputs), [out], name=name, **attrs))
        return out


def _rms_norm(g: _GraphBuilder, x: str, weight: str, prefix: str) -> str:
    # ReduceMean takes axes as an attribute up to opset 17.
    squared = g.op("Mul", [x, x], f"{prefix}/Mul_sq")
    mean = g.op("ReduceMean", [squared], f"{prefix}/ReduceMean", axes=[-1], keepdims=1)
    var = g.op("Add", [mean, g.constant(RMS_NORM_EPS, np.float32)], f"{prefix}/Add_eps")
    inv = g.op("Reciprocal", [g.op("Sqrt", [var], f"{prefix}/Sqrt")], f"{prefix}/Reciprocal")
    normed = g.op("Mul", [x, inv], f"{prefix}/Mul_inv")
    return g.op("Mul", [normed, weight], f"{prefix}/Mul_weight")


def _rotate_half(g: _GraphBuilder, x: str, half: int, prefix: str) -> str:
    # HF "rotate_half": [x1, x2] -> [-x2, x1] over the last axis.
    x1 = g.op(
        "Slice",
        [x, g.constant([0]), g.constant([half]), g.constant([-1])],
        f"{prefix}/Slice_1",
    )
    x2 = g.op(
        "Slice",
        [x, g.constant([half]), g.constant([2 * half]), g.constant([-1])],
        f"{prefix}/Slice_2",
    )
    neg_x2 = g.op("Neg", [x2], f"{prefix}/Neg")
    return g.op("Concat", [neg_x2, x1], f"{prefix}/Concat", axis=-1)


def _apply_rope(g: _GraphBuilder, x: str, cos: str, sin: str, half: int, prefix: str) -> str:
    rotated = _rotate_half(g, x, half, f"{prefix}/rotate_half")
    x_cos = g.op("Mul", [x, cos], f"{prefix}/Mul_cos")
    rot_sin = g.op("Mul", [rotated, sin], f"{prefix}/Mul_sin")
    return g.op("Add", [x_cos, rot_sin], f"{prefix}/Add")


def _projection(g: _GraphBuilder, x: str, w: dict[str, str], name: str, heads: int, head_dim: int) -> str:
    """Biased linear projection split into heads: [B, S, H] -> [B, heads, S, d]."""
    y = g.op("MatMul", [x, w[f"{name}.weight"]], f"/{name}/MatMul")
    y = g.op("Add", [y, w[f"{name}.bias"]], f"/{name}/Add")
    y = g.op("Reshape", [y, g.constant([0, 0, heads, head_dim])], f"/{name}/Reshape")
    return g.op("Transpose", [y], f"/{name}/Transpose", perm=[0, 2, 1, 3])


def _attention(
    g: _GraphBuilder,
    x: str,
    w: dict[str, str],
    layer: int,
    size: DemoSize,
    rope: tuple[str, str],
    mask_bias: str,
) -> str:
    """Self-attention with RoPE, KV cache and grouped-query heads; [B, S, H] -> same."""
    p = f"model.layers.{layer}.self_attn"
    d, kv_heads = size.head_dim, size.num_kv_heads
    n_rep = size.num_heads // kv_heads
    cos, sin = rope
    q = _projection(g, x, w, f"{p}.q_proj", size.num_heads, d)
    k = _projection(g, x, w, f"{p}.k_proj", kv_heads, d)
    v = _projection(g, x, w, f"{p}.v_proj", kv_heads, d)
    q = _apply_rope(g, q, cos, sin, d // 2, f"/{p}/rope_q")
    k = _apply_rope(g, k, cos, sin, d // 2, f"/{p}/rope_k")

    # The cache holds post-RoPE keys, as in HF / Optimum exports.
    key = g.op(
        "Concat",
        [f"past_key_values.{layer}.key", k],
        f"/{p}/Concat_key",
        output=f"present.{layer}.key",
        axis=2,
    )
    value = g.op(
        "Concat",
        [f"past_key_values.{layer}.value", v],
        f"/{p}/Concat_value",
        output=f"present.{layer}.value",
        axis=2,
    )

    # Grouped-query attention: query head h uses KV head h // n_rep (HF's
    # repeat_kv).  Rather than materialising repeated K/V, view the queries as
    # [B, kv_heads, n_rep, S, d] and let MatMul broadcast K/V ([B, kv, 1, T, d])
    # over the n_rep axis: same maths, no copies.
    groups = g.constant([0, kv_heads, n_rep, -1, d])
    qg = g.op("Reshape", [q, groups], f"/{p}/Reshape_q_groups")
    scale = g.constant(1.0 / math.sqrt(d), np.float32)
    qg = g.op("Mul", [qg, scale], f"/{p}/Mul_scale")
    kg = g.op("Unsqueeze", [key, g.constant([2])], f"/{p}/Unsqueeze_key")
    kg_t = g.op("Transpose", [kg], f"/{p}/Transpose_key", perm=[0, 1, 2, 4, 3])
    # scores, probs: [B, kv, n_rep, S, T]
    scores = g.op("MatMul", [qg, kg_t], f"/{p}/MatMul_scores")
    scores = g.op("Add", [scores, mask_bias], f"/{p}/Add_mask")
    probs = g.op("Softmax", [scores], f"/{p}/Softmax", axis=-1)
    vg = g.op("Unsqueeze", [value, g.constant([2])], f"/{p}/Unsqueeze_value")
    context = g.op("MatMul", [probs, vg], f"/{p}/MatMul_context")
    # [B, kv, n_rep, S, d] -> [B, heads, S, d] -> [B, S, heads * d]
    heads = g.constant([0, size.num_heads, -1, d])
    context = g.op("Reshape", [context, heads], f"/{p}/Reshape_heads")
    context = g.op("Transpose", [context], f"/{p}/Transpose_ctx", perm=[0, 2, 1, 3])
    merged = g.constant([0, 0, size.num_heads * d])
    context = g.op("Reshape", [context, merged], f"/{p}/Reshape_merge")
    o_proj = w[f"{p}.o_proj.weight"]
    return g.op("MatMul", [context, o_proj], f"/{p}/o_proj/MatMul")


def _mlp(g: _GraphBuilder, x: str, w: dict[str, str], layer: int) -> str:
    """SwiGLU: down(silu(gate(x)) * up(x))."""
    p = f"model.layers.{layer}.mlp"
    gate = g.op("MatMul", [x, w[f"{p}.gate_proj.weight"]], f"/{p}/gate_proj/MatMul")
    up = g.op("MatMul", [x, w[f"{p}.up_proj.weight"]], f"/{p}/up_proj/MatMul")
    sigmoid = g.op("Sigmoid", [gate], f"/{p}/act_fn/Sigmoid")
    silu = g.op("Mul", [gate, sigmoid], f"/{p}/act_fn/Mul")
    product = g.op("Mul", [silu, up], f"/{p}/Mul")
    down = w[f"{p}.down_proj.weight"]
    return g.op("MatMul", [product, down], f"/{p}/down_proj/MatMul")


def _init_weights(size: DemoSize, logit_bias: np.ndarray, seed: int) -> dict[str, np.ndarray]:
    """Random weights, in a fixed generation order so a seed always gives the same model.

    Scales are chosen by hand: projections ~ N(0, 1/fan_in) keep the residual
    stream near unit variance, the attention value/output path is boosted so
    that context (not just the current token) drives the next prediction, and
    a wide lm_head spreads the logits so greedy decoding keeps changing tokens.
    """
    rng = np.random.default_rng(seed)
    h, d, i = size.hidden_size, size.head_dim, size.intermediate_size
    q_dim, kv_dim = size.num_heads * d, size.num_kv_heads * d

    def normal(shape: tuple[int, ...], std: float) -> np.ndarray:
        return (rng.standard_normal(shape, dtype=np.float32) * np.float32(std)).astype(np.float32)

    weights: dict[str, np.ndarray] = {"model.embed_tokens.weight": normal((size.vocab_size, h), 1.0)}
    for layer in range(size.num_layers):
        p = f"model.layers.{layer}"
        weights[f"{p}.input_layernorm.weight"] = np.ones(h, dtype=np.float32)
        weights[f"{p}.self_attn.q_proj.weight"] = normal((h, q_dim), 2.0 / math.sqrt(h))
        weights[f"{p}.self_attn.q_proj.bias"] = normal((q_dim,), 0.1)
        weights[f"{p}.self_attn.k_proj.weight"] = normal((h, kv_dim), 2.0 / math.sqrt(h))
        weights[f"{p}.self_attn.k_proj.bias"] = normal((kv_dim,), 0.1)
        weights[f"{p}.self_attn.v_proj.weight"] = normal((h, kv_dim), 1.0 / math.sqrt(h))
        weights[f"{p}.self_attn.v_proj.bias"] = normal((kv_dim,), 0.1)
        weights[f"{p}.self_attn.o_proj.weight"] = normal((q_dim, h), 2.0 / math.sqrt(q_dim))
        weights[f"{p}.post_attention_layernorm.weight"] = np.ones(h, dtype=np.float32)
        weights[f"{p}.mlp.gate_proj.weight"] = normal((h, i), 1.0 / math.sqrt(h))
        weights[f"{p}.mlp.up_proj.weight"] = normal((h, i), 1.0 / math.sqrt(h))
        weights[f"{p}.mlp.down_proj.weight"] = normal((i, h), 1.0 / math.sqrt(i))
    weights["model.norm.weight"] = np.ones(h, dtype=np.float32)
    weights["lm_head.weight"] = normal((h, size.vocab_size), 2.0 / math.sqrt(h))
    weights["lm_head.bias"] = logit_bias.astype(np.float32)
    return weights


def _build_graph(size: DemoSize, weights: dict[str, np.ndarray]) -> onnx.ModelProto:
    g = _GraphBuilder()
    w = {name: g.weight(name, array) for name, array in weights.items()}
    d = size.head_dim
    total_len = "past_sequence_length + sequence_length"

    inputs = [
        helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["batch_size", "sequence_length"]),
        helper.make_tensor_value_info("attention_mask", TensorProto.INT64, ["batch_size", total_len]),
        helper.make_tensor_value_info("position_ids", TensorProto.INT64, ["batch_size", "sequence_length"]),
    ]
    outputs = [
        helper.make_tensor_value_info(
            "logits",
            TensorProto.FLOAT,
            ["batch_size", "sequence_length", size.vocab_size],
        )
    ]
    for layer in range(size.num_layers):
        for kind in ("key", "value"):
            inputs.append(
                helper.make_tensor_value_info(
                    f"past_key_values.{layer}.{kind}",
                    TensorProto.FLOAT,
                    ["batch_size", size.num_kv_heads, "past_sequence_length", d],
                )
            )
            outputs.append(
                helper.make_tensor_value_info(
                    f"present.{layer}.{kind}",
                    TensorProto.FLOAT,
                    ["batch_size", size.num_kv_heads, total_len, d],
                )
            )

    # --- Attention bias shared by all layers: [B, 1, 1, S, T] --------------
    # Query i sits at absolute index past_len + i of the attention_mask, so it
    # may see key j iff j <= past_len + i and attention_mask[b, j] == 1.  The
    # causal part uses cache indices, not position_ids, exactly like HF; left
    # padding therefore only needs the mask (and shifted position_ids).
    one = g.constant(1)
    seq_len = g.op(
        "Gather",
        [g.op("Shape", ["input_ids"], "/mask/Shape_ids"), one],
        "/mask/Gather_S",
        axis=0,
    )
    total = g.op(
        "Gather",
        [g.op("Shape", ["attention_mask"], "/mask/Shape_mask"), one],
        "/mask/Gather_T",
        axis=0,
    )
    past_len = g.op("Sub", [total, seq_len], "/mask/Sub_past")
    query_index = g.op("Range", [past_len, total, one], "/mask/Range_q")
    key_index = g.op("Range", [g.constant(0), total, one], "/mask/Range_k")
    key_row = g.op("Unsqueeze", [key_index, g.constant([0])], "/mask/Unsqueeze_k")
    query_col = g.op("Unsqueeze", [query_index, g.constant([1])], "/mask/Unsqueeze_q")
    causal = g.op("LessOrEqual", [key_row, query_col], "/mask/LessOrEqual")  # [S, T]
    not_padding = g.op("Cast", ["attention_mask"], "/mask/Cast", to=TensorProto.BOOL)
    pad_row = g.constant([1])
    not_padding = g.op("Unsqueeze", [not_padding, pad_row], "/mask/Unsqueeze_pad")
    allowed = g.op("And", [causal, not_padding], "/mask/And")  # [B, S, T]
    mask_bias = g.op(
        "Where",
        [allowed, g.constant(0.0, np.float32), g.constant(_MASK_VALUE, np.float32)],
        "/mask/Where",
    )
    bias_axes = g.constant([1, 2])
    mask_bias = g.op("Unsqueeze", [mask_bias, bias_axes], "/mask/Unsqueeze_bias")

    # --- Rotary tables from position_ids: [B, 1, S, head_dim] ----------------
    # Computed in-graph so every position up to max_position_embeddings works
    # without a stored cos/sin cache.
    exponents = np.arange(0, d, 2, dtype=np.float64) / d
    inv_freq_values = (1.0 / ROPE_THETA**exponents).astype(np.float32)
    positions = g.op("Cast", ["position_ids"], "/rope/Cast", to=TensorProto.FLOAT)
    positions = g.op("Unsqueeze", [positions, g.constant([2])], "/rope/Unsqueeze")
    inv_freq = g.weight("rope.inv_freq", inv_freq_values)
    freqs = g.op("Mul", [positions, inv_freq], "/rope/Mul")  # [B, S, d/2]
    emb = g.op("Concat", [freqs, freqs], "/rope/Concat", axis=-1)
    cos = g.op("Cos", [emb], "/rope/Cos")
    sin = g.op("Sin", [emb], "/rope/Sin")
    cos = g.op("Unsqueeze", [cos, g.constant([1])], "/rope/Unsqueeze_cos")
    sin = g.op("Unsqueeze", [sin, g.constant([1])], "/rope/Unsqueeze_sin")

    embed = w["model.embed_tokens.weight"]
    hidden = g.op("Gather", [embed, "input_ids"], "/model/embed_tokens/Gather", axis=0)
    for layer in range(size.num_layers):
        p = f"model.layers.{layer}"
        x = _rms_norm(g, hidden, w[f"{p}.input_layernorm.weight"], f"/{p}/input_norm")
        attn = _attention(g, x, w, layer, size, (cos, sin), mask_bias)
        hidden = g.op("Add", [hidden, attn], f"/{p}/Add_attn_residual")
        norm = w[f"{p}.post_attention_layernorm.weight"]
        x = _rms_norm(g, hidden, norm, f"/{p}/post_attention_norm")
        mlp = _mlp(g, x, w, layer)
        hidden = g.op("Add", [hidden, mlp], f"/{p}/Add_mlp_residual")

    hidden = _rms_norm(g, hidden, w["model.norm.weight"], "/model/norm")
    logits = g.op("MatMul", [hidden, w["lm_head.weight"]], "/lm_head/MatMul")
    g.op("Add", [logits, w["lm_head.bias"]], "/lm_head/Add", output="logits")

    graph = helper.make_graph(g.nodes, "demo_qwen2", inputs, outputs, initializer=g.initializers)
    model = helper.make_model(
        graph,
        opset_imports=[helper.make_opsetid("", OPSET)],
        producer_name="fixture_models.demo",
        producer_version="1",
    )
    model.ir_version = IR_VERSION
    onnx.checker.check_model(model, full_check=True)
    return model


# --------------------------------------------------------------------------- #
# HF metadata files
# --------------------------------------------------------------------------- #


def _config(size: DemoSize, ids: dict[str, int]) -> dict[str, Any]:
    return {
        "architectures": ["Qwen2ForCausalLM"],
        "attention_bias": True,
        "attention_dropout": 0.0,
        "bos_token_id": ids[BOS_TOKEN],
        "eos_token_id": ids[EOS_TOKEN],
        "head_dim": size.head_dim,
        "hidden_act": "silu",
        "hidden_size": size.hidden_size,
        "initializer_range": 0.02,
        "intermediate_size": size.intermediate_size,
        "max_position_embeddings": MAX_POSITION_EMBEDDINGS,
        "max_window_layers": size.num_layers,
        "model_type": "qwen2",
        "num_attention_heads": size.num_heads,
        "num_hidden_layers": size.num_layers,
        "num_key_value_heads": size.num_kv_heads,
        "pad_token_id": ids[PAD_TOKEN],
        "rms_norm_eps": RMS_NORM_EPS,
        "rope_scaling": None,
        "rope_theta": ROPE_THETA,
        "sliding_window": None,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
        "use_cache": True,
        "use_sliding_window": False,
        "vocab_size": size.vocab_size,
    }


def _generation_config(ids: dict[str, int]) -> dict[str, Any]:
    return {
        "bos_token_id": ids[BOS_TOKEN],
        "eos_token_id": [ids[IM_END_TOKEN], ids[ENDOFTEXT_TOKEN]],
        "pad_token_id": ids[PAD_TOKEN],
    }


def _token_entry(content: str) -> dict[str, Any]:
    return {
        "content": content,
        "lstrip": False,
        "normalized": False,
        "rstrip": False,
        "single_word": False,
    }


def _tokenizer_config(ids: dict[str, int]) -> dict[str, Any]:
    return {
        "add_bos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": {str(ids[t]): {**_token_entry(t), "special": True} for t in SPECIAL_TOKENS},
        "additional_special_tokens": [IM_START_TOKEN, IM_END_TOKEN],
        "bos_token": BOS_TOKEN,
        "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "eos_token": EOS_TOKEN,
        "errors": "replace",
        "model_max_length": MAX_POSITION_EMBEDDINGS,
        "pad_token": PAD_TOKEN,
        "split_special_tokens": False,
        "tokenizer_class": "Qwen2Tokenizer",
        "unk_token": None,
    }


def _special_tokens_map() -> dict[str, Any]:
    return {
        "additional_special_tokens": [IM_START_TOKEN, IM_END_TOKEN],
        "bos_token": _token_entry(BOS_TOKEN),
        "eos_token": _token_entry(EOS_TOKEN),
        "pad_token": _token_entry(PAD_TOKEN),
    }


def _write_text(path: Path, text: str) -> Path:
    # newline="\n" so Windows builds are byte-identical too.
    with open(path, "w", encoding="utf-8", newline="\n") as f:
        f.write(text)
    return path


def _write_json(path: Path, data: Any) -> Path:
    return _write_text(path, json.dumps(data, indent=2, sort_keys=True, ensure_ascii=False) + "\n")


# --------------------------------------------------------------------------- #
# Public entry point
# --------------------------------------------------------------------------- #


def build_demo_model(out_dir: Path, *, size: str = "demo", seed: int = 0) -> list[Path]:
    """Write a random Qwen2-style ONNX model and its HF tokenizer/config into ``out_dir``.

    Args:
        out_dir: target directory, created if missing.  Existing files with the
            same names are overwritten.
        size: a key of :data:`DEMO_SIZES`.
        seed: seed for the random weights; the tokenizer does not depend on it.

    Returns:
        The paths written: ``model.onnx``, ``model.onnx_data``, ``config.json``,
        ``generation_config.json``, ``tokenizer.json``, ``tokenizer_config.json``,
        ``chat_template.jinja`` and ``special_tokens_map.json``.

    Raises:
        ValueError: if ``size`` is not a known size.
    """
    if size not in DEMO_SIZES:
        raise ValueError(f"unknown demo model size {size!r}; choose one of {sorted(DEMO_SIZES)}")
    spec = DEMO_SIZES[size]
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)

    tokenizer = _train_tokenizer(spec.vocab_size)
    ids = {token: tokenizer.token_to_id(token) for token in SPECIAL_TOKENS}
    weights = _init_weights(spec, _logit_bias(tokenizer, spec.vocab_size), seed)
    model = _build_graph(spec, weights)

    model_path = out_dir / "model.onnx"
    data_path = out_dir / "model.onnx_data"
    # onnx appends external data to an existing file, so a rebuild must start clean.
    for stale in (model_path, data_path):
        if stale.exists():
            os.remove(stale)
    onnx.save_model(
        model,
        str(model_path),
        save_as_external_data=True,
        all_tensors_to_one_file=True,
        location=data_path.name,
        size_threshold=0,
    )

    written = [model_path, data_path]
    written.append(_write_json(out_dir / "config.json", _config(spec, ids)))
    written.append(_write_json(out_dir / "generation_config.json", _generation_config(ids)))
    # Keep the tokenizers library's own key order (vocab listed by id, like HF files).
    written.append(_write_text(out_dir / "tokenizer.json", tokenizer.to_str(pretty=True) + "\n"))
    written.append(_write_json(out_dir / "tokenizer_config.json", _tokenizer_config(ids)))
    written.append(_write_text(out_dir / "chat_template.jinja", CHAT_TEMPLATE))
    written.append(_write_json(out_dir / "special_tokens_map.json", _special_tokens_map()))
    return written
