"""The sampling values a response is generated with, as its object shows them (PROFILE.md 10.1).

The response object must say what is in force, never null: the request's
value, else the model's own default. The defaults live in the model's folder
(``generation_config.json``, or an onnxruntime-genai folder's
``genai_config.json`` ``search`` section), where the worker reads them
(``workers.backends.sampling.SamplingDefaults.resolve``); this module reads
the same files by the same rules, so the web side shows what the worker will
use before the worker has even started. ``tasks_app`` may not import the
worker's code, hence the few lines of the rule repeated here.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from django.conf import settings

from tasks_app.model_layouts import GENAI_CONFIG
from tasks_app.models import ModelRecord

GENERATION_CONFIG = "generation_config.json"
# What the worker samples with when neither the request nor the model says anything.
NEUTRAL = {"temperature": 1.0, "top_p": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0}
# A model's files change only when it is pulled again or its folder edited: re-read them now and then, not per
# response object (an event's copy, a list's page), so a changed default shows within this many seconds.
_TTL_SECONDS = 30.0
_cache: dict[tuple[str, str], tuple[float, dict[str, Any]]] = {}
_lock = threading.Lock()


def sampling_in_force(model: str, request: Mapping[str, Any]) -> dict[str, float]:
    """``temperature``, ``top_p``, ``presence_penalty`` and ``frequency_penalty`` as the generation uses them."""
    defaults = model_defaults(model)
    temperature = request.get("temperature")
    if temperature is None:
        # A config that turns sampling off means greedy decoding, as transformers reads it.
        temperature = 0.0 if defaults.get("do_sample") is False else defaults.get("temperature")
    shown = {
        "temperature": temperature,
        "top_p": request.get("top_p") if request.get("top_p") is not None else defaults.get("top_p"),
        # OpenAI's two penalties: a generation config has no such keys.
        "presence_penalty": request.get("presence_penalty"),
        "frequency_penalty": request.get("frequency_penalty"),
    }
    return {key: float(NEUTRAL[key] if value is None else value) for key, value in shown.items()}


def model_defaults(model: str) -> dict[str, Any]:
    """The sampling keys of ``model``'s generation config ({} for a model unknown or without one)."""
    now = time.monotonic()
    key = (str(settings.LMSP_MODELS_DIR), model)
    with _lock:
        cached = _cache.get(key)
    if cached is not None and cached[0] > now:
        return cached[1]
    defaults = _read_defaults(model)
    with _lock:
        _cache[key] = (now + _TTL_SECONDS, defaults)
    return defaults


def _read_defaults(model: str) -> dict[str, Any]:
    path = ModelRecord.objects.filter(name=model).values_list("path", flat=True).first()
    if path is None:
        return {}
    folder = Path(settings.LMSP_MODELS_DIR) / path
    config = _json_object(folder / GENERATION_CONFIG)
    if not config:
        # As the worker does: an onnxruntime-genai folder keeps the same keys in its config's `search`.
        search = (_json_object(folder / GENAI_CONFIG) or {}).get("search")
        config = search if isinstance(search, dict) else {}
    return {key: value for key, value in config.items() if _sampling_value(key, value)}


def _sampling_value(key: str, value: Any) -> bool:
    # As the worker reads them: a value of the wrong JSON type counts as unset (bool is no number in JSON).
    if key == "do_sample":
        return isinstance(value, bool)
    return key in ("temperature", "top_p") and isinstance(value, int | float) and not isinstance(value, bool)


def _json_object(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError):
        return None
    return data if isinstance(data, dict) else None
