"""How much of a joining row's prompt each prefill call takes while other rows decode.

Nothing decoding: the whole feed in one call (or ``prefill_chunk`` ids). Rows
decoding: a slice of the prompt sized so that its call takes about
``prefill_share`` decode steps' time, learned from the calls as they run, so
running rows never stall for a whole prompt. A graph whose numbers depend on
the split (``exact_splits``) always takes the calls it would take alone.
"""

from __future__ import annotations

from workers.backends.onnx.kv_decoder import prompt_calls

# A prefill slice beside running rows aims at ``prefill_share`` decode steps' time (LMSP_PREFILL_SHARE;
# 3 measured best on a CPU, docs/workers.md), and takes at least MIN_SLICE ids: on a model whose
# one-token call costs about a step (weights read once per call), smaller slices would barely move the
# prompt on while doubling the rows' gaps anyway.
DEFAULT_PREFILL_SHARE = 3.0
MIN_SLICE = 16


class PrefillSlices:
    """The engine's prefill call sizes: the decode step's time so far, and the slice that aims at its share."""

    def __init__(self, *, prefill_chunk: int, share: float, exact_splits: bool) -> None:
        self.prefill_chunk = prefill_chunk
        self.share = share
        self.exact_splits = exact_splits
        self.step_seconds = 0.0
        """The decode steps' time, smoothed (0 before the first)."""
        self._slice = 16

    def stepped(self, seconds: float) -> None:
        """A decode step took ``seconds``."""
        self.step_seconds = seconds if not self.step_seconds else 0.8 * self.step_seconds + 0.2 * seconds

    def call_size(self, remaining: int, *, decoding: bool) -> int:
        """How many ids of a feed the next call takes (``decoding``: rows decode beside it)."""
        chunk = self.prefill_chunk
        whole = prompt_calls(remaining, chunk)[0]
        if self.exact_splits or not decoding:
            return whole
        return max(1, min(whole, self._slice))

    def resize(self, tokens: int, seconds: float, *, decoding: bool) -> None:
        """A call of ``tokens`` ids took ``seconds``: aim the next slice at ``share`` decode steps of the rows."""
        if not decoding or not self.step_seconds or seconds <= 0:
            return
        target = tokens * self.share * self.step_seconds / seconds
        self._slice = int(max(MIN_SLICE, min(self.prefill_chunk, 0.5 * self._slice + 0.5 * target)))
