"""Reading a model folder: its JSON configs, tokenizer, chat template source and decoder graph.

The side files (``config.json``, ``generation_config.json``,
``genai_config.json``, the tokenizer files, the chat template) live in the
folder; the decoder graph is a path relative to it (``model.onnx``,
``onnx/model_q4.onnx``, ``decoder_model_merged.onnx``, a genai builder's
file name). A folder the onnxruntime-genai builder wrote may have only
``genai_config.json``: its ``model`` section stands in for ``config.json``
and its ``search`` section for ``generation_config.json``.

Everything a folder is missing or has unreadable raises ``ModelLoadError``
naming the model and the file.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tokenizers import Tokenizer

from workers.backends.errors import ModelLoadError
from workers.backends.onnx.error_text import one_line

if TYPE_CHECKING:
    from workers.backends.onnx.graph import GraphNames, ShapeHints

MODEL_FILE = "model.onnx"
GENAI_CONFIG = "genai_config.json"
# Optimum's legacy unmerged pair: the first graph has no cache inputs, the
# second needs a cache the first made; this loop drives one graph.
_LEGACY_UNMERGED = ("decoder_model.onnx", "decoder_with_past_model.onnx")
# genai_config.json's search keys that mean the same in generation_config.json.
_GENAI_SEARCH_KEYS = ("do_sample", "temperature", "top_k", "top_p", "repetition_penalty", "min_p")
_GENAI_TOKEN_KEYS = ("bos_token_id", "eos_token_id", "pad_token_id")


def read_json(path: Path, *, required: bool) -> dict[str, Any]:
    # exists(), not is_file(): a named pipe or a file on a special mount is read like any file.
    if not path.exists() or path.is_dir():
        if required:
            raise ModelLoadError(f"model folder {path.parent.name!r} has no {path.name}")
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise ModelLoadError(
            f"{path.name} of model {path.parent.name!r} is not readable JSON: {one_line(exc)}"
        ) from None
    if not isinstance(data, dict):
        raise ModelLoadError(f"{path.name} of model {path.parent.name!r} is not a JSON object")
    return data


def load_tokenizer(folder: Path) -> Tokenizer:
    path = folder / "tokenizer.json"
    if not path.is_file():
        raise ModelLoadError(f"model folder {folder.name!r} has no tokenizer.json")
    try:
        return Tokenizer.from_file(str(path))
    except Exception as exc:  # tokenizers raises plain Exception subclasses from Rust
        raise ModelLoadError(f"tokenizer.json of model {folder.name!r} is not usable: {one_line(exc)}") from None


def token_text(value: Any) -> str | None:
    """A special token from tokenizer_config.json: a string or a serialised AddedToken."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def read_template(folder: Path, tokenizer_config: Mapping[str, Any]) -> str | None:
    """The chat template source: ``chat_template.jinja`` first (newer exports), then the config."""
    path = folder / "chat_template.jinja"
    if path.is_file():
        try:
            return path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise ModelLoadError(
                f"chat_template.jinja of model {folder.name!r} is not readable: {one_line(exc)}"
            ) from None
    template = tokenizer_config.get("chat_template")
    if isinstance(template, list):
        # Several named templates: the one called "default" is the chat template.
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    return template if isinstance(template, str) and template else None


def eos_ids(
    generation_config: Mapping[str, Any],
    config: Mapping[str, Any],
    tokenizer_config: Mapping[str, Any],
    tokenizer: Tokenizer,
) -> frozenset[int]:
    """End-of-sequence ids: generation_config.json, else config.json, else the tokenizer's eos_token."""
    for source in (generation_config, config):
        value = source.get("eos_token_id")
        if isinstance(value, int):
            return frozenset({value})
        if isinstance(value, list) and value and all(isinstance(v, int) for v in value):
            return frozenset(value)
    text = token_text(tokenizer_config.get("eos_token"))
    token_id = tokenizer.token_to_id(text) if text else None
    return frozenset() if token_id is None else frozenset({token_id})


