"""The one small interface every inference runtime implements.

A runtime (one file each, next to this one) turns a model folder into a
:class:`LoadedModel`. A loaded model renders a response request into prompt
token ids and runs a :class:`Generation`: an iterator of :class:`Step` that
asks ``should_stop`` before every decode step, can describe its exact state
as a JSON-able snapshot after any step, and can be rebuilt from such a
snapshot to continue token for token.

The worker (``workers.execution``) knows nothing about tensors; a runtime
knows nothing about tasks, events or the database.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

# Why a generation ended.
FINISH_EOS = "eos"
"""The model produced one of its end-of-sequence ids."""
FINISH_STOP = "stop"
"""A stop string from the request appeared; it is not part of the text."""
FINISH_LENGTH = "max_output_tokens"
"""The token limit (the request's, or what the context window leaves) was reached."""
FINISH_CANCELLED = "cancelled"
"""``should_stop`` returned True before a decode step."""

StopCheck = Callable[[], bool]


@dataclass(frozen=True)
class SamplingParams:
    """What a request asks of the sampler; ``None`` means the model's default."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    seed: int | None = None
    max_output_tokens: int | None = None
    stop: tuple[str, ...] = ()

    @classmethod
    def from_request(cls, request: Mapping[str, Any]) -> SamplingParams:
        stop = request.get("stop")
        if stop is None:
            stops: tuple[str, ...] = ()
        elif isinstance(stop, str):
            stops = (stop,)
        else:
            stops = tuple(stop)
        return cls(
            temperature=request.get("temperature"),
            top_p=request.get("top_p"),
            top_k=request.get("top_k"),
            min_p=request.get("min_p"),
            repetition_penalty=request.get("repetition_penalty"),
            seed=request.get("seed"),
            max_output_tokens=request.get("max_output_tokens"),
            stop=tuple(s for s in stops if s),
        )


@dataclass(frozen=True)
class Step:
    """One decode step: the sampled token and the text it makes final.

    ``text`` is empty while a token ends inside a UTF-8 character or inside a
    possible stop string; the text is released by a later step. The last step
    of a generation may have ``token_id`` None: it only flushes held text.
    """

    token_id: int | None
    text: str


class Generation(Protocol):
    """A running generation: iterate it for steps, then read how it ended."""

    seed: int
    """The seed the sampler uses (the request's, or a recorded random one)."""
    prompt_tokens: int
    output_tokens: int
    """Tokens sampled so far (an end-of-sequence token counts)."""
    finish_reason: str | None
    """One of the ``FINISH_*`` values once iteration ended, else None."""

    def __iter__(self) -> Iterator[Step]: ...

    def text(self) -> str:
        """All text released so far (the concatenation of every ``Step.text``)."""
        ...

    def snapshot(self) -> dict[str, Any]:
        """A JSON-able state after the last step yielded: prompt ids, generated
        ids, sampler RNG state, detokeniser offsets, released text length."""
        ...

    def snapshot_since(self, tokens: int, *, with_prompt: bool) -> tuple[list[int], dict[str, Any]]:
        """The snapshot in parts that do not grow with the output, for a store
        that appends: the ids generated after the first ``tokens``, and the rest
        without the released text (rebuilt from the deltas) and, unless
        ``with_prompt``, without the prompt ids. Re-joined, the parts of every
        call so far give :meth:`snapshot` minus ``text``."""
        ...


class LoadedModel(Protocol):
    """A model ready to generate; cached per worker process."""

    provider: str
    """The execution provider the session really got, e.g. ``CPUExecutionProvider``."""
    resumable: bool
    context_length: int

    def prompt_ids(self, request: Mapping[str, Any]) -> list[int]:
        """Render the request (instructions + input) with the chat template and tokenise it."""
        ...

    def generate(self, prompt_ids: Sequence[int], params: SamplingParams, *, should_stop: StopCheck) -> Generation: ...

    def resume(self, snapshot: Mapping[str, Any], params: SamplingParams, *, should_stop: StopCheck) -> Generation:
        """Continue from :meth:`Generation.snapshot`: re-prefill, then go on exactly
        as the interrupted generation would have."""
        ...

    def close(self) -> None: ...


class Backend(Protocol):
    name: str

    def load(
        self,
        folder: Path,
        *,
        graph: str = "model.onnx",
        device: str = "auto",
        device_id: int = 0,
        prefill_chunk: int | None = None,
        intra_op_threads: int | None = None,
        spinning: bool | None = None,
    ) -> LoadedModel:
        """Load a model folder: ``graph`` is the decoder graph's path inside it, the side
        files (configs, tokenizer) lie in ``folder`` itself. Raises
        ``workers.backends.errors.ModelLoadError``."""
        ...


def request_messages(request: Mapping[str, Any]) -> list[dict[str, str]]:
    """The request's instructions and input as chat messages of plain text.

    ``developer`` becomes ``system`` (chat templates know only the latter);
    a content list is joined from its ``input_text``/``output_text`` parts.
    """
    messages: list[dict[str, str]] = []
    instructions = request.get("instructions")
    if instructions:
        messages.append({"role": "system", "content": instructions})
    given = request.get("input")
    if isinstance(given, str):
        messages.append({"role": "user", "content": given})
        return messages
    for item in given or []:
        content = item.get("content")
        if isinstance(content, list):
            content = "".join(part.get("text", "") for part in content)
        role = item.get("role", "user")
        messages.append({"role": "system" if role == "developer" else role, "content": content or ""})
    return messages
