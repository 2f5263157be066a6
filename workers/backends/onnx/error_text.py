"""How an error from ONNX Runtime, tokenizers or jinja2 is quoted in a runtime error's message."""

from __future__ import annotations


def one_line(exc: BaseException, limit: int = 300) -> str:
    """An exception's message fit for a problem detail: first line, bounded."""
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return text if len(text) <= limit else text[: limit - 3] + "..."
