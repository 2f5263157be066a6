"""What sampling a step costs at a real vocabulary (issue 28, point 1), as the batch engine samples it.

The engine hands a step's rows to a ``SamplingPool`` (``LMSP_SAMPLING_THREADS`` threads; one samples them
row after row in the model thread), each row through ``Sampler.sample``. This bench times exactly that at
Qwen's logits width (151,936), for 1, 8 and 32 rows, greedy and with the settings agents use (temperature
0.7 with top_p 0.9, with top_k 40, with min_p 0.05, and top_p with the repetition penalty), over logits
shaped like a language model's (a few strong candidates over a long tail), with the same seeds and
logits in every run. Issue 28's goals on this CPU: 8 rows with top_p in <= 3 ms a step, greedy in
<= 0.5 ms. ``--threads 1,2`` prints one table per pool size.

    .venv/bin/python bench/sampler_rows.py
    .venv/bin/python bench/sampler_rows.py --threads 1,2 --width 32000 --steps 100
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from functools import partial  # noqa: E402

from workers.backends.sampling import Sampler, SamplingPool, SamplingSettings  # noqa: E402

WIDE = 151_936
SETTINGS = {
    "greedy": SamplingSettings(temperature=0.0),
    "top_p 0.9": SamplingSettings(temperature=0.7, top_p=0.9),
    "top_k 40": SamplingSettings(temperature=0.7, top_k=40),
    "min_p 0.05": SamplingSettings(temperature=0.7, min_p=0.05),
    "top_p + repetition": SamplingSettings(temperature=0.7, top_p=0.9, repetition_penalty=1.1),
}


def language_model_logits(rng: np.random.Generator, rows: int, width: int) -> np.ndarray:
    """float32 rows with a long low tail and a handful of strong candidates, as a trained model's are."""
    logits = rng.normal(0.0, 2.0, size=(rows, width)).astype(np.float32)
    for row in logits:
        row[rng.integers(0, width, size=8)] += rng.uniform(8.0, 14.0, size=8).astype(np.float32)
    return logits


def step_times(
    settings: SamplingSettings, *, rows: int, width: int, steps: int, prompt: int, pool: SamplingPool
) -> list[float]:
    rng = np.random.default_rng(7)
    samplers = [
        Sampler(settings, seed=1000 + i, context_ids=rng.integers(0, width, size=prompt).tolist(), vocab_size=width)
        for i in range(rows)
    ]
    # A few distinct logits sets, cycled: fresh random rows per step would time the generator, not the sampler.
    batches = [language_model_logits(rng, rows, width) for _ in range(4)]
    times = []
    for step in range(steps + 3):  # the first three warm the threads' scratch arrays
        logits = batches[step % len(batches)]
        started = time.perf_counter()
        pool.run([partial(sampler.sample, row) for sampler, row in zip(samplers, logits, strict=True)], width=width)
        times.append(time.perf_counter() - started)
    return times[3:]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=WIDE, help="logits per row (default Qwen's 151,936)")
    parser.add_argument("--steps", type=int, default=60, help="timed steps per case")
    parser.add_argument("--rows", default="1,8,32", help="rows per step, comma-separated")
    parser.add_argument("--prompt", type=int, default=500, help="prompt ids each row's repetition penalty sees")
    parser.add_argument("--threads", default="1", help="sampling threads (LMSP_SAMPLING_THREADS), comma-separated")
    args = parser.parse_args()
    rows_list = [int(value) for value in args.rows.split(",")]
    for threads in (int(value) for value in args.threads.split(",")):
        pool = SamplingPool(threads=threads)
        print(
            f"sampler, {args.width:,} logits a row, {threads} sampling thread(s), {args.steps} steps a case;"
            " ms a step (median, p90)"
        )
        print(f"{'settings':<20}" + "".join(f"{f'{rows} rows':>22}" for rows in rows_list))
        for name, settings in SETTINGS.items():
            cells = []
            for rows in rows_list:
                times = sorted(
                    step_times(settings, rows=rows, width=args.width, steps=args.steps, prompt=args.prompt, pool=pool)
                )
                median, p90 = statistics.median(times) * 1000, times[int(len(times) * 0.9) - 1] * 1000
                cells.append(f"{median:10.2f} ({p90:7.2f})")
            print(f"{name:<20}" + "".join(f"{cell:>22}" for cell in cells))
        pool.close()


if __name__ == "__main__":
    main()
