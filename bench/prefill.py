"""Prefill cost: the time from prompt ids to the first logits row, per prompt length.

Issue 15 changed how a prompt goes in: before, the prompt minus its last
token in chunks, then the last token alone (two calls for a short prompt);
now the whole prompt (or each chunk) in one call, with only the last logits
row taken off the device by a tiny graph. Run this on two checkouts to
compare; it uses only the backend's public interface, which both have.

    .venv/bin/python bench/prefill.py [--size base] [--lengths 16,128,500] [--repeat 20]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from fixture_models.demo import build_demo_model  # noqa: E402
from workers.backends.onnx import OnnxRuntimeBackend  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="base", help="demo model size (demo, small, base)")
    parser.add_argument("--lengths", default="16,128,500", help="prompt lengths in tokens")
    parser.add_argument("--repeat", type=int, default=20)
    parser.add_argument("--threads", type=int, default=1, help="intra-op threads")
    args = parser.parse_args()

    folder = Path(tempfile.mkdtemp(prefix="lmsp-prefill-")) / "model"
    build_demo_model(folder, size=args.size)
    model = OnnxRuntimeBackend().load(folder, device="cpu", prefill_chunk=512, intra_op_threads=args.threads)
    vocab = model.tokenizer.get_vocab_size(with_added_tokens=True)
    print(f"model {args.size}, {args.threads} thread(s), median of {args.repeat} runs")
    print("prompt tokens | prefill ms (median) | p90 ms")
    for length in (int(n) for n in args.lengths.split(",")):
        ids = [(i * 7919) % (vocab - 16) + 8 for i in range(length)]
        model.decoder().feed(ids)  # warm-up: first run of this shape
        times = []
        for _ in range(args.repeat):
            decoder = model.decoder()
            started = time.perf_counter()
            decoder.feed(ids)
            times.append((time.perf_counter() - started) * 1000)
        times.sort()
        p90 = times[int(len(times) * 0.9) - 1]
        print(f"{length:>13} | {statistics.median(times):>19.2f} | {p90:.2f}")


if __name__ == "__main__":
    main()
