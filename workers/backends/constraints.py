"""Constrained decoding: a row's logits masked to the tokens its grammar allows next (llguidance).

A constrained generation carries an :class:`OutputConstraint`: an llguidance
matcher over the model's own tokenizer, built from a grammar string (the
service compiles a request's ``text.format`` into one:
``tasks_app.generation.structured_output``; the runtime knows only grammars). Before each
sample the row's logits keep the allowed tokens' scores and every other
entry is ``-inf``; the sampler's steps (penalties, temperature, top-k/top-p/
min-p, the draw) then run on that row exactly as on any other, so a row's
tokens do not depend on which rows share its batch. Once the grammar is
complete and can take no more bytes, only the model's end-of-sequence ids
are allowed. A constraint that fails (an error in the matcher, no token
left) fails the row with a ``ConstraintFailed``; it never goes on
unconstrained.

A matcher cannot be serialised: a resumed generation builds a new one and
feeds it the committed tokens (:meth:`OutputConstraint.__init__`), which
puts it in the state the interrupted one had.

Masks cost a walk of the tokenizer's trie per row and step. The batch
engine computes the masks for a step's constrained rows on a helper thread
(llguidance releases the GIL) while the session runs that step
(:class:`MaskPlanner`); a row that has no mask ready computes its own.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import llguidance
import llguidance.numpy as llg_numpy
import numpy as np

from workers.backends.errors import ConstraintFailed, ModelLoadError

# An Earley parser over a hostile grammar can take long per token; these bound a mask's work
# (llguidance's defaults, stated so that a release changing them does not change ours).
_LIMITS = dict(step_lexer_fuel=200_000, step_max_items=50_000, max_items_in_row=2_000)


def _first_line(message: str) -> str:
    line = message.strip().splitlines()[0] if message.strip() else "unknown error"
    return line[:300]


class ConstraintTokenizer:
    """A model's tokenizer as llguidance sees it: built once per loaded model, shared by its rows.

    ``vocab_size`` is the logits' width, which can exceed the tokenizer's size
    (embedding tables padded to a multiple of 64 or 128; Qwen's 151,936
    against 151,665 ids): a mask covers every logit, the ids past the
    tokenizer's are never allowed.
    """

    def __init__(self, tokenizer_json: Path, *, vocab_size: int, eos_token_ids: Sequence[int], model: str) -> None:
        try:
            self.tokenizer = llguidance.LLTokenizer(
                tokenizer_json.read_text(encoding="utf-8"), n_vocab=vocab_size, eos_token=list(eos_token_ids)
            )
        except Exception as exc:  # llguidance raises plain exceptions from Rust
            raise ModelLoadError(
                f"the tokenizer of model {model!r} cannot be used for constrained output: {_first_line(str(exc))}"
            ) from None
        self.vocab_size = vocab_size
        self.words = llg_numpy.get_bitmask_shape(1, vocab_size)[1]


class OutputConstraint:
    """One row's grammar state; see the module docstring."""

    def __init__(self, tokenizer: ConstraintTokenizer, grammar: str, *, generated_ids: Sequence[int] = ()) -> None:
        self.tokenizer = tokenizer
        self.matcher = llguidance.LLMatcher(
            tokenizer.tokenizer, grammar, log_level=0, limits=llguidance.LLParserLimits(**_LIMITS)
        )
        self._check("the output constraint does not compile")
        self.consumed = 0
        self.mask = np.zeros((1, tokenizer.words), dtype=np.int32)
        self.mask_for = -1
        """The count of consumed tokens ``mask`` was computed after; -1: none yet."""
        self.mask_seconds = 0.0
        self._scores = np.empty(tokenizer.vocab_size, dtype=np.float32)
        if generated_ids and not self.matcher.consume_tokens([int(i) for i in generated_ids]):
            raise ConstraintFailed(
                "the tokens generated before the restart do not satisfy the output constraint: "
                + _first_line(self.matcher.get_error())
            )
        self.consumed = len(generated_ids)

    def _check(self, what: str) -> None:
        if self.matcher.is_error():
            raise ConstraintFailed(f"{what}: {_first_line(self.matcher.get_error())}")

    def fill(self) -> None:
        """Compute the mask for the next token now (on this thread)."""
        started = time.perf_counter()
        llg_numpy.fill_next_token_bitmask(self.matcher, self.mask)
        self.mask_seconds += time.perf_counter() - started
        self.mask_for = self.consumed

    def masked(self, logits: np.ndarray) -> np.ndarray:
        """``logits`` with every token the grammar does not allow next at ``-inf`` (a copy; the row is not
        written)."""
        if self.mask_for != self.consumed:
            self.fill()
        self._check("the output constraint failed")
        width = min(len(logits), self.tokenizer.vocab_size)
        allowed = np.unpackbits(self.mask.view(np.uint8), bitorder="little", count=width).view(bool)
        scores = self._scores[: len(logits)]
        scores.fill(-np.inf)
        np.copyto(scores[:width], np.asarray(logits[:width], dtype=np.float32), where=allowed)
        if not np.isfinite(scores.max()):
            raise ConstraintFailed("the output constraint allows no token the model can produce here")
        return scores

    def consume(self, token: int) -> None:
        """The token sampled from :meth:`masked`'s row moves the grammar on."""
        if not self.matcher.consume_token(int(token)):
            raise ConstraintFailed(
                f"the output constraint rejected token {token}: {_first_line(self.matcher.get_error())}"
            )
        self.consumed += 1


class MaskPlanner:
    """Computes a step's masks on one helper thread while the model thread runs the session.

    ``start`` hands the rows' matchers to llguidance's executor (which releases
    the GIL and spreads rows over its threads); ``wait`` returns once every
    mask is in its row's :class:`OutputConstraint`. Only the model thread calls
    either, and it touches no matcher between the two.
    """

    def __init__(self) -> None:
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="lmsp-masks")
        self._executor: llguidance.LLExecutor | None = None
        self._lock = threading.Lock()

    def start(self, constraints: Sequence[OutputConstraint]) -> Future[float] | None:
        pending = [c for c in constraints if c.mask_for != c.consumed and not c.matcher.is_error()]
        if not pending:
            return None
        return self._pool.submit(self._fill, pending)

    def _fill(self, constraints: Sequence[OutputConstraint]) -> float:
        started = time.perf_counter()
        with self._lock:
            if self._executor is None:
                self._executor = llguidance.LLExecutor()
            executor = self._executor
        words = constraints[0].tokenizer.words
        masks = np.zeros((len(constraints), words), dtype=np.int32)
        llg_numpy.fill_next_token_bitmask_par(executor, [(c.matcher, i) for i, c in enumerate(constraints)], masks)
        seconds = time.perf_counter() - started
        for i, constraint in enumerate(constraints):
            constraint.mask[0] = masks[i]
            constraint.mask_for = constraint.consumed
            constraint.mask_seconds += seconds / len(constraints)
        return seconds

    @staticmethod
    def wait(pending: Future[float] | None) -> float:
        """Seconds the masks took (0 without any); a failure surfaces as the row's own, later."""
        if pending is None:
            return 0.0
        try:
            return pending.result()
        except Exception:  # each row then computes its own mask, and reports its own error
            return 0.0

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
