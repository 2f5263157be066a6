"""The registered models in Ollama's shapes: ``/api/tags``, ``/api/show``, ``/api/ps``.

Read from the models table (what ``lmsp_models scan`` and ``pull``
register) and, for ``show``, from the model's folder (its chat template and
generation defaults), which the web process reads as the scan does.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from django.conf import settings

from tasks_app import states
from tasks_app.models import ModelRecord, Task

# The Ollama release whose API these routes follow (docs/ollama.md): clients gate features on it.
OLLAMA_VERSION = "0.14.0"
# A generation config's sampling defaults, under Ollama's parameter names.
_PARAMETERS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "repetition_penalty": "repeat_penalty"}


def _iso(value: Any) -> str:
    return value.isoformat().replace("+00:00", "Z")


def _quantization(record: ModelRecord) -> str:
    """The variant a graph's file name says (``model_q4.onnx``: ``Q4``); "" for the plain ``model.onnx``."""
    stem = Path(record.graph).name.removesuffix(".onnx")
    return stem.partition("_")[2].upper() if "_" in stem else ""


def _details(record: ModelRecord) -> dict[str, Any]:
    family = record.config.get("model_type") or ""
    return {
        "parent_model": "",
        "format": "onnx",
        "family": family,
        "families": [family] if family else None,
        # Not recorded by the scan (it would mean reading every weight's shape); "" says unknown.
        "parameter_size": "",
        "quantization_level": _quantization(record),
    }


def _entry(record: ModelRecord) -> dict[str, Any]:
    return {
        "name": record.name,
        "model": record.name,
        "modified_at": _iso(record.updated_at),
        "size": record.size_bytes,
        "digest": record.digest.removeprefix("sha256:"),
        "details": _details(record),
    }


def tags() -> dict[str, Any]:
    """``GET /api/tags``: every registered model, by name."""
    return {"models": [_entry(record) for record in ModelRecord.objects.order_by("name")]}


def _folder(record: ModelRecord) -> Path:
    return Path(settings.LMSP_MODELS_DIR) / record.path


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def chat_template(record: ModelRecord) -> str:
    """The chat template the worker renders with: ``chat_template.jinja``, else the tokenizer config's
    (its ``default`` one when it names several); "" when this host cannot read it."""
    folder = _folder(record)
    try:
        return (folder / "chat_template.jinja").read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        pass
    template = _read_json(folder / "tokenizer_config.json").get("chat_template")
    if isinstance(template, list):
        template = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}.get("default")
    return template if isinstance(template, str) else ""


def context_length(record: ModelRecord) -> int | None:
    return record.config.get("max_position_embeddings")


def show(record: ModelRecord) -> dict[str, Any]:
    """``POST /api/show``: the model's details, its facts under Ollama's ``model_info`` keys, what it can do."""
    template = chat_template(record)
    arch = record.config.get("model_type") or "onnx"
    info: dict[str, Any] = {"general.architecture": arch, "general.file_type": record.layout}
    for key, ours in (("context_length", "max_position_embeddings"), ("block_count", "num_hidden_layers")):
        if record.config.get(ours) is not None:
            info[f"{arch}.{key}"] = record.config[ours]
    if record.config.get("vocab_size") is not None:
        info[f"{arch}.vocab_size"] = record.config["vocab_size"]
    defaults = _read_json(_folder(record) / "generation_config.json")
    parameters = "\n".join(
        f"{theirs} {defaults[ours]}"
        for ours, theirs in _PARAMETERS.items()
        if isinstance(defaults.get(ours), (int, float))
    )
    # Any model takes tools (a template that knows none gets them in a system instruction, docs/tools.md);
    # "tools" says its own template renders them, as Ollama's does.
    capabilities = ["completion", *(["tools"] if "tools" in template else [])]
    return {
        "license": "",
        "modelfile": "",
        "parameters": parameters,
        "template": template,
        "details": _details(record),
        "model_info": info,
        "capabilities": capabilities,
        "modified_at": _iso(record.updated_at),
    }


def running() -> dict[str, Any]:
    """``GET /api/ps``: the models a worker holds loaded to run a task now.

    A worker keeps a model loaded after its tasks end (``workers/model_cache.py``)
    but tells nobody (its presence in Redis carries only its free places), so a
    model loaded and idle is not listed: what is listed is known to be loaded.
    When it unloads is the worker's cache's choice: ``expires_at`` is null.
    """
    names = set(Task.objects.filter(status__in=states.HELD).values_list("response__model", flat=True).distinct())
    records = ModelRecord.objects.filter(name__in=names).order_by("name")
    return {
        "models": [
            {**_entry(record), "expires_at": None, "size_vram": 0, "context_length": context_length(record)}
            for record in records
        ]
    }
