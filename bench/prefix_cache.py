"""An agent conversation with and without the prefix cache (issue 29).

Runs the service as the Procfile does (web, one threads-pool worker) on
``demo:base`` (``demo:base-endless``: it never ends early), greedy. A
conversation has a long system and tools prefix (``--prefix-tokens``, 2,000)
as ``instructions`` and ``--turns`` turns of about ``--turn-tokens`` new
tokens each; every turn streams (the openai SDK, ``stream=True``) and the
client's time to the first text delta is its TTFT. Measured:

- the chained conversation (``previous_response_id``, instructions sent on
  every turn as openai-agents does) and the echoed one (the whole history
  sent back as input items), with the cache on;
- each turn's new tokens alone (a request of only them): the goal is a
  turn's TTFT <= 1.3x that, from turn 2 on;
- the same two conversations with ``LMSP_PREFIX_CACHE=0``: every turn's
  text must equal the cached run's;
- ``--concurrent`` chained conversations at once on the one worker.

Each conversation has a prefix of its own (a different first sentence), so
no conversation hits another's cache.

    .venv/bin/python bench/prefix_cache.py [--turns 10] [--prefix-tokens 2000] [--concurrent 8] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import openai
from concurrency import Service, endless_folder, endless_name, long_prompt_text
from sse_fanout import HOST, log

SIZE = "base"


def ttft_turn(sdk: openai.OpenAI, model: str, **request: Any) -> dict[str, Any]:
    """One streamed response: the client's TTFT, the text, and the usage it ended with."""
    sent = time.perf_counter()
    first: float | None = None
    text: list[str] = []
    usage = None
    response_id = None
    with sdk.responses.create(model=model, stream=True, temperature=0, **request) as stream:
        for event in stream:
            if event.type == "response.output_text.delta":
                if first is None:
                    first = time.perf_counter()
                text.append(event.delta)
            elif event.type in ("response.completed", "response.incomplete"):
                usage = event.response.usage
                response_id = event.response.id
            elif event.type in ("response.failed", "error"):
                raise RuntimeError(f"the response failed: {event}")
    assert first is not None and usage is not None
    return {
        "id": response_id,
        "ttft_ms": round((first - sent) * 1000, 1),
        "text": "".join(text),
        "input_tokens": usage.input_tokens,
        "cached_tokens": usage.input_tokens_details.cached_tokens,
        "output_tokens": usage.output_tokens,
    }


def turn_texts(folder: Path, turns: int, tokens: int) -> list[str]:
    body = long_prompt_text(folder, tokens)
    words = body.split()
    # Each turn its own words: rotate the text so no two turns start alike.
    return [
        f"Question {n + 1}: " + " ".join(words[(7 * n) % len(words) :] + words[: (7 * n) % len(words)])
        for n in range(turns)
    ]


def conversation(
    sdk: openai.OpenAI, model: str, prefix: str, turns: list[str], *, echoed: bool, tokens: int
) -> list[dict[str, Any]]:
    """``turns`` in one conversation: chained by ``previous_response_id``, or with the history echoed."""
    done: list[dict[str, Any]] = []
    history: list[dict[str, str]] = []
    previous: str | None = None
    for text in turns:
        request: dict[str, Any] = {"instructions": prefix, "max_output_tokens": tokens}
        if echoed:
            request["input"] = [*history, {"role": "user", "content": text}]
        else:
            request["input"] = text
            if previous is not None:
                request["previous_response_id"] = previous
        turn = ttft_turn(sdk, model, **request)
        history += [{"role": "user", "content": text}, {"role": "assistant", "content": turn["text"]}]
        previous = turn["id"]
        done.append(turn)
    return done


def at_once(count: int, run: Any) -> list[Any]:
    """``run(n)`` for n in 0..count-1, each in a thread of its own; their results in order."""
    results: list[Any] = [None] * count

    def one(index: int) -> None:
        results[index] = run(index)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return results


