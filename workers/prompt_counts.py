"""A prompt's token count where no model is loaded (docs/decisions/0014).

The web process answers ``count_tokens`` and refuses a prompt over the
context before it queues anything; both need the count the worker will see.
So the count is the worker's own: the same spec-to-prompt mapping
(``generation_inputs``) and the same renderer (``PromptText``), over the
model folder's tokenizer and chat template only, no session. This is the
one module of ``workers`` a web process imports.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

from django.conf import settings

from tasks_app.generation.spec import GenerationSpec
from tasks_app.selectors.tasks import model_get_by_name
from workers.backends.errors import ModelLoadError
from workers.backends.onnx.prompt_text import PromptText
from workers.generation_inputs import prompt_of, tool_prompt_of

# Tokenizers of a few models stay loaded (a 150k vocabulary parses in ~0.2 s; its tables hold tens of MB).
CACHED_MODELS = 4


@dataclass(frozen=True)
class PromptCount:
    tokens: int
    context_length: int

    @property
    def fits(self) -> bool:
        """Whether the prompt leaves room for at least one token of output (what a run needs)."""
        return self.tokens < self.context_length


class PromptCountUnavailable(Exception):
    """The model's folder cannot be read here (a web host without the model files)."""


_lock = threading.Lock()
_texts: OrderedDict[tuple[str, int], PromptText] = OrderedDict()


def prompt_count(spec: GenerationSpec) -> PromptCount:
    """How many tokens the spec's prompt is for its model, as a worker would render it.

    ``ModelNotFound`` for an unknown model; ``PromptCountUnavailable`` when
    this host cannot read the model's tokenizer or template.
    """
    record = model_get_by_name(spec.model)
    text = _prompt_text(Path(settings.LMSP_MODELS_DIR) / record.path)
    ids = text.ids(prompt_of(spec), tools=tool_prompt_of(spec, text, record.name))
    return PromptCount(tokens=len(ids), context_length=text.context_length)


def _prompt_text(folder: Path) -> PromptText:
    try:
        # A re-pulled model has a new tokenizer file: its change time keys the cache.
        stamp = (folder / "tokenizer.json").stat().st_mtime_ns
    except OSError as exc:
        raise PromptCountUnavailable(f"the model folder {folder.name!r} is not readable here: {exc}") from None
    key = (str(folder), stamp)
    with _lock:
        if key in _texts:
            _texts.move_to_end(key)
            return _texts[key]
    try:
        text = PromptText.of_folder(folder)
    except ModelLoadError as exc:
        raise PromptCountUnavailable(str(exc)) from None
    with _lock:
        _texts[key] = text
        while len(_texts) > CACHED_MODELS:
            _texts.popitem(last=False)
    return text
