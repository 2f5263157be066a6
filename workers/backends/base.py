"""The one small interface every inference runtime implements.

A runtime (one file each, next to this one) turns a model folder into a
:class:`LoadedModel`. A loaded model renders a :class:`Prompt` into prompt
token ids and runs a :class:`Generation`: an iterator of :class:`Step` that
asks ``should_stop`` before every decode step, can describe its exact state
as a JSON-able snapshot after any step, and can be rebuilt from such a
snapshot to continue token for token.

The worker (``workers.execution``) knows nothing about tensors; a runtime
knows nothing about tasks, events or the database.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

# Why a generation ended.
FINISH_EOS = "eos"
"""The model produced one of its end-of-sequence ids."""
FINISH_STOP = "stop"
"""A stop string from the request appeared; it is not part of the text."""
FINISH_LENGTH = "length"
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
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    seed: int | None = None
    max_output_tokens: int | None = None
    stop: tuple[str, ...] = ()
    grammar: str | None = None
    """An llguidance grammar the output must follow (``workers.backends.constraints``); None: free text.
    The service builds it from the generation spec (``tasks_app.generation``), never this class."""
    kept_tokens: tuple[str, ...] = ()
    """Special tokens whose text the output keeps (a family's tool-call markers, for its parser);
    every other special token is left out of the text, as always."""


@dataclass(frozen=True)
class Step:
    """One decode step: the sampled token and the text it makes final.

    ``text`` is empty while a token ends inside a UTF-8 character or inside a
    possible stop string; the text is released by a later step. The last step
    of a generation may have ``token_id`` None: it only flushes held text.
    """

    token_id: int | None
    text: str


@dataclass(frozen=True)
class Chunk:
    """What a row produced since its last chunk, handed from the model thread to the task thread.

    ``state`` is the generation's :meth:`Generation.snapshot_state` right
    after the last of ``steps``; with ``output_tokens`` (the ids generated so
    far, append-only) it is the snapshot the task commits with these steps.
    """

    steps: tuple[Step, ...] = ()
    tokens: int = 0
    """Steps that sampled a token."""
    output_tokens: int = 0
    state: Mapping[str, Any] | None = None
    final: bool = False
    """The row left the engine: ended (see the generation's ``finish_reason``), failed or interrupted."""
    interrupted: bool = False
    """The row stopped where it was without ending (the worker is shutting down, or its engine process was
    lost): its task is to be handed back."""
    reason: str = ""
    """Why an interrupted row stopped, for its task's record ("" : the worker was shut down)."""
    error: Exception | None = None
    first_at: float = 0.0
    """When the first of ``steps`` with a token was made (``time.monotonic``); 0 without one."""
    last_at: float = 0.0
    """When the last of them was made."""

    @classmethod
    def failed(cls, error: Exception) -> Chunk:
        return cls(final=True, error=error)

    @classmethod
    def ending(cls, *, output_tokens: int, interrupted: bool, reason: str = "") -> Chunk:
        return cls(output_tokens=output_tokens, final=True, interrupted=interrupted, reason=reason)

    def then(self, later: Chunk) -> Chunk:
        """This chunk and the one after it, as one."""
        return Chunk(
            steps=self.steps + later.steps,
            tokens=self.tokens + later.tokens,
            output_tokens=max(self.output_tokens, later.output_tokens),
            state=later.state if later.state is not None else self.state,
            final=later.final,
            interrupted=later.interrupted,
            reason=later.reason or self.reason,
            error=self.error or later.error,
            first_at=self.first_at or later.first_at,
            last_at=later.last_at or self.last_at,
        )


class RowStream(Protocol):
    """A generation running in an engine: iterate for its :class:`Chunk` s (an error chunk raises)."""

    def __iter__(self) -> Iterator[Chunk]: ...

    def ready(self, timeout: float) -> bool:
        """Whether a chunk has come, waiting at most ``timeout`` seconds for the first."""
        ...

    def stop(self) -> None:
        """End the row before its next model call; its last chunk still comes."""
        ...

    def notify(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` whenever a chunk comes (at once if one waits); it must return at once."""
        ...

    def take(self) -> Chunk | None:
        """The chunks that came since the last read, merged into one, or None; never waits."""
        ...


class Engine(Protocol):
    """Runs many generations of one loaded model together (one per worker process and model)."""

    def submit(self, generation: Generation) -> RowStream: ...

    @property
    def waiting(self) -> int:
        """Rows submitted but held back (the batch is full, or the KV budget spent)."""
        ...

    def drain(self, *, grace_seconds: float) -> None:
        """Take no new rows; rows still running after ``grace_seconds`` end interrupted."""
        ...


class EngineObserver:
    """What an engine reports as it runs; every method is cheap, in memory, and never raises.

    This one ignores everything (an engine without metrics); ``workers.run_metrics.EngineMetrics``
    has the same methods and reports them.
    """

    def step(self, *, rows: int, seconds: float) -> None:
        """One decode step of ``rows`` rows took ``seconds`` (session run and sampling)."""

    def prefill(self, *, tokens: int, seconds: float) -> None:
        """One prefill call of a joining row."""

    def masks(self, *, rows: int, seconds: float) -> None:
        """The masks of a step's ``rows`` constrained rows took ``seconds`` (beside the session call)."""

    def queue_wait(self, seconds: float) -> None:
        """A row waited this long from its submission to its admission."""

    def kv(self, *, in_use: int, budget: int) -> None:
        """KV cache bytes the admitted rows can reach, and the budget."""

    def prefix_hit(self, *, tokens: int) -> None:
        """A joining row looked its first feed up in the prefix cache: ``tokens`` of it were cached (0: a miss)."""

    def prefix_cache(self, *, cached_bytes: int, evicted: Sequence[int]) -> None:
        """The prefix cache holds ``cached_bytes`` now; ``evicted``: the sizes of the entries it just evicted."""

    def rows(self, *, running: int, waiting: int) -> None:
        """Rows admitted now, and rows waiting for room."""

    def close(self) -> None:
        """The engine stopped."""


class Generation(Protocol):
    """A running generation: iterate it for steps, then read how it ended."""

    seed: int
    """The seed the sampler uses (the request's, or a recorded random one)."""
    prompt_ids: list[int]
    generated_ids: list[int]
    """Sampled so far; only ever appended to (a reader on another thread slices it safely)."""
    prompt_tokens: int
    cached_tokens: int
    """Prompt tokens whose cache came from the prefix cache instead of a model call (0: none)."""
    output_tokens: int
    """Tokens sampled so far (an end-of-sequence token counts)."""
    finish_reason: str | None
    """One of the ``FINISH_*`` values once iteration ended, else None."""
    stop_sequence: str | None
    """The stop string that ended the output (``finish_reason`` stop); None otherwise."""

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


@dataclass(frozen=True)
class ToolPrompt:
    """How a request's tools reach the prompt (the service decides it from the model's family)."""

    tools: tuple[Mapping[str, Any], ...] = ()
    """Hugging Face's shape (``{"type": "function", "function": {...}}``), for the template's ``tools``."""
    in_system: bool = False
    """Give them as JSON text in the system message's ``tools`` (Phi-4-mini's template reads them there)."""
    instruction: str | None = None
    """A system text that offers them instead, for a template that knows no tools."""


class TemplateSource(Protocol):
    """What reads a model's tool-call family: its chat template's text (None without a template)."""

    chat_template_source: str | None


class LoadedModel(Protocol):
    """A model ready to generate; cached per worker process."""

    provider: str
    """The execution provider the session really got, e.g. ``CPUExecutionProvider``."""
    resumable: bool
    context_length: int
    chat_template_source: str | None
    """The chat template's text (a tool-call family is read off it); None without a template."""

    def prompt_ids(self, prompt: Prompt, *, tools: ToolPrompt | None = None) -> list[int]:
        """Render the prompt (and ``tools``) with the chat template and tokenise it."""
        ...

    def single_token_ids(self, texts: Sequence[str]) -> dict[str, int]:
        """Those of ``texts`` that are one token of this model's tokenizer, with its id."""
        ...

    def generate(self, prompt_ids: Sequence[int], params: SamplingParams, *, should_stop: StopCheck) -> Generation: ...

    def resume(self, snapshot: Mapping[str, Any], params: SamplingParams, *, should_stop: StopCheck) -> Generation:
        """Continue from :meth:`Generation.snapshot`: re-prefill, then go on exactly
        as the interrupted generation would have."""
        ...

    def engine(
        self,
        *,
        max_batch: int,
        kv_budget_bytes: int,
        kv_share: float = 0.5,
        delta_tokens: int,
        delta_seconds: float,
        observer: Callable[[], EngineObserver] | None = None,
        sampling_threads: int = 1,
        prefill_share: float = 3.0,
        device_picks: bool | None = None,
        prefix_cache: bool = True,
    ) -> Engine:
        """This model's engine (created on first use with these settings; one per process).

        ``kv_budget_bytes`` 0 means ``kv_share`` of the device's free memory (of the host's, on CPU);
        ``observer`` makes the engine's observer, once; ``sampling_threads`` sample a step's rows;
        ``prefill_share`` sizes a prefill slice beside decoding rows, as a share of a decode step;
        ``device_picks`` picks plain greedy rows where the logits lie (None: on CUDA only);
        ``prefix_cache`` keeps prompts' KV for later rows that start alike (within the KV budget)."""
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
        gpu_mem_limit: int | None = None,
    ) -> LoadedModel:
        """Load a model folder: ``graph`` is the decoder graph's path inside it, the side
        files (configs, tokenizer) lie in ``folder`` itself. Raises
        ``workers.backends.errors.ModelLoadError``."""
        ...


@dataclass(frozen=True)
class PromptTurn:
    """One turn of a conversation: a text turn (``role``, ``text``), an assistant's tool call
    (``call_id``, ``name``, ``arguments`` as JSON text) or a tool's answer (role ``tool``, ``call_id``)."""

    role: str
    text: str = ""
    call_id: str | None = None
    name: str | None = None
    arguments: str | None = None


@dataclass(frozen=True)
class Prompt:
    """What the model is asked: a system text, then the conversation's turns."""

    turns: tuple[PromptTurn, ...] = ()
    system: str | None = None
    droppable: int = 0
    """How many turns from the start a prompt over the context may lose to fit (never ``system``)."""

    @classmethod
    def of_text(cls, text: str, *, system: str | None = None) -> Prompt:
        return cls((PromptTurn("user", text),), system=system)


def prompt_messages(prompt: Prompt, *, dropped: int = 0) -> list[dict[str, Any]]:
    """The prompt as chat messages, as Hugging Face chat templates take them.

    ``system`` comes first, then the turns; a tool call becomes an assistant
    message's ``tool_calls`` (``arguments`` as a dict), a tool's answer a
    ``tool`` message named by its call. ``dropped``: leave out that many turns
    from the start of the conversation (a prompt over the context); never
    ``system``.
    """
    messages: list[dict[str, Any]] = []
    if prompt.system:
        messages.append({"role": "system", "content": prompt.system})
    names: dict[str, str] = {}
    for turn in prompt.turns[dropped:]:
        if turn.name is not None and turn.call_id is not None and turn.role == "assistant":
            names[turn.call_id] = turn.name
            _append_tool_call(messages, turn)
        elif turn.role == "tool":
            call_id = turn.call_id or ""
            messages.append(
                {"role": "tool", "tool_call_id": call_id, "name": names.get(call_id, ""), "content": turn.text}
            )
        else:
            messages.append({"role": turn.role, "content": turn.text})
    return messages


def _append_tool_call(messages: list[dict[str, Any]], turn: PromptTurn) -> None:
    """Calls that follow an assistant message (or each other) belong to it, as the model emitted them."""
    try:
        arguments = json.loads(turn.arguments) if turn.arguments else {}
    except ValueError:
        # Not JSON (a model's broken call, echoed back): the template gets the text as it was.
        arguments = turn.arguments
    call = {"id": turn.call_id, "type": "function", "function": {"name": turn.name, "arguments": arguments}}
    last = messages[-1] if messages else None
    if last is not None and last["role"] == "assistant":
        last.setdefault("tool_calls", []).append(call)
    else:
        messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