def summary(turns: list[dict[str, Any]], alone: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    later = turns[1:]
    out: dict[str, Any] = {
        "ttft_ms": [t["ttft_ms"] for t in turns],
        "input_tokens": [t["input_tokens"] for t in turns],
        "cached_tokens": [t["cached_tokens"] for t in turns],
        "later_ttft_p50_ms": round(statistics.median(t["ttft_ms"] for t in later), 1) if later else None,
        "hit_share": round(sum(t["cached_tokens"] for t in later) / max(1, sum(t["input_tokens"] for t in later)), 3),
    }
    if alone is not None:
        ratios = [t["ttft_ms"] / a["ttft_ms"] for t, a in zip(later, alone[1:], strict=True)]
        out["ratio_to_new_tokens_alone"] = [round(r, 2) for r in ratios]
        out["ratio_max"] = round(max(ratios), 2) if ratios else None
        out["goal_met"] = bool(ratios) and max(ratios) <= 1.3
    return out


def two_workers(svc: Service, sdk: openai.OpenAI, model: str, prefix: Any, turns: list[str], args: Any) -> dict:
    """``--two-workers`` chained conversations at once on two workers (the Procfile's, named apart), with
    the web routing continued turns to the worker of the turn before (``LMSP_AFFINITY``) and without."""
    svc.stop_worker()
    svc.env["LMSP_PREFIX_CACHE"] = "1"
    svc.worker_config = None
    svc.use_worker("threads", args.worker_threads, None)
    second_command = svc.worker_commands[-1].replace('--hostname "worker-', '--hostname "worker2-')
    second = svc._spawn(["bash", "-c", second_command], "worker-second.log")
    out: dict[str, Any] = {}
    try:
        for routed in ("1", "0"):
            svc.stop_web()
            svc.env["LMSP_AFFINITY"] = routed
            svc.start_web("web")
            log(f"two workers, routing {'on' if routed == '1' else 'off'}")
            base = 100 if routed == "1" else 200
            many = at_once(
                args.two_workers,
                lambda n, base=base: conversation(
                    sdk, model, prefix(base + n), turns, echoed=False, tokens=args.tokens
                ),
            )
            summaries = [summary(c) for c in many]
            later = [t for c in many for t in c[1:]]
            out["routed" if routed == "1" else "not_routed"] = {
                "hit_share": round(sum(t["cached_tokens"] for t in later) / sum(t["input_tokens"] for t in later), 3),
                "later_ttft_p50_ms": round(statistics.median(t["ttft_ms"] for t in later), 1),
                "later_ttft_ms_per_conversation": [s["ttft_ms"][1:] for s in summaries],
            }
    finally:
        svc._stop(second)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--turns", type=int, default=10)
    parser.add_argument("--prefix-tokens", type=int, default=2000)
    parser.add_argument("--turn-tokens", type=int, default=100)
    parser.add_argument("--tokens", type=int, default=32, help="output tokens per turn")
    parser.add_argument("--concurrent", type=int, default=8, help="conversations at once (0: skip)")
    parser.add_argument(
        "--two-workers", type=int, default=4, help="conversations at once on two workers, routed or not (0: skip)"
    )
    parser.add_argument("--worker-threads", type=int, default=4)
    parser.add_argument("--threads", type=int, default=1, help="LMSP_INTRA_OP_THREADS")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()

    svc = Service(SimpleNamespace(threads=args.threads, device="cpu"))
    report: dict[str, Any] = {"config": vars(args)}
    model = endless_name(SIZE)
    try:
        svc.prepare_models([SIZE])
        folder = endless_folder(svc.models_dir, SIZE)
        base_prefix = long_prompt_text(folder, args.prefix_tokens)
        turns = turn_texts(folder, args.turns, args.turn_tokens)

        def prefix(n: int) -> str:
            return f"You are assistant number {n}. {base_prefix}"

        svc.start_web("web")
        sdk = openai.OpenAI(base_url=f"http://{HOST}:{svc.port}/lmsp/v1", api_key=svc.token, max_retries=0, timeout=600)
        results: dict[str, list[dict[str, Any]]] = {}
        for cache in ("1", "0"):
            svc.stop_worker()
            svc.env["LMSP_PREFIX_CACHE"] = cache
            svc.worker_config = None
            svc.use_worker("threads", args.worker_threads, None)
            ttft_turn(sdk, model, input="Warm up.", max_output_tokens=2)  # the model loads
            if cache == "1":
                # Each turn's new tokens alone (a template around them, no prefix, no history).
                results["new_tokens_alone"] = [
                    ttft_turn(sdk, model, input=t, max_output_tokens=args.tokens) for t in turns
                ]
            log(f"cache {'on' if cache == '1' else 'off'}: chained")
            results[f"chained_{cache}"] = conversation(sdk, model, prefix(1), turns, echoed=False, tokens=args.tokens)
            log(f"cache {'on' if cache == '1' else 'off'}: echoed")
            results[f"echoed_{cache}"] = conversation(sdk, model, prefix(2), turns, echoed=True, tokens=args.tokens)
            if cache == "1" and args.concurrent:
                log(f"{args.concurrent} conversations at once")
                many = at_once(
                    args.concurrent,
                    lambda n: conversation(sdk, model, prefix(10 + n), turns, echoed=False, tokens=args.tokens),
                )
                report["concurrent"] = [summary(c) for c in many]
        if args.two_workers:
            report["two_workers"] = two_workers(svc, sdk, model, prefix, turns[:6], args)
        alone = results["new_tokens_alone"]
        report["new_tokens_alone_ttft_ms"] = [t["ttft_ms"] for t in alone]
        for kind in ("chained", "echoed"):
            report[kind] = summary(results[f"{kind}_1"], alone)
            report[f"{kind}_cache_off"] = summary(results[f"{kind}_0"], alone)
            report[f"{kind}_same_text_as_cache_off"] = [
                a["text"] == b["text"] for a, b in zip(results[f"{kind}_1"], results[f"{kind}_0"], strict=True)
            ]
        print(json.dumps(report, indent=1))
        if args.json:
            Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
        return 0
    except Exception as exc:
        log(f"benchmark failed: {type(exc).__name__}: {exc}\nworker log:\n{svc.tail(f'worker{svc.worker_starts}.log')}")
        return 1
    finally:
        svc.stop_all()
        svc.cleanup_redis()
        shutil.rmtree(svc.tmp, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
