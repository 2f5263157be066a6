"""Sampling the rows of one decode step side by side (:class:`SamplingPool`), and how many threads by default."""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

from workers.backends.errors import GenerationError

# Below this many logits a row samples in microseconds: handing it to another thread costs more.
POOL_MIN_WIDTH = 16_384


def automatic_sampling_threads() -> int:
    """Half the cores, at least 2 and at most 8 (1 on one core).

    The other half runs the session's own threads and the task threads; on
    two cores the model thread waits while a step samples, so two sampling
    threads take both cores only for that moment.
    """
    cores = os.cpu_count() or 1
    return 1 if cores < 2 else max(2, min(8, cores // 2))


class SamplingPool:
    """Samples the rows of one decode step, on several threads when the rows are wide.

    Each row's work at a real vocabulary is a handful of whole-row float64
    passes (scale, exp, sum) that NumPy runs without the GIL, so rows on
    different cores run side by side. Rows are dealt out in contiguous
    shares, one per thread; a row's token depends only on its own logits,
    settings and random stream (the work arrays are per thread), so which
    thread samples it changes no bit. One thread samples in the caller's.
    """

    def __init__(self, *, threads: int) -> None:
        self.threads = max(1, threads)
        self._pool = (
            ThreadPoolExecutor(max_workers=self.threads - 1, thread_name_prefix="lmsp-sampling")
            if self.threads > 1
            else None
        )

    def run(
        self, picks: Sequence[Callable[[], int]], *, width: int, sampled: Sequence[bool] | None = None
    ) -> list[int | GenerationError]:
        """Each pick's token, or the ``GenerationError`` that failed it (which fails only its row).

        ``sampled`` marks the picks that sample (the others take an argmax:
        one pass, cheaper than handing it to a thread); only those are shared
        out, and only when at least two are. Default: all of them.
        """
        if self._pool is None or width < POOL_MIN_WIDTH:
            return _run_share(picks)
        costly = [i for i in range(len(picks)) if sampled is None or sampled[i]]
        shares = min(self.threads, len(costly))
        if shares <= 1:
            return _run_share(picks)
        size = -(-len(costly) // shares)
        pieces = [costly[start : start + size] for start in range(0, len(costly), size)]
        futures = [self._pool.submit(_run_share, [picks[i] for i in piece]) for piece in pieces[1:]]
        shared = {i for piece in pieces[1:] for i in piece}
        inline = [i for i in range(len(picks)) if i not in shared]
        results: dict[int, int | GenerationError] = dict(
            zip(inline, _run_share([picks[i] for i in inline]), strict=True)
        )
        for piece, future in zip(pieces[1:], futures, strict=True):
            results.update(zip(piece, future.result(), strict=True))
        return [results[i] for i in range(len(picks))]

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)


def _run_share(picks: Sequence[Callable[[], int]]) -> list[int | GenerationError]:
    results: list[int | GenerationError] = []
    for pick in picks:
        try:
            results.append(pick())
        except GenerationError as exc:
            results.append(exc)
    return results
