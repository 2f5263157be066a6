"""Each thread's work arrays for the rows it samples: the draw's float64 passes, the penalised float32 copy."""

from __future__ import annotations

import threading

import numpy as np


class Scratch:
    """One thread's work arrays for rows of one size.

    A fresh array of the vocabulary's size per step costs its page faults
    (at 151,936 ids, more than the float64 arithmetic on it); one set per
    thread serves every sampler the thread runs, one row at a time.
    """

    def __init__(self, size: int) -> None:
        self.scores = np.empty(size, dtype=np.float64)
        self.spare = np.empty(size, dtype=np.float64)
        self.partitioned = np.empty(size, dtype=np.float32)
        self.penalised = np.empty(size, dtype=np.float32)
        self.ids = np.arange(size)
        self.ids.flags.writeable = False


_SCRATCH_SIZES = 4
_scratch_by_thread = threading.local()


def thread_scratch(size: int) -> Scratch:
    """This thread's work arrays for rows of ``size`` ids (a worker's models have a few sizes)."""
    sets: dict[int, Scratch] | None = getattr(_scratch_by_thread, "sets", None)
    if sets is None:
        sets = _scratch_by_thread.sets = {}
    scratch = sets.get(size)
    if scratch is None:
        if len(sets) >= _SCRATCH_SIZES:
            sets.clear()
        scratch = sets[size] = Scratch(size)
    return scratch
