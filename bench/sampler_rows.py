"""What sampling a step costs at a real vocabulary (issue 28, point 1): today's per-row sampler, row after row.

The engine samples each row of a step on its own (``Sampler.sample``, one call per row), so a step of
``n`` rows costs ``n`` times a row. This bench times exactly that at Qwen's logits width (151,936),
for 1, 8 and 32 rows, greedy and with the settings agents use (temperature 0.7 with top_p 0.9, with
top_k 40, with min_p 0.05, and top_p with the repetition penalty), over logits shaped like a language
model's (a few strong candidates over a long tail). Issue 28's goals on this CPU: 8 rows with top_p in
<= 3 ms a step, greedy in <= 0.5 ms. The batched sampler that issue asks for is measured against these
figures, with the same seeds and logits.

    .venv/bin/python bench/sampler_rows.py
    .venv/bin/python bench/sampler_rows.py --width 32000 --steps 100
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

from workers.backends.sampling import Sampler, SamplingSettings  # noqa: E402

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


def step_times(settings: SamplingSettings, *, rows: int, width: int, steps: int, prompt: int) -> list[float]:
    rng = np.random.default_rng(7)
    samplers = [
        Sampler(settings, seed=1000 + i, context_ids=rng.integers(0, width, size=prompt).tolist(), vocab_size=width)
        for i in range(rows)
    ]
    # A few distinct logits sets, cycled: fresh random rows per step would time the generator, not the sampler.
    batches = [language_model_logits(rng, rows, width) for _ in range(4)]
    for i in range(3):  # warm the thread's scratch arrays
        for sampler, row in zip(samplers, batches[i % len(batches)], strict=True):
            sampler.sample(row)
    times = []
    for step in range(steps):
        logits = batches[step % len(batches)]
        started = time.perf_counter()
        for sampler, row in zip(samplers, logits, strict=True):
            sampler.sample(row)
        times.append(time.perf_counter() - started)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=WIDE, help="logits per row (default Qwen's 151,936)")
    parser.add_argument("--steps", type=int, default=60, help="timed steps per case")
    parser.add_argument("--rows", default="1,8,32", help="rows per step, comma-separated")
    parser.add_argument("--prompt", type=int, default=500, help="prompt ids each row's repetition penalty sees")
    args = parser.parse_args()
    rows_list = [int(value) for value in args.rows.split(",")]
    print(f"per-row sampler, {args.width:,} logits a row, {args.steps} steps a case; ms a step (median, p90)")
    print(f"{'settings':<20}" + "".join(f"{f'{rows} rows':>22}" for rows in rows_list))
    for name, settings in SETTINGS.items():
        cells = []
        for rows in rows_list:
            times = sorted(step_times(settings, rows=rows, width=args.width, steps=args.steps, prompt=args.prompt))
            median, p90 = statistics.median(times) * 1000, times[int(len(times) * 0.9) - 1] * 1000
            cells.append(f"{median:10.2f} ({p90:7.2f})")
        print(f"{name:<20}" + "".join(f"{cell:>22}" for cell in cells))


if __name__ == "__main__":
    main()
