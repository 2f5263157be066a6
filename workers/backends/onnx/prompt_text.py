"""A model folder's prompt side: its tokenizer and chat template, without a session (``PromptText``).

The loaded model renders and tokenises its prompts through it, and so does
``workers.prompt_counts``, which counts a prompt's tokens where no model is
loaded (the web process's ``count_tokens`` and its context check): one
renderer, so a count is the count the model will see.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from workers.backends.base import Prompt, ToolPrompt, prompt_messages
from workers.backends.onnx.chat_template import ChatTemplate, tool_calls_as_text
from workers.backends.onnx.model_folder import (
    GENAI_CONFIG,
    context_length,
    load_tokenizer,
    read_json,
    read_template,
)


def _with_tools(
    messages: list[dict[str, Any]], tools: ToolPrompt
) -> tuple[list[dict[str, Any]], list[Mapping[str, Any]] | None]:
    """The messages and the template's ``tools`` as the family takes them (see ``ToolPrompt``)."""
    if tools.instruction is None and not tools.in_system:
        return messages, list(tools.tools)
    messages = [dict(m) for m in messages]
    if not messages or messages[0]["role"] != "system":
        messages.insert(0, {"role": "system", "content": ""})
    system = messages[0]
    if tools.instruction is not None:
        system["content"] = "\n\n".join(part for part in (system["content"], tools.instruction) if part)
        return messages, None
    system["tools"] = json.dumps([tool["function"] for tool in tools.tools], ensure_ascii=False)
    return messages, None


class PromptText:
    """The tokenizer, the chat template and the context length of one model folder."""

    def __init__(
        self,
        folder: Path,
        *,
        config: Mapping[str, Any],
        genai: Mapping[str, Any],
        tokenizer_config: Mapping[str, Any],
    ) -> None:
        """The configs as the caller read them: each file is read once (one may be a pipe, read only once)."""
        self.folder = folder
        self.tokenizer = load_tokenizer(folder)
        template = read_template(folder, tokenizer_config)
        self.template = ChatTemplate(template, folder, tokenizer_config) if template else None
        self.chat_template_source = template or None
        self.context_length = context_length(config, genai, folder)

    @classmethod
    def of_folder(cls, folder: Path) -> PromptText:
        """A folder's prompt side, its configs read here (where no model is loaded: ``workers.prompt_counts``)."""
        genai = read_json(folder / GENAI_CONFIG, required=False)
        config = read_json(folder / "config.json", required=not genai)
        tokenizer_config = read_json(folder / "tokenizer_config.json", required=False)
        return cls(folder, config=config, genai=genai, tokenizer_config=tokenizer_config)

    def render(self, prompt: Prompt, *, dropped: int = 0, tools: ToolPrompt | None = None) -> str:
        """The prompt as the text the model was trained on (its chat template, add_generation_prompt)."""
        messages = prompt_messages(prompt, dropped=dropped)
        shown = None
        if tools is not None and tools.tools:
            messages, shown = _with_tools(messages, tools)
        if self.template is None:
            flat = tool_calls_as_text(messages)
            return "".join(f"{m['role']}: {m['content']}\n" for m in flat) + "assistant:"
        return self.template.render(messages, tools=shown)

    def ids(self, prompt: Prompt, *, tools: ToolPrompt | None = None) -> list[int]:
        """Render the prompt with the chat template and tokenise it.

        The template writes the special tokens itself, so the tokenizer adds
        none (it still maps special-token text to its ids); without a template
        the tokenizer's own post-processor adds what the model expects. A
        prompt that leaves no room for output loses whole turns from the start
        of the conversation, up to its ``droppable`` ones, until it fits (then
        it fails as any prompt too long does).
        """
        ids = self._encode(prompt, 0, tools)
        dropped = 0
        while len(ids) >= self.context_length and dropped < prompt.droppable:
            dropped += 1
            ids = self._encode(prompt, dropped, tools)
        return ids

    def _encode(self, prompt: Prompt, dropped: int, tools: ToolPrompt | None = None) -> list[int]:
        text = self.render(prompt, dropped=dropped, tools=tools)
        return list(self.tokenizer.encode(text, add_special_tokens=self.template is None).ids)
