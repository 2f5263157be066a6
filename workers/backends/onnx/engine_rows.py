"""The batch engine's record of each row (:class:`Row`) and of the rows that share a cache (:class:`Group`).

Only the model thread touches these. A row gathers the steps it made since
its last chunk and sends them as one (:meth:`Row.emit`) on its
:class:`~workers.backends.row_stream.RowStream`.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from workers.backends.base import Chunk, Step
from workers.backends.onnx.kv_batch import KVBatch
from workers.backends.row_stream import RowStream

if TYPE_CHECKING:
    from workers.backends.onnx.generation import OnnxGeneration

# A joining row shares a group's calls while the padded group costs at most this much more
# (rows x width) than the two apart.
MERGE_SLACK = 1.3


@dataclass(eq=False)
class Group:
    """Decoding rows that share one cache tensor per layer, and so one session call per step."""

    batch: KVBatch
    rows: list[Row]


@dataclass(eq=False)
class Row:
    stream: RowStream
    generation: OnnxGeneration
    length_cap: int
    """The most positions this row's cache can reach (prompt + max output)."""
    submitted: float
    batch: KVBatch | None = None
    calls: deque[list[int]] = field(default_factory=deque)
    """Prefill: the ids still to feed, one list per feed (sliced into calls as they run)."""
    steps: list[Step] = field(default_factory=list)
    tokens: int = 0
    since: float = 0.0
    first_at: float = 0.0
    last_at: float = 0.0
    emitted: bool = False
    first_feed: list[int] | None = None
    """The first feed's ids, from the start of its prefill until they are offered to the prefix cache."""
    shared: bool = False
    """Whether the row ever shared a decode call: on a graph that pads rows apart, its cache then
    differs from its alone's in the last bits, and is not offered to the prefix cache."""

    def add_step(self, step: Step, now: float) -> None:
        if not self.steps and not self.tokens:
            self.since = now
        self.steps.append(step)
        if step.token_id is not None:
            self.tokens += 1
            self.first_at = self.first_at or now
            self.last_at = now

    def emit(self, *, final: bool, interrupted: bool = False) -> None:
        """Send the steps since the last chunk as one chunk (with the generation's state after them)."""
        generation = self.generation
        self.stream.put(
            Chunk(
                steps=tuple(self.steps),
                tokens=self.tokens,
                output_tokens=generation.output_tokens,
                state=generation.snapshot_state(),
                final=final,
                interrupted=interrupted,
                first_at=self.first_at,
                last_at=self.last_at,
            )
        )
        self.steps, self.tokens, self.emitted = [], 0, True
        self.first_at = self.last_at = 0.0


def group_to_join(groups: Sequence[Group], width: int) -> Group | None:
    """The group a prefilled row of cache ``width`` pads least, or None where it should run apart.

    A step costs about rows x width of the cache, so a row far longer (or
    shorter) than a group's rows would make every one of them pay for its
    width, on every step until one leaves: it joins only where the padded
    group costs at most ``MERGE_SLACK`` more than the two apart.
    """
    best: Group | None = None
    best_cost = float("inf")
    for group in groups:
        apart = len(group.rows) * group.batch.width + width
        together = (len(group.rows) + 1) * max(group.batch.width, width)
        if together <= MERGE_SLACK * apart and together < best_cost:
            best, best_cost = group, together
    return best
