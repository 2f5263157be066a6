"""Ollama's error shape: ``{"error": "<message>"}`` with the HTTP status (its server answers so)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from tasks_app.exceptions import LmspError

MODEL_NOT_FOUND = "model_not_found"


class OllamaModelNotFound(LmspError):
    """A request names a model that is not registered: Ollama's 404, which its clients read to offer a pull."""

    status, code, title = 404, MODEL_NOT_FOUND, "Model not found"


def ollama_error(problem: Mapping[str, Any]) -> tuple[int, dict[str, Any]]:
    """A problem object as Ollama's clients read an error: its status, and its text under ``error``."""
    detail = problem.get("detail") or problem.get("title") or "error"
    status = int(problem.get("status") or 500)
    if status == 404 and problem.get("code") == MODEL_NOT_FOUND:
        # Ollama's own words, which clients match ("model 'x' not found").
        return status, {"error": detail}
    return status, {"error": f"{problem.get('code')}: {detail}"}
