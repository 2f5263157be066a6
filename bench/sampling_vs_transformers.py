"""The sampler against transformers' own logits processors, on random rows (needs torch and transformers).

Builds the processors exactly as ``generate`` does
(``GenerationMixin._get_logits_processor``) from a ``GenerationConfig``, feeds
the same float32 logits rows and contexts through them and through
``workers.backends.sampling.Sampler``, and counts:

- greedy (``do_sample=False``) with a repetition penalty: the same argmax, and
  a bit-identical penalised row;
- sampling: the same set of ids left after temperature, top_k, top_p and
  min_p (the finite scores transformers leaves), and a sampled id inside it;
- multi-step greedy with the penalty, the context growing by each token
  (half the runs with rounded, tied scores): the same ids at every step.

Not run in CI (no torch there); run it after changing the sampler:

    /path/to/env-with-torch/bin/python bench/sampling_vs_transformers.py [--rows 3000] [--runs 200]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import torch
from transformers import GenerationConfig
from transformers.generation.logits_process import LogitsProcessorList
from transformers.generation.utils import GenerationMixin

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from workers.backends.base import SamplingParams
from workers.backends.sampling import Sampler, SamplingDefaults, SamplingSettings
from workers.backends.sampling.draw import kept
from workers.backends.sampling.scratch import thread_scratch


def processors(config: GenerationConfig) -> LogitsProcessorList:
    """What ``generate`` applies to each row for this config (no beams, no eos handling)."""
    mixin = GenerationMixin.__new__(GenerationMixin)
    config._eos_token_tensor = None
    return mixin._get_logits_processor(
        generation_config=config,
        input_ids_seq_length=1,
        encoder_input_ids=None,
        prefix_allowed_tokens_fn=None,
        logits_processor=LogitsProcessorList(),
        device="cpu",
    )


def through_transformers(config: GenerationConfig, context: list[int], row: np.ndarray) -> np.ndarray:
    ids = torch.tensor([context], dtype=torch.long) if context else torch.zeros((1, 0), dtype=torch.long)
    return processors(config)(ids, torch.from_numpy(row.copy())[None, :]).numpy()[0]


def kept_by_sampler(sampler: Sampler, row: np.ndarray) -> tuple[set[int], np.ndarray]:
    """The ids the sampler's next draw can return, and its penalised row (its own helpers, no draw)."""
    penalised = sampler.penalties.apply(row)
    settings = sampler.settings
    scores = penalised.astype(np.float64) / settings.temperature
    size, top_k = len(scores), None
    if 0 < settings.top_k < size:
        threshold = np.partition(scores, size - settings.top_k)[size - settings.top_k]
        top_k = np.flatnonzero(scores >= threshold)
    probs = np.exp(scores - scores.max())
    probs /= probs.sum()
    order, _ = kept(probs, top_k, np.float64(1.0), thread_scratch(len(probs)), settings)
    return set(order.tolist()), penalised


def random_rows(rng: np.random.Generator, count: int) -> tuple[int, int, int, list[tuple]]:
    greedy_same = rows_identical = kept_same = 0
    differences = []
    for trial in range(count):
        vocab = int(rng.choice([50, 300, 5000, 151936]))
        row = (rng.normal(size=vocab) * rng.uniform(0.5, 8) + rng.normal()).astype(np.float32)
        context = rng.integers(0, vocab, size=int(rng.integers(0, min(vocab, 400)))).tolist()
        penalty = float(rng.choice([1.0, 1.05, 1.1, 1.3, 0.8, 2.0, 0.01, 100.0]))

        expected = through_transformers(GenerationConfig(do_sample=False, repetition_penalty=penalty), context, row)
        greedy = Sampler(
            SamplingSettings(temperature=0.0, repetition_penalty=penalty), context_ids=context, vocab_size=vocab
        )
        probe = Sampler(SamplingSettings(repetition_penalty=penalty), context_ids=context, vocab_size=vocab)
        greedy_same += greedy.sample(row) == int(np.argmax(expected))
        rows_identical += np.array_equal(expected, kept_by_sampler(probe, row)[1])

        temperature = float(rng.choice([0.3, 0.7, 1.0, 1.5]))
        top_k = int(rng.choice([0, 1, 5, 20, 50, 1000]))
        top_p = float(rng.choice([1.0, 0.95, 0.8, 0.5, 0.1]))
        min_p = rng.choice([None, 0.0, 0.05, 0.2, 0.9])
        min_p = None if min_p is None else float(min_p)
        config = GenerationConfig(
            do_sample=True, temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, repetition_penalty=penalty
        )
        expected_kept = set(np.flatnonzero(np.isfinite(through_transformers(config, context, row))).tolist())
        params = SamplingParams(
            temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p, repetition_penalty=penalty
        )
        settings = SamplingDefaults().resolve(params)
        ours, _ = kept_by_sampler(Sampler(settings, context_ids=context, vocab_size=vocab), row)
        if ours == expected_kept:
            kept_same += 1
        else:
            differences.append((trial, vocab, temperature, top_k, top_p, min_p, penalty, len(ours), len(expected_kept)))
        pick = Sampler(settings, seed=trial, context_ids=context, vocab_size=vocab).sample(row)
        assert pick in expected_kept, (trial, pick)
    return greedy_same, rows_identical, kept_same, differences


def greedy_runs(rng: np.random.Generator, count: int, steps: int) -> tuple[int, int]:
    identical = tied_rows = 0
    for trial in range(count):
        vocab = int(rng.choice([40, 500, 32000]))
        penalty = float(rng.choice([1.05, 1.3, 0.7, 3.0]))
        context = rng.integers(0, vocab, size=int(rng.integers(1, 30))).tolist()
        config = GenerationConfig(do_sample=False, repetition_penalty=penalty)
        sampler = Sampler(
            SamplingSettings(temperature=0.0, repetition_penalty=penalty), context_ids=context, vocab_size=vocab
        )
        # A fixed row plus a little noise: the same few ids keep winning, so the penalty decides.
        base = rng.normal(size=vocab).astype(np.float32) * 3
        same = True
        for _ in range(steps):
            row = base + (rng.normal(size=vocab) * 0.05).astype(np.float32)
            if trial % 2:
                row = np.round(row, 0).astype(np.float32)
            expected = through_transformers(config, context, row)
            tied_rows += int((expected == expected.max()).sum() > 1)
            token = int(torch.argmax(torch.from_numpy(expected)))
            if sampler.sample(row) != token:
                same = False
                break
            context.append(token)
        identical += same
    return identical, tied_rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=3000)
    parser.add_argument("--runs", type=int, default=200)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--seed", type=int, default=1234)
    args = parser.parse_args()
    rng = np.random.default_rng(args.seed)

    greedy_same, rows_identical, kept_same, differences = random_rows(rng, args.rows)
    print(f"greedy id equal: {greedy_same}/{args.rows}; penalised row bit-identical: {rows_identical}/{args.rows}")
    print(f"kept set after temperature/top_k/top_p/min_p equal: {kept_same}/{args.rows}")
    for difference in differences[:10]:
        print("  differs:", difference)
    identical, tied_rows = greedy_runs(rng, args.runs, args.steps)
    print(
        f"greedy runs of {args.steps} steps identical: {identical}/{args.runs} ({tied_rows} rows with a tied maximum)"
    )
    if differences or greedy_same < args.rows or identical < args.runs:
        sys.exit(1)


if __name__ == "__main__":
    main()
