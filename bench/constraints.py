"""What a grammar costs (issue 27): masks per row and per step at a 151,936-wide vocabulary, and the engine
with and without grammars at batch 8.

1. Masks. A bench-only byte-level BPE tokenizer trained to Qwen's logits width
   (151,936; built once into ``--cache``, about a minute) stands in for a real
   one: no model download here. For a JSON schema and the tool grammars (required, auto),
   rows of 1 and 8 matchers walk random paths of the grammar (each step a
   token drawn from its own mask); timed per step: the masks computed
   (``fill_next_token_bitmask_par`` over all rows, as the engine's helper
   thread does) and the mask applied to a logits row (``OutputConstraint.masked``,
   on the model thread).
2. The engine. ``demo:base`` (random weights, 2,048 ids), 8 rows of 200
   tokens at once, every row constrained vs none (the same prompts, the
   same token counts: the grammar is a long array of bounded strings that
   outlasts the limit). Reported: tokens/s and the mean step time, from the
   engine's own observer. Goal: constrained rows cost at most 10 % more
   per step at batch 8.

    .venv/bin/python bench/constraints.py              # both parts, ~3 min the first time
    .venv/bin/python bench/constraints.py --part masks
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import llguidance
import llguidance.numpy as llg_numpy
import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from fixture_models.demo import build_demo_model  # noqa: E402
from tasks_app.generation.structured_output import constraint_grammar  # noqa: E402
from tasks_app.generation.tool_calls import FORMATS, tools_grammar  # noqa: E402
from tests.support.specs import prompt_for, spec_of  # noqa: E402
from workers.backends.base import EngineObserver, SamplingParams  # noqa: E402
from workers.backends.constraints import ConstraintTokenizer, OutputConstraint  # noqa: E402
from workers.backends.onnx.engine import BatchEngine  # noqa: E402
from workers.backends.onnx.model import OnnxModel  # noqa: E402

WIDE = 151_936
WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 40},
        "temperature_c": {"type": "integer", "minimum": -60, "maximum": 60},
        "conditions": {"enum": ["sunny", "cloudy", "rain", "snow"]},
        "hourly": {"type": "array", "items": {"type": "number", "multipleOf": 0.5}, "maxItems": 24},
    },
    "required": ["city", "temperature_c", "conditions", "hourly"],
    "additionalProperties": False,
}
# A tool call as the Hermes/Qwen format writes it, with two tools' arguments as JSON.
WEATHER_ARGS = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 40}, "unit": {"enum": ["c", "f"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
SEARCH_ARGS = {
    "type": "object",
    "properties": {
        "query": {"type": "string", "maxLength": 80},
        "limit": {"type": "integer", "minimum": 1, "maximum": 20},
    },
    "required": ["query", "limit"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "name": "get_weather", "parameters": WEATHER_ARGS},
    {"type": "function", "name": "search", "parameters": SEARCH_ARGS},
]
LONG_ARRAY = {"type": "array", "items": {"type": "string", "maxLength": 40}, "minItems": 400, "maxItems": 400}


# --------------------------------------------------------------------------- #
# A tokenizer as wide as Qwen's logits
# --------------------------------------------------------------------------- #


def wide_tokenizer(cache: Path) -> Path:
    """A byte-level BPE tokenizer with about 151k ids, trained on synthetic text (prose, code, JSON)."""
    path = cache / "wide-tokenizer.json"
    if path.exists():
        return path
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    rng = random.Random(7)
    letters = "abcdefghijklmnopqrstuvwxyz"
    stems = ["".join(rng.choice(letters) for _ in range(rng.randint(3, 12))) for _ in range(250_000)]

    def word() -> str:
        # Half the words from a short, heavy head (a vocabulary's common words), half from the long tail.
        stem = stems[min(int(rng.paretovariate(0.8)), 2_000) - 1] if rng.random() < 0.5 else rng.choice(stems)
        return stem.capitalize() if rng.random() < 0.1 else stem

    def lines() -> Any:
        for _ in range(1_200_000):
            kind = rng.random()
            if kind < 0.6:
                yield " ".join(word() for _ in range(rng.randint(4, 16))) + rng.choice([".", ",", "!", "?", ":"])
            elif kind < 0.85:
                record = {word(): rng.choice([word(), rng.randint(-999, 9999), rng.random() < 0.5]) for _ in range(3)}
                yield json.dumps(record, separators=(",", ":") if rng.random() < 0.5 else None)
            else:
                name, arg = word(), word()
                yield f"def {name}({arg}, {word()}={rng.randint(0, 99)}):\n    return {arg}[{rng.randint(0, 9)}]"

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    special = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    trainer = trainers.BpeTrainer(
        vocab_size=WIDE - 271,  # Qwen: 151,665 ids under 151,936 logits
        special_tokens=special,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        min_frequency=1,
        show_progress=False,
    )
    tokenizer.train_from_iterator(lines(), trainer)
    cache.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(path))
    return path


def masks_bench(cache: Path, *, steps: int, seed: int) -> dict[str, Any]:
    tokenizer_path = wide_tokenizer(cache)
    from tokenizers import Tokenizer

    hf = Tokenizer.from_file(str(tokenizer_path))
    eos = hf.token_to_id("<|im_end|>")
    started = time.perf_counter()
    tokenizer = ConstraintTokenizer(tokenizer_path, vocab_size=WIDE, eos_token_ids=[eos], model="bench-wide")
    built = time.perf_counter() - started
    grammars = {
        "json_schema": constraint_grammar(
            spec_of({"text": {"format": {"type": "json_schema", "name": "w", "schema": WEATHER}}}).constraint
        ),
        # The service's own grammars (tasks_app.generation.tool_calls), Hermes/Qwen format: a call from the first token,
        # and auto (free text, calls after the <tool_call> marker: a lazy trigger).
        "tool_call": tools_grammar(
            spec_of({"tools": TOOLS, "tool_choice": "required"}), FORMATS["hermes"], token_ids={}
        ),
        "tool_auto": tools_grammar(spec_of({"tools": TOOLS, "tool_choice": "auto"}), FORMATS["hermes"], token_ids={}),
    }
    executor = llguidance.LLExecutor()
    rng = np.random.default_rng(seed)
    logits = rng.standard_normal(WIDE).astype(np.float32)
    result: dict[str, Any] = {"vocab": WIDE, "tokenizer_ids": hf.get_vocab_size(), "tokenizer_build_s": built}
    for name, grammar in grammars.items():
        assert grammar is not None
        for rows in (1, 8):
            fills, applies, tokens = [], [], 0
            constraints = [OutputConstraint(tokenizer, grammar) for _ in range(rows)]
            masks = np.zeros((rows, tokenizer.words), dtype=np.int32)
            for _ in range(steps):
                live = [(c, i) for i, c in enumerate(constraints) if not c.matcher.is_stopped()]
                if not live:
                    constraints = [OutputConstraint(tokenizer, grammar) for _ in range(rows)]
                    continue
                t0 = time.perf_counter()
                llg_numpy.fill_next_token_bitmask_par(executor, [(c.matcher, i) for c, i in live], masks)
                fills.append(time.perf_counter() - t0)
                for constraint, index in live:
                    constraint.mask[0] = masks[index]
                    constraint.mask_for = constraint.consumed
                    t0 = time.perf_counter()
                    scores = constraint.masked(logits)
                    applies.append(time.perf_counter() - t0)
                    allowed = np.flatnonzero(np.isfinite(scores))
                    # Prefer the grammar's way forward: a random allowed token, the end when it is the only one.
                    constraint.consume(int(rng.choice(allowed)))
                    tokens += 1
            result[f"{name}_batch{rows}"] = {
                "steps": len(fills),
                "tokens": tokens,
                "fill_ms_per_step_p50": 1000 * statistics.median(fills),
                "fill_ms_per_step_p90": 1000 * float(np.percentile(fills, 90)),
                "fill_ms_per_row": 1000 * sum(fills) / max(tokens, 1),
                "apply_ms_per_row_p50": 1000 * statistics.median(applies),
            }
    return result


# --------------------------------------------------------------------------- #
# The engine, with and without grammars
# --------------------------------------------------------------------------- #


class StepObserver(EngineObserver):
    def __init__(self) -> None:
        self.steps: list[tuple[int, float]] = []
        self.mask_times: list[float] = []

    def step(self, *, rows: int, seconds: float) -> None:
        self.steps.append((rows, seconds))

    def masks(self, *, rows: int, seconds: float) -> None:
        self.mask_times.append(seconds)

    def prefill(self, *, tokens: int, seconds: float) -> None: ...

    def queue_wait(self, seconds: float) -> None: ...

    def kv(self, *, in_use: int, budget: int) -> None: ...

    def rows(self, *, running: int, waiting: int) -> None: ...

    def close(self) -> None: ...


def engine_run(model: OnnxModel, *, grammar: str | None, rows: int, tokens: int) -> dict[str, float]:
    observer = StepObserver()
    engine = BatchEngine(
        model, max_batch=rows, kv_budget_bytes=0, delta_tokens=16, delta_seconds=0.05, observer=observer
    )
    params = SamplingParams(temperature=0.9, top_p=0.95, seed=5, max_output_tokens=tokens, grammar=grammar)
    generations = [
        model.generate(model.prompt_ids(prompt_for({"input": f"Story {i}"})), params, should_stop=lambda: False)
        for i in range(rows)
    ]
    started = time.perf_counter()
    streams = [engine.submit(generation) for generation in generations]
    threads = [threading.Thread(target=lambda s=s: [None for _ in s]) for s in streams]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    wall = time.perf_counter() - started
    engine.close()
    made = sum(g.output_tokens for g in generations)
    full = [seconds for n, seconds in observer.steps if n == rows]
    return {
        "tokens": made,
        "tokens_per_s": made / wall,
        "step_ms_mean_full_batch": 1000 * statistics.mean(full),
        "mask_ms_mean": 1000 * statistics.mean(observer.mask_times) if observer.mask_times else 0.0,
    }


def engine_bench(*, runs: int, rows: int, tokens: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "base"
        build_demo_model(folder, size="base", endless=True)
        model = OnnxModel(folder, intra_op_threads=1)
        grammar = constraint_grammar(
            spec_of({"text": {"format": {"type": "json_schema", "name": "a", "schema": LONG_ARRAY}}}).constraint
        )
        results: dict[str, list[dict[str, float]]] = {"unconstrained": [], "constrained": []}
        engine_run(model, grammar=None, rows=rows, tokens=20)  # warm up
        for _ in range(runs):
            results["unconstrained"].append(engine_run(model, grammar=None, rows=rows, tokens=tokens))
            results["constrained"].append(engine_run(model, grammar=grammar, rows=rows, tokens=tokens))
        model.close()
    summary: dict[str, Any] = {"rows": rows, "tokens_per_row": tokens, "runs": results}
    for key in ("tokens_per_s", "step_ms_mean_full_batch"):
        summary[f"{key}_median"] = {kind: statistics.median(r[key] for r in runs_) for kind, runs_ in results.items()}
    steps = summary["step_ms_mean_full_batch_median"]
    summary["constrained_step_cost"] = steps["constrained"] / steps["unconstrained"] - 1
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--part", choices=("masks", "engine", "both"), default="both")
    parser.add_argument("--cache", type=Path, default=Path(tempfile.gettempdir()) / "lmsp-bench-constraints")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=200)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    report: dict[str, Any] = {}
    if args.part in ("masks", "both"):
        report["masks"] = masks_bench(args.cache, steps=args.steps, seed=args.seed)
    if args.part in ("engine", "both"):
        report["engine"] = engine_bench(runs=args.runs, rows=8, tokens=args.tokens)
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
