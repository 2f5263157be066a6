"""A model's chat template, compiled and rendered the way transformers does it.

A template that does not compile raises ``ModelLoadError`` at load time; one
that calls ``raise_exception(...)`` on a request's input raises
``PromptRejected``, any other failure while rendering ``GenerationError``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

from jinja2 import TemplateError
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

from workers.backends.errors import GenerationError, ModelLoadError, PromptRejected
from workers.backends.onnx.error_text import one_line
from workers.backends.onnx.model_folder import token_text

_SPECIAL_TOKENS = ("bos_token", "eos_token", "pad_token", "unk_token", "sep_token", "cls_token", "mask_token")


class _TemplateRaised(Exception):
    """``raise_exception(...)`` called by a chat template: the input breaks the template's rules."""


def _raise_exception(message: str) -> None:
    raise _TemplateRaised(message)


def _tojson(
    value: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None, sort_keys: bool = False
) -> str:
    # transformers' tojson: jinja2's built-in one HTML-escapes <, >, & and '.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _compile_template(source: str, folder: Path) -> Any:
    """Compile like transformers does, so templates render the same text they do there."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(source)
    except TemplateError as exc:
        raise ModelLoadError(f"the chat template of model {folder.name!r} does not compile: {one_line(exc)}") from None


def _template_tokens(tokenizer_config: Mapping[str, Any]) -> dict[str, Any]:
    """The special-token variables transformers hands a chat template."""
    tokens: dict[str, Any] = {}
    for key in _SPECIAL_TOKENS:
        text = token_text(tokenizer_config.get(key))
        if text is not None:
            tokens[key] = text
    extra = tokenizer_config.get("additional_special_tokens")
    if isinstance(extra, list):
        tokens["additional_special_tokens"] = [t for t in map(token_text, extra) if t is not None]
    return tokens


def tool_calls_as_text(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Messages for a template that knows no ``tool_calls``: each call written into its message's text.

    One ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` per call
    (the Hermes form, which most tool-trained models read), so a conversation
    with calls keeps them in the prompt instead of losing them silently.
    """
    flat = []
    for message in messages:
        calls = message.get("tool_calls")
        if not calls:
            flat.append(dict(message))
            continue
        written = [
            "<tool_call>"
            + _tojson({"name": c["function"]["name"], "arguments": c["function"]["arguments"]})
            + "</tool_call>"
            for c in calls
        ]
        text = "\n".join(part for part in (message.get("content") or "", *written) if part)
        flat.append({key: value for key, value in message.items() if key != "tool_calls"} | {"content": text})
    return flat


class ChatTemplate:
    """A compiled chat template and the special-token variables it is rendered with."""

    def __init__(self, source: str, folder: Path, tokenizer_config: Mapping[str, Any]) -> None:
        self.model_name = folder.name
        self._template = _compile_template(source, folder)
        self._special_tokens = _template_tokens(tokenizer_config)
        self.source = source
        # A template that never reads tool_calls would drop them from the prompt without a word.
        self.reads_tool_calls = "tool_calls" in source

    def render(self, messages: Sequence[Mapping[str, Any]], *, tools: Sequence[Mapping[str, Any]] | None = None) -> str:
        """The messages as prompt text, ending with the assistant's turn (add_generation_prompt); ``tools``
        in Hugging Face's shape, for a template that reads them."""
        if not self.reads_tool_calls:
            messages = tool_calls_as_text(messages)
        try:
            return self._template.render(
                messages=messages,
                tools=list(tools) if tools else None,
                documents=None,
                add_generation_prompt=True,
                **self._special_tokens,
            )
        except _TemplateRaised as exc:
            raise PromptRejected(f"the chat template of model {self.model_name!r} rejects this input: {exc}") from None
        except TemplateError as exc:
            raise GenerationError(f"the chat template of model {self.model_name!r} failed: {one_line(exc)}") from None
