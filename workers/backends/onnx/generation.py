"""The generation loop: sample, detokenise, apply stop strings; and its snapshot/resume.

A snapshot is JSON-able state taken between steps; resuming re-prefills the
prompt and the ids generated so far (replaying them step by step on a graph
whose results depend on how its input is split) and continues token for
token as the interrupted generation would have. Prompt, token and snapshot
errors raise ``GenerationError``.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any, Protocol

import numpy as np
from tokenizers import Tokenizer

from workers.backends.base import (
    FINISH_CANCELLED,
    FINISH_EOS,
    FINISH_LENGTH,
    FINISH_STOP,
    SamplingParams,
    Step,
    StopCheck,
)
from workers.backends.constraints import ConstraintTokenizer, OutputConstraint
from workers.backends.detokenizer import StopFilter, StreamDetokenizer
from workers.backends.errors import ContextTooLong, GenerationError
from workers.backends.onnx.error_text import one_line
from workers.backends.onnx.kv_decoder import KVDecoder
from workers.backends.onnx.runtime import ModelRuntime
from workers.backends.sampling.sampler import Sampler
from workers.backends.sampling.settings import SamplingDefaults

SNAPSHOT_VERSION = 1


class GeneratingModel(Protocol):
    """What a generation needs of its model (``OnnxModel`` is one), so this module needs no model class."""

    name: str
    context_length: int
    vocab_size: int
    tokenizer: Tokenizer
    defaults: SamplingDefaults
    eos_token_ids: frozenset[int]
    replays_steps: bool
    runtime: ModelRuntime

    @property
    def special_token_ids(self) -> frozenset[int]: ...

    def kept_token_ids(self, texts: Sequence[str]) -> frozenset[int]: ...

    def constraint_tokenizer(self) -> ConstraintTokenizer: ...

    def decoder(self) -> KVDecoder: ...


class OnnxGeneration:
    """A running generation (implements ``Generation``); iterate it once for its steps."""

    def __init__(
        self,
        model: GeneratingModel,
        prompt_ids: list[int],
        params: SamplingParams,
        should_stop: StopCheck,
        *,
        seed: int | None = None,
        generated_ids: list[int] | None = None,
        text: str = "",
        held_text: str = "",
        detokenizer_offsets: tuple[int, int] = (0, 0),
    ) -> None:
        model.runtime.require_session()
        if not prompt_ids:
            raise GenerationError("the prompt is empty")
        if len(prompt_ids) >= model.context_length:
            raise ContextTooLong(
                f"the prompt has {len(prompt_ids)} tokens; model {model.name!r} has a context window of "
                f"{model.context_length}, which leaves no room for output"
            )
        vocab = model.tokenizer.get_vocab_size(with_added_tokens=True)
        self.model = model
        self.prompt_ids = prompt_ids
        self.generated_ids = generated_ids or []
        if any(not 0 <= i < vocab for i in prompt_ids + self.generated_ids):
            raise GenerationError(f"token ids must lie in 0..{vocab - 1}")
        # The repetition penalty's context is the prompt plus what was generated before a
        # resume (the ids transformers would hold in input_ids at this point); the frequency
        # and presence penalties count only the generated ones, so the two travel apart.
        self.sampler = Sampler(
            model.defaults.resolve(params),
            seed=params.seed if seed is None else seed,
            context_ids=prompt_ids,
            generated_ids=self.generated_ids,
            vocab_size=model.vocab_size,
        )
        self.seed = self.sampler.seed
        # Rebuilt from the ids generated so far: a resumed row's grammar is where the interrupted one's was.
        self.constraint = (
            OutputConstraint(model.constraint_tokenizer(), params.grammar, generated_ids=self.generated_ids)
            if params.grammar is not None
            else None
        )
        self.prompt_tokens = len(prompt_ids)
        # Set by the batch engine when the prefix cache held the prompt's start (usage's cached_tokens).
        self.cached_tokens = 0
        room = model.context_length - len(prompt_ids)
        self.max_output_tokens = room if params.max_output_tokens is None else min(params.max_output_tokens, room)
        self.finish_reason: str | None = None
        self._should_stop = should_stop
        kept = model.kept_token_ids(params.kept_tokens) if params.kept_tokens else frozenset()
        self._detokenizer = StreamDetokenizer(
            model.tokenizer,
            prefix_offset=detokenizer_offsets[0],
            read_offset=detokenizer_offsets[1],
            kept=kept,
            special=model.special_token_ids if kept else frozenset(),
        )
        self._stop_filter = StopFilter(params.stop, held=held_text, released_chars=len(text))
        self._text = [text] if text else []
        self._steps: Iterator[Step] | None = None

    @classmethod
    def from_snapshot(
        cls, model: GeneratingModel, snapshot: Mapping[str, Any], params: SamplingParams, should_stop: StopCheck
    ) -> OnnxGeneration:
        """Rebuild the generation a snapshot describes; see :meth:`snapshot`."""
        try:
            if snapshot.get("version") != SNAPSHOT_VERSION:
                raise ValueError(f"version {snapshot.get('version')!r}, expected {SNAPSHOT_VERSION}")
            prompt = [int(i) for i in snapshot["prompt_ids"]]
            generated = [int(i) for i in snapshot["generated_ids"]]
            offsets = snapshot["detokenizer"]
            prefix, read = int(offsets["prefix_offset"]), int(offsets["read_offset"])
            text, held = str(snapshot["text"]), str(snapshot["held_text"])
            if int(snapshot["released_chars"]) != len(text):
                raise ValueError("released_chars does not match the released text")
            if not 0 <= prefix <= read <= len(generated):
                raise ValueError("detokenizer offsets out of range")
            seed = int(snapshot["seed"])
            rng_state = snapshot["rng_state"]
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise GenerationError(f"the snapshot is not valid: {one_line(exc)}") from None
        generation = cls(
            model,
            prompt,
            params,
            should_stop,
            seed=seed,
            generated_ids=generated,
            text=text,
            held_text=held,
            detokenizer_offsets=(prefix, read),
        )
        generation.sampler.set_state(rng_state)
        finished = snapshot.get("finish_reason")
        if finished in (FINISH_EOS, FINISH_STOP, FINISH_LENGTH):
            # Nothing is left to produce; resuming just reports the same end.
            generation.finish_reason = finished
            generation._stop_filter.matched = snapshot.get("stop_sequence")
            generation._steps = iter(())
        return generation

    @property
    def output_tokens(self) -> int:
        return len(self.generated_ids)

    @property
    def stop_sequence(self) -> str | None:
        """The request's stop string that ended the output; None if none did."""
        return self._stop_filter.matched

    def __iter__(self) -> Iterator[Step]:
        if self._steps is None:
            self._steps = self._run()
        return self._steps

    def text(self) -> str:
        """All text released so far; after a resume it includes the text released before the snapshot."""
        return "".join(self._text)

    def snapshot(self) -> dict[str, Any]:
        """The state right after the last step yielded, as JSON-able data.

        ``text``/``released_chars`` are what the stop filter released,
        ``held_text`` what it still keeps back; the RNG state holds its 128-bit
        integers as hex strings.
        """
        new_ids, state = self.snapshot_since(0, with_prompt=True)
        return {**state, "generated_ids": new_ids, "text": self.text()}

    def snapshot_since(self, tokens: int, *, with_prompt: bool) -> tuple[list[int], dict[str, Any]]:
        """:meth:`snapshot` in parts that do not grow with the output: the ids
        generated after the first ``tokens``, and the rest without ``text``
        (and without ``prompt_ids`` unless ``with_prompt``)."""
        return self.generated_ids[tokens:], self.snapshot_state(with_prompt=with_prompt)

    def snapshot_state(self, *, with_prompt: bool = False) -> dict[str, Any]:
        """The small part of the snapshot (no ids, no text) as it is right now.

        The batch engine takes it on its model thread after the step a chunk
        ends on; the generated ids are append-only, so a task thread reading
        them later up to that chunk's count sees the same state.
        """
        state: dict[str, Any] = {
            "version": SNAPSHOT_VERSION,
            "seed": self.seed,
            "rng_state": self.sampler.get_state(),
            "detokenizer": self._detokenizer.state(),
            "released_chars": self._stop_filter.released_chars,
            "held_text": self._stop_filter.held,
            "finish_reason": self.finish_reason,
            "stop_sequence": self._stop_filter.matched,
        }
        if with_prompt:
            state["prompt_ids"] = list(self.prompt_ids)
        return state

    def _release(self, text: str) -> str:
        if text:
            self._text.append(text)
        return text

    def _flush(self, ids: Sequence[int]) -> str:
        """Release held text at the end; a stop string can still show up in it."""
        text = self._stop_filter.push(self._detokenizer.flush(ids))
        if not self._stop_filter.stopped:
            text += self._stop_filter.flush()
        return self._release(text)

    # -- the steps, as the iterator here and the batch engine drive them ----

    def begin(self) -> list[Step]:
        """The steps that need no model call; ``finish_reason`` is set if nothing is left to compute."""
        if self.finish_reason is not None:
            return []
        if self.generated_ids and self.generated_ids[-1] in self.model.eos_token_ids:
            # A snapshot taken right on the end-of-sequence step: only the flush is left.
            return self._finish(FINISH_EOS, self.generated_ids[:-1])
        if len(self.generated_ids) >= self.max_output_tokens:
            return self._finish(FINISH_LENGTH, self.generated_ids)
        return []

    def feeds(self) -> list[list[int]]:
        """What to feed the model before the first sample, one ``KVDecoder.feed`` each; the last is sampled.

        A fresh generation feeds its prompt. A resumed one brings its cache up
        to its last token: prompt and generated ids as one feed, unless the
        graph quantizes activations per call or computes in float16
        (``OnnxModel.replays_steps``): then the prompt goes in as it did first
        and each generated id alone, as it did when it was sampled, so the
        cache, and with it the next token, is the one the interrupted
        generation had.
        """
        if not self.generated_ids or not self.model.replays_steps:
            return [self.prompt_ids + self.generated_ids]
        return [self.prompt_ids, *([token] for token in self.generated_ids)]

    def stop_requested(self) -> bool:
        """Asked before every model call: True (and ``finish_reason`` cancelled) if ``should_stop`` says so."""
        if self._should_stop():
            self.finish_reason = FINISH_CANCELLED
            return True
        return False

    def accept(self, logits: np.ndarray) -> list[Step]:
        """Sample the next token from ``logits`` (the row after the last id fed); the steps it makes.

        Sets ``finish_reason`` when this token ends the generation; the next
        id to feed is otherwise ``generated_ids[-1]``.
        """
        return self.take(self.pick(logits))

    def pick(self, logits: np.ndarray) -> int:
        """The next token from ``logits``, under the output constraint if there is one; nothing else moves.

        Safe on any thread while no other call runs on this generation: the
        batch engine picks a step's rows on its sampling threads, then
        :meth:`take` s each on the model thread.
        """
        if self.constraint is None:
            return self.sampler.sample(logits)
        return self.sampler.sample(self.constraint.masked(logits))

    @property
    def picks_on_device(self) -> bool:
        """Whether a decode step may pick this row on the device: greedy, no output constraint."""
        return self.constraint is None and self.sampler.greedy

    def take(self, token: int) -> list[Step]:
        """Move on by ``token`` (from :meth:`pick`): the grammar, the ids, the text; the steps it makes."""
        if self.constraint is not None:
            self.constraint.consume(token)
        self.generated_ids.append(token)
        if token in self.model.eos_token_ids:
            return [Step(token, ""), *self._finish(FINISH_EOS, self.generated_ids[:-1])]
        text = self._release(self._stop_filter.push(self._detokenizer.step(self.generated_ids)))
        if self._stop_filter.stopped:
            # Set with the step: a snapshot taken after it must not resume past the stop.
            self.finish_reason = FINISH_STOP
            return [Step(token, text)]
        steps = [Step(token, text)]
        if len(self.generated_ids) >= self.max_output_tokens:
            steps += self._finish(FINISH_LENGTH, self.generated_ids)
        return steps

    def _run(self) -> Iterator[Step]:
        yield from self.begin()
        if self.finish_reason is not None:
            return
        decoder = self.model.decoder()
        *catch_up, pending = self.feeds()
        for ids in catch_up:
            decoder.feed(ids)
        while not self.stop_requested():
            yield from self.accept(decoder.feed(pending))
            if self.finish_reason is not None:
                return
            pending = self.generated_ids[-1:]

    def _finish(self, reason: str, text_ids: Sequence[int]) -> list[Step]:
        text = self._flush(text_ids)
        self.finish_reason = FINISH_STOP if self._stop_filter.stopped else reason
        return [Step(None, text)] if text else []
