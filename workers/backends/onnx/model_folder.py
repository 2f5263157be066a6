"""Reading a model folder: its JSON configs, tokenizer and chat template source.

Everything a folder is missing or has unreadable raises ``ModelLoadError``
naming the model and the file.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer

from workers.backends.errors import ModelLoadError
from workers.backends.onnx.error_text import one_line

MODEL_FILE = "model.onnx"


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


def context_length(config: Mapping[str, Any], folder: Path) -> int:
    for key in ("max_position_embeddings", "n_positions", "max_sequence_length"):
        value = config.get(key)
        if isinstance(value, int) and value > 0:
            return value
    raise ModelLoadError(f"config.json of model {folder.name!r} has no max_position_embeddings")
