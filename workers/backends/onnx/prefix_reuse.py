"""The batch engine's use of its prefix cache: joining rows start from a hit, prompts and answers are offered.

The cache itself (``prefix_cache``) only keeps and finds entries. Here is
when the engine asks it: a joining row's cache starts as the longest cached
prefix of its first feed; a row's first feed, once prefilled, and a leaving
row's prompt and answer are offered to it, in the room of the KV budget the
running rows leave; admitting a row evicts what it needs. Without a cache
(``cache`` None) a row starts from an empty batch and nothing is offered.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from workers.backends.base import EngineObserver
from workers.backends.errors import GenerationError
from workers.backends.onnx.engine_rows import Group, Row
from workers.backends.onnx.kv_batch import CacheOps, KVBatch
from workers.backends.onnx.prefix_cache import PrefixCache
from workers.backends.onnx.runtime import ModelRuntime

log = logging.getLogger(__name__)


class PrefixReuse:
    """One engine's side of its prefix cache (``cache``, None when the engine keeps none).

    ``room`` says the bytes the running rows leave of the KV budget now; ``keeps_answers`` whether a
    leaving row's answer may be offered at all (not where the numbers depend on the split), and
    ``right_aligned`` whether a row that shared decode calls still holds exactly its alone's cache.
    """

    def __init__(
        self,
        cache: PrefixCache | None,
        *,
        runtime: ModelRuntime,
        ops: CacheOps,
        observer: EngineObserver,
        bytes_per_position: int,
        room: Callable[[], int],
        keeps_answers: bool,
        right_aligned: bool,
    ) -> None:
        self.cache = cache
        self._runtime = runtime
        self._ops = ops
        self._observer = observer
        self._bytes_per_position = bytes_per_position
        self._room = room
        self._keeps_answers = keeps_answers
        self._right_aligned = right_aligned

    def start_batch(self, row: Row) -> KVBatch:
        """A joining row's cache: empty, or the longest cached prefix of its first feed (the rest to feed)."""
        batch = KVBatch(self._runtime, ops=self._ops)
        cache = self.cache
        if cache is None:
            return batch
        feed = row.calls[0]
        row.first_feed = list(feed)
        hit = cache.lookup(feed)
        self._observer.prefix_hit(tokens=hit.tokens if hit is not None else 0)
        if hit is not None:
            batch.start_from(hit.past, hit.tokens)
            row.calls[0] = feed[hit.tokens :]
            generation = row.generation
            generation.cached_tokens = min(hit.tokens, generation.prompt_tokens)
        return batch

    def remember(self, ids: list[int], batch: KVBatch, *, index: int) -> None:
        """Offer row ``index`` of ``batch`` (whose cache holds exactly ``ids``) to the prefix cache, in the
        room the running rows leave it."""
        cache = self.cache
        assert cache is not None
        if int(batch.lengths[index]) != len(ids) or cache.covers(ids):
            return
        room = self._room()
        if room < len(ids) * self._bytes_per_position:
            return
        try:
            past = batch.row_cache(index)
        except GenerationError:
            log.warning("the prefix cache of %s skipped a row it could not copy", self._runtime.name, exc_info=True)
            return
        cache.store(ids, past, room=room)
        self._changed()

    def remember_answers(self, group: Group, rows: list[Row]) -> None:
        """Rows leaving: offer each one's prompt and answer (what its cache holds) to the prefix cache.

        Only where that cache is the one the same ids fed alone would give: a graph whose numbers do
        not depend on the split (the answer was fed one id a call), and rows that never shared a call
        unless the graph keeps rows exact in a batch (GroupQueryAttention, right-aligned).
        """
        if self.cache is None or not self._keeps_answers:
            return
        for row in rows:
            if row.shared and not self._right_aligned:
                continue
            index = next(i for i, member in enumerate(group.rows) if member is row)
            generation = row.generation
            fed = int(group.batch.lengths[index])
            self.remember([*generation.prompt_ids, *generation.generated_ids][:fed], group.batch, index=index)

    def evict(self, room: int) -> None:
        """Drop least recently used entries until the cache takes at most ``room`` bytes."""
        if self.cache is not None and self.cache.bytes > room:
            self.cache.evict(room)
            self._changed()

    def clear(self) -> None:
        if self.cache is not None:
            self.cache.clear()

    def _changed(self) -> None:
        cache = self.cache
        assert cache is not None
        self._observer.prefix_cache(cached_bytes=cache.bytes, evicted=cache.take_evicted())
