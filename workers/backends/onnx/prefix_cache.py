"""The KV of earlier prompts (and answers), kept so a later row that starts with the same tokens skips them.

An agent sends the same long beginning on every turn (system prompt, tool
definitions, the history). An entry holds the cache of one token sequence,
``[1, kv_heads, length, head_dim]`` per cache tensor with no padding, where
the session computed it (on CUDA: on the device). A new row takes the
longest prefix any entry shares with its first feed, the entry's tensors as
they are when the whole entry matches and the first ``n`` positions (one
Gather on the model's device) when a part does, and feeds only the rest.

Why a hit changes no token (docs/workers.md, "The prefix cache"): a row's
cache at a position depends only on the ids up to it, and on the graphs
that use the cache the numbers do not depend on how a feed is split into
calls (the same property a resumed generation's one-call re-prefill and
the engine's prefill slices rely on; the tests compare every layout that
caches with the request run without it). Graphs whose numbers do depend
on the split reuse only whole chunks of ``prefill_chunk`` counted from the
first id, the calls they would have made anyway (float16), or not at all
(per-call quantized activations, whose scale covers every id of a call).

The cache shares the engine's KV budget with the rows: the engine evicts
least recently used entries whenever admitting a row needs their room, so
a row never waits for the cache. A row that took a hit owns copies (or the
entry's immutable tensors, which eviction only drops a reference to), so
evicting never touches a running row.

Only the model thread uses a ``PrefixCache``; nothing here locks.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import onnxruntime as ort

from workers.backends.onnx.kv_batch import CacheOps

# A hit shorter than this is not worth a Gather and an entry of its own: a few ids cost a call anyway.
MIN_HIT_TOKENS = 4


@dataclass(eq=False)
class _Entry:
    ids: np.ndarray
    """The tokens whose cache ``past`` holds, in order (int64)."""
    past: list[ort.OrtValue]
    bytes: int
    used: int
    """When it was last stored or hit (a tick of the cache's counter): the least recent goes first."""


@dataclass(frozen=True)
class PrefixHit:
    tokens: int
    """The row's first ``tokens`` ids whose cache ``past`` holds (``[1, heads, tokens, head_dim]`` each)."""
    past: list[ort.OrtValue]


class PrefixCache:
    """Cached prefixes of one model's rows, at most ``budget`` bytes beside what the rows reserve.

    ``block``: hits are whole multiples of it (1: any length; a graph whose
    numbers depend on the split: its ``prefill_chunk``).
    """

    def __init__(self, *, ops: CacheOps, bytes_per_position: int, block: int = 1) -> None:
        self._ops = ops
        self._bytes_per_position = bytes_per_position
        self.block = max(1, block)
        self._entries: list[_Entry] = []
        self._tick = itertools.count()
        self.bytes = 0
        """Bytes the entries hold now."""
        self._evicted: list[int] = []

    def __len__(self) -> int:
        return len(self._entries)

    def lookup(self, ids: Sequence[int]) -> PrefixHit | None:
        """The longest cached prefix of ``ids`` that still leaves one id to feed (its logits are the
        row's first sample), in whole blocks; None below ``MIN_HIT_TOKENS``."""
        wanted = np.asarray(ids, dtype=np.int64)
        limit = len(wanted) - 1
        best: _Entry | None = None
        best_tokens = 0
        for entry in self._entries:
            tokens = _common_prefix(entry.ids, wanted, limit)
            tokens -= tokens % self.block
            if tokens > best_tokens:
                best, best_tokens = entry, tokens
        if best is None or best_tokens < max(MIN_HIT_TOKENS, self.block):
            return None
        best.used = next(self._tick)
        if best_tokens == len(best.ids):
            return PrefixHit(tokens=best_tokens, past=list(best.past))
        positions = np.arange(best_tokens, dtype=np.int64)
        return PrefixHit(tokens=best_tokens, past=self._ops.take(best.past, positions, axis=2))

    def covers(self, ids: Sequence[int]) -> bool:
        """Whether an entry already holds all of ``ids`` (storing them again would add nothing); it counts as used."""
        wanted = np.asarray(ids, dtype=np.int64)
        for entry in self._entries:
            if len(entry.ids) >= len(wanted) and _common_prefix(entry.ids, wanted, len(wanted)) == len(wanted):
                entry.used = next(self._tick)
                return True
        return False

    def store(self, ids: Sequence[int], past: list[ort.OrtValue], *, room: int) -> bool:
        """Keep ``past`` (the cache of exactly ``ids``, one row, no padding) if it fits in ``room`` bytes
        once older entries are evicted; entries that are prefixes of ``ids`` go (this one serves their
        hits). Whether it was kept."""
        if len(ids) < max(MIN_HIT_TOKENS, self.block) + 1:
            return False
        size = len(ids) * self._bytes_per_position
        if size > room:
            return False
        key = np.asarray(ids, dtype=np.int64)
        for entry in list(self._entries):
            if len(entry.ids) <= len(key) and _common_prefix(entry.ids, key, len(entry.ids)) == len(entry.ids):
                self._drop(entry)
        self.evict(room - size)
        self._entries.append(_Entry(ids=key, past=list(past), bytes=size, used=next(self._tick)))
        self.bytes += size
        return True

    def evict(self, room: int) -> None:
        """Drop least recently used entries until the rest take at most ``room`` bytes."""
        while self._entries and self.bytes > max(0, room):
            oldest = min(self._entries, key=lambda entry: entry.used)
            self._drop(oldest)
            self._evicted.append(oldest.bytes)

    def take_evicted(self) -> list[int]:
        """The sizes of the entries evicted since the last call (for the metrics)."""
        evicted, self._evicted = self._evicted, []
        return evicted

    def devices(self) -> set[str]:
        """Where the entries' tensors lie (``cpu``, ``cuda``): the CUDA proof checks they stay on the device."""
        return {value.device_name().lower() for entry in self._entries for value in entry.past}

    def clear(self) -> None:
        self._entries.clear()
        self.bytes = 0

    def _drop(self, entry: _Entry) -> None:
        self._entries.remove(entry)
        self.bytes -= entry.bytes


def _common_prefix(a: np.ndarray, b: np.ndarray, limit: int) -> int:
    """How many leading ids ``a`` and ``b`` share, at most ``limit``."""
    n = min(len(a), len(b), limit)
    if n <= 0:
        return 0
    differ = np.flatnonzero(a[:n] != b[:n])
    return int(differ[0]) if len(differ) else n
