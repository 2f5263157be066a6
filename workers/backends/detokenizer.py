"""Turning a growing list of token ids into text deltas, and holding back stop strings.

Decoding token by token is wrong for byte-level tokenizers: a character can be
split over several tokens, and a tokenizer's decoder may change earlier text
once it sees more tokens (leading spaces, merges). :class:`StreamDetokenizer`
uses the prefix/read offset algorithm that vLLM and TGI use: it decodes a short
window twice, with and without the newest tokens, and releases the difference
only once it no longer ends in U+FFFD (half a UTF-8 character). Both offsets are
plain integers, so the state fits a snapshot.

:class:`StopFilter` sits behind it and keeps back just enough text that a stop
string arriving over several deltas is never partly released.
"""

from __future__ import annotations

from collections.abc import Sequence

from tokenizers import Tokenizer

REPLACEMENT_CHAR = "\ufffd"


class StreamDetokenizer:
    """Incremental detokeniser whose released text concatenates to ``decode(ids)``.

    The caller owns the id list and appends to it; :meth:`step` is called
    after each append. Special tokens are skipped, as in the final decode, except the ``kept`` ones.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        *,
        prefix_offset: int = 0,
        read_offset: int = 0,
        kept: frozenset[int] = frozenset(),
        special: frozenset[int] = frozenset(),
    ) -> None:
        if not 0 <= prefix_offset <= read_offset:
            raise ValueError(f"bad detokenizer offsets: prefix {prefix_offset}, read {read_offset}")
        self.tokenizer = tokenizer
        self.prefix_offset = prefix_offset
        self.read_offset = read_offset
        # Special tokens whose text stays (a tool-call marker, for the parser): the others are left out
        # before decoding, which is what skip_special_tokens does.
        self._kept = kept
        self._dropped = special - kept

    def _decode(self, ids: Sequence[int]) -> str:
        if not self._kept:
            return self.tokenizer.decode(list(ids), skip_special_tokens=True)
        return self.tokenizer.decode([i for i in ids if i not in self._dropped], skip_special_tokens=False)

    def step(self, ids: Sequence[int]) -> str:
        """New final text after ``ids`` grew; empty while it ends inside a character."""
        prefix_text = self._decode(ids[self.prefix_offset : self.read_offset])
        new_text = self._decode(ids[self.prefix_offset :])
        if len(new_text) <= len(prefix_text) or new_text.endswith(REPLACEMENT_CHAR):
            return ""
        self.prefix_offset = self.read_offset
        self.read_offset = len(ids)
        return new_text[len(prefix_text) :]

    def flush(self, ids: Sequence[int]) -> str:
        """Whatever is still held at the end of a generation, less a character it ends inside.

        A generation cut (by its token limit) after some bytes of a character
        never writes the rest: those bytes decode to U+FFFD, which is no
        character of the answer, so they are dropped. (A U+FFFD the model
        wrote as a whole character at the very end goes with them: the decoded
        text cannot tell the two apart.)
        """
        prefix_text = self._decode(ids[self.prefix_offset : self.read_offset])
        new_text = self._decode(ids[self.prefix_offset :])
        self.prefix_offset = self.read_offset = len(ids)
        return new_text[len(prefix_text) :].rstrip(REPLACEMENT_CHAR)

    def state(self) -> dict[str, int]:
        return {"prefix_offset": self.prefix_offset, "read_offset": self.read_offset}


class StopFilter:
    """Releases text except a tail that could still begin a stop string.

    It keeps back the last ``len(longest stop) - 1`` characters. When a stop
    string shows up, only the text before its first occurrence is released and
    :attr:`stopped` becomes True; nothing after it is ever released.
    """

    def __init__(self, stops: Sequence[str], *, held: str = "", released_chars: int = 0) -> None:
        self.stops = tuple(s for s in stops if s)
        self._hold = max((len(s) for s in self.stops), default=1) - 1
        self.held = held
        self.released_chars = released_chars
        self.stopped = False
        self.matched: str | None = None
        """The stop string that ended the text (the one that showed up first), once ``stopped``."""

    def push(self, text: str) -> str:
        """Feed new text; returns what is now safe to release."""
        if self.stopped:
            return ""
        buffer = self.held + text
        hits = sorted((i, n, s) for n, s in enumerate(self.stops) if (i := buffer.find(s)) >= 0)
        if hits:
            at, _, self.matched = hits[0]
            self.stopped = True
            out, self.held = buffer[:at], ""
        else:
            cut = max(len(buffer) - self._hold, 0)
            out, self.held = buffer[:cut], buffer[cut:]
        self.released_chars += len(out)
        return out

    def flush(self) -> str:
        """The held tail at the end of a generation (it cannot start a stop string any more)."""
        out, self.held = ("" if self.stopped else self.held), ""
        self.released_chars += len(out)
        return out