def graph_file(folder: Path, graph: str) -> Path:
    """The decoder graph's path; refused when it is missing, outside the folder or half of a legacy pair."""
    relative = Path(graph)
    if relative.is_absolute() or ".." in relative.parts or not relative.parts:
        raise ModelLoadError(f"graph {graph!r} of model {folder.name!r} is not a path inside the model folder")
    if relative.name in _LEGACY_UNMERGED:
        raise ModelLoadError(
            f"{graph} of model {folder.name!r} is half of Optimum's legacy unmerged export "
            "(decoder_model.onnx without a cache + decoder_with_past_model.onnx with one), which this backend "
            "does not drive; use the folder's decoder_model_merged.onnx if it has one, or re-export with "
            "`optimum-cli export onnx --task text-generation-with-past` (one model.onnx)"
        )
    path = folder / relative
    # exists(), not is_file(): see read_json.
    if not path.exists() or path.is_dir():
        raise ModelLoadError(f"model folder {folder.name!r} has no {relative.as_posix()}")
    return path


def _section(data: Mapping[str, Any], *keys: str) -> Mapping[str, Any]:
    """A nested JSON object, or {} where any level is missing or not an object."""
    for key in keys:
        value = data.get(key)
        data = value if isinstance(value, Mapping) else {}
    return data


def _positive_int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def genai_generation_config(genai: Mapping[str, Any]) -> dict[str, Any]:
    """genai_config.json's search defaults and token ids under generation_config.json's keys."""
    search, model = _section(genai, "search"), _section(genai, "model")
    config = {key: search[key] for key in _GENAI_SEARCH_KEYS if key in search}
    config.update({key: model[key] for key in _GENAI_TOKEN_KEYS if model.get(key) is not None})
    return config


def genai_graph_names(genai: Mapping[str, Any], graph: str) -> GraphNames:
    # Imported here: the graph module loads ONNX Runtime, which reading a folder's prompt side never needs.
    from workers.backends.onnx.graph import GraphNames

    """The decoder's IO names genai_config.json gives, when it describes ``graph``; else Optimum's."""
    decoder = _section(genai, "model", "decoder")
    filename = decoder.get("filename")
    if not isinstance(filename, str) or Path(filename).as_posix() != Path(graph).as_posix():
        return GraphNames()
    inputs, outputs = _section(decoder, "inputs"), _section(decoder, "outputs")
    default = GraphNames()

    def name(section: Mapping[str, Any], key: str, fallback: str) -> str:
        value = section.get(key)
        return value if isinstance(value, str) and value else fallback

    return GraphNames(
        input_ids=name(inputs, "input_ids", default.input_ids),
        attention_mask=name(inputs, "attention_mask", default.attention_mask),
        position_ids=name(inputs, "position_ids", default.position_ids),
        logits=name(outputs, "logits", default.logits),
        past_key=name(inputs, "past_key_names", default.past_key),
        past_value=name(inputs, "past_value_names", default.past_value),
        present_key=name(outputs, "present_key_names", default.present_key),
        present_value=name(outputs, "present_value_names", default.present_value),
    )


def shape_hints(config: Mapping[str, Any], genai: Mapping[str, Any]) -> ShapeHints:
    """KV heads, head size, layers and vocabulary: config.json first, genai_config.json for the rest."""
    from workers.backends.onnx.graph import ShapeHints

    heads = _positive_int(config.get("num_attention_heads")) or _positive_int(config.get("n_head"))
    hidden = _positive_int(config.get("hidden_size")) or _positive_int(config.get("n_embd"))
    kv_heads = _positive_int(config.get("num_key_value_heads")) or heads
    head_dim = _positive_int(config.get("head_dim")) or (hidden // heads if hidden and heads else None)
    decoder = _section(genai, "model", "decoder")
    sources = [name for name, data in (("config.json", config), (GENAI_CONFIG, genai)) if data]
    return ShapeHints(
        kv_heads=kv_heads or _positive_int(decoder.get("num_key_value_heads")),
        head_dim=head_dim or _positive_int(decoder.get("head_size")),
        # Only genai's count: it is the one its own runtime builds the cache names from.
        layers=_positive_int(decoder.get("num_hidden_layers")),
        vocab_size=_positive_int(config.get("vocab_size")) or _positive_int(_section(genai, "model").get("vocab_size")),
        source=" and ".join(sources) or "config.json",
    )


def context_length(config: Mapping[str, Any], genai: Mapping[str, Any], folder: Path) -> int:
    for key in ("max_position_embeddings", "n_positions", "max_sequence_length"):
        value = _positive_int(config.get(key))
        if value:
            return value
    value = _positive_int(_section(genai, "model").get("context_length"))
    if value:
        return value
    if genai and not config:
        raise ModelLoadError(f"{GENAI_CONFIG} of model {folder.name!r} has no model.context_length")
    raise ModelLoadError(f"config.json of model {folder.name!r} has no max_position_embeddings")
