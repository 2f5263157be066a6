"""Ollama's error shape: ``{"error": "<message>"}`` with the HTTP status (its server answers so)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def ollama_error(problem: Mapping[str, Any]) -> tuple[int, dict[str, Any]]:
    """A problem object as Ollama's clients read an error: its status, and its text under ``error``."""
    detail = problem.get("detail") or problem.get("title") or "error"
    return int(problem.get("status") or 500), {"error": f"{problem.get('code')}: {detail}"}
