"""How often a row in a batch gets another token than the same request alone (issue 16).

For each model, many greedy requests of random prompt lengths and token
limits run twice: each alone (``OnnxGeneration`` iterated by itself), and all
of them through one batch engine, submitted in waves so that rows join a
running batch and leave it at different steps. Counted: requests whose
tokens differ, and, over the first ``--compare`` steps of every request, the
largest difference between a batched row's logits and its logits alone
(recorded by wrapping ``accept``), with the smallest top-1/top-2 margin seen,
which says how close a near-tie would have to be to flip.

    .venv/bin/python bench/batch_exactness.py                 # demo models + fixtures, ~1-2 min
    .venv/bin/python bench/batch_exactness.py --requests 200  # more
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from fixture_models.demo import build_demo_model  # noqa: E402
from workers.backends.base import SamplingParams  # noqa: E402
from workers.backends.onnx.engine import BatchEngine  # noqa: E402
from workers.backends.onnx.model import OnnxModel  # noqa: E402

FIXTURES = REPO / "tests" / "fixtures" / "models"


def never() -> bool:
    return False


def logits_of(model: OnnxModel, prompt: list[int], params: SamplingParams) -> tuple[list[int], list[np.ndarray]]:
    """Tokens and every step's logits row of the request alone."""
    generation = model.generate(prompt, params, should_stop=never)
    rows: list[np.ndarray] = []
    pick = generation.pick

    def recording(logits: np.ndarray) -> Any:
        rows.append(np.array(logits, dtype=np.float32))
        return pick(logits)

    generation.pick = recording  # type: ignore[method-assign]
    tokens = [step.token_id for step in generation if step.token_id is not None]
    return tokens, rows


def measure(name: str, model: OnnxModel, *, requests: int, max_batch: int, seed: int) -> dict[str, Any]:
    rng = random.Random(seed)
    vocab = min(model.vocab_size, 380)
    jobs = []
    for _ in range(requests):
        prompt = [rng.randrange(3, vocab - 3) for _ in range(rng.randrange(4, 120))]
        jobs.append((prompt, SamplingParams(temperature=0, max_output_tokens=rng.randrange(4, 96))))
    alone = [logits_of(model, prompt, params) for prompt, params in jobs]
    engine = BatchEngine(model, max_batch=max_batch, kv_budget_bytes=0, delta_tokens=16, delta_seconds=0.05)
    batched: list[tuple[list[int], list[np.ndarray]]] = [([], []) for _ in jobs]

    def run(index: int) -> None:
        time.sleep(0.001 * (index % 7))
        prompt, params = jobs[index]
        generation = model.generate(prompt, params, should_stop=never)
        rows = batched[index][1]
        pick = generation.pick

        def recording(logits: np.ndarray) -> Any:
            rows.append(np.array(logits, dtype=np.float32))
            return pick(logits)

        # Every logits row a generation samples goes through pick, alone or in the engine.
        generation.pick = recording  # type: ignore[method-assign]
        for chunk in engine.submit(generation):
            batched[index][0].extend(step.token_id for step in chunk.steps if step.token_id is not None)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(jobs))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    engine.close()
    differ = sum(1 for (a, _), (b, _) in zip(alone, batched, strict=True) if a != b)
    diff, margin = 0.0, float("inf")
    for (tokens_alone, rows_alone), (tokens_batched, rows_batched) in zip(alone, batched, strict=True):
        # Up to the first other token: after it the two rows see different contexts.
        pairs = enumerate(zip(tokens_alone, tokens_batched, strict=False))
        same = next((i for i, (a, b) in pairs if a != b), len(tokens_alone))
        for x, y in zip(rows_alone[: same + 1], rows_batched[: same + 1], strict=False):
            diff = max(diff, float(np.abs(x - y).max()))
            top = np.partition(x, -2)[-2:]
            margin = min(margin, float(top[1] - top[0]))
    return {
        "model": name,
        "batched": model.batchable,
        "requests": requests,
        "tokens": sum(len(t) for t, _ in alone),
        "requests_with_other_tokens": differ,
        "max_abs_logit_diff": diff,
        "smallest_top2_margin": margin,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=60)
    parser.add_argument("--max-batch", type=int, default=8)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    scratch = Path(tempfile.mkdtemp(prefix="lmsp-exactness-"))
    models: dict[str, tuple[Path, str]] = {}
    for size in ("demo", "small"):
        build_demo_model(scratch / size, size=size)
        models[f"demo:{size}" if size != "demo" else "demo"] = (scratch / size, "model.onnx")
    models["qwen2-tiny"] = (FIXTURES / "qwen2-tiny", "model.onnx")
    models["llama-genai (GQA)"] = (FIXTURES / "llama-genai", "model.onnx")
    models["qwen2-community:fp16"] = (FIXTURES / "qwen2-community", "onnx/model_fp16.onnx")
    print(
        "| model | one call for all rows | requests | tokens | requests with other tokens "
        "| max abs logit diff | smallest top-2 margin |"
    )
    print("|---|---|---:|---:|---:|---:|---:|")
    for name, (folder, graph) in models.items():
        model = OnnxModel(folder, graph=graph, device="cpu", intra_op_threads=1)
        try:
            row = measure(name, model, requests=args.requests, max_batch=args.max_batch, seed=args.seed)
        finally:
            model.close()
        print(
            f"| {row['model']} | {'yes' if row['batched'] else 'no'} | {row['requests']} | {row['tokens']} | "
            f"{row['requests_with_other_tokens']} | {row['max_abs_logit_diff']:.2e} | "
            f"{row['smallest_top2_margin']:.2e} |",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
