"""One generation through each protocol (issue 43): what an adapter costs a client, and count_tokens.

The services of ``bench/concurrency.py`` (the Procfile's web line, one worker
of the threads pool, a SQLite file, Redis) on the demo model. The same prompt
and the same number of tokens, one request at a time, streamed as each
protocol's client asks for it, the protocols taking turns (so that drift of
the machine falls on all alike):

* **lmsp**: ``POST /lmsp/v1/responses`` with ``stream: true``;
* **chat**: ``POST /lmsp/v1/chat/completions`` with ``stream: true``;
* **anthropic**: ``POST /lmsp/v1/messages`` with ``stream: true`` (the prompt is counted at accept);
* **ollama**: ``POST /api/chat`` (NDJSON, streamed by default).

For each: client TTFT (send to the first text delta) and the whole request,
median and p90. Then ``count_tokens`` on a Claude-Code-sized prompt (about
14,000 tokens): the first call (the web process loads the tokenizer) and the
median of later ones; and a Messages request of that size, its
``message_start`` against a Responses request's ``response.created``.
Nothing is asserted.

    .venv/bin/python bench/protocols.py [--repeats 10] [--tokens 32] [--long-tokens 14000]
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))

from concurrency import Service, endless_folder, endless_name, log, long_prompt_text

PROMPT = "Tell me about the sea."


def _lmsp(model: str, text: str, tokens: int) -> tuple[str, dict]:
    return "/lmsp/v1/responses", {"model": model, "input": text, "max_output_tokens": tokens, "stream": True}


def _chat(model: str, text: str, tokens: int) -> tuple[str, dict]:
    messages = [{"role": "user", "content": text}]
    return "/lmsp/v1/chat/completions", {"model": model, "messages": messages, "max_tokens": tokens, "stream": True}


def _anthropic(model: str, text: str, tokens: int) -> tuple[str, dict]:
    messages = [{"role": "user", "content": text}]
    return "/lmsp/v1/messages", {"model": model, "messages": messages, "max_tokens": tokens, "stream": True}


def _ollama(model: str, text: str, tokens: int) -> tuple[str, dict]:
    messages = [{"role": "user", "content": text}]
    return "/api/chat", {"model": model, "messages": messages, "options": {"num_predict": tokens}}


def _is_lmsp_text(line: str) -> bool:
    return line == "event: response.output_text.delta"


def _is_chat_text(line: str) -> bool:
    return line.startswith("data: {") and '"content":"' in line and '"content":""' not in line


def _is_anthropic_text(line: str) -> bool:
    return line == "event: content_block_delta"


def _is_ollama_text(line: str) -> bool:
    return line.startswith("{") and bool(json.loads(line).get("message", {}).get("content"))


PROTOCOLS: dict[str, tuple[Callable[[str, str, int], tuple[str, dict]], Callable[[str], bool]]] = {
    "lmsp": (_lmsp, _is_lmsp_text),
    "chat": (_chat, _is_chat_text),
    "anthropic": (_anthropic, _is_anthropic_text),
    "ollama": (_ollama, _is_ollama_text),
}


def timed_stream(http: httpx.Client, path: str, body: dict, first: Callable[[str], bool]) -> tuple[float, float]:
    """Seconds to the first line ``first`` accepts, and to the end of the answer."""
    started = time.perf_counter()
    ttft = None
    with http.stream("POST", path, json=body) as reply:
        if reply.status_code != 200:
            raise RuntimeError(f"POST {path} -> {reply.status_code}: {reply.read()[:500]!r}")
        for line in reply.iter_lines():
            if ttft is None and first(line):
                ttft = time.perf_counter() - started
    if ttft is None:
        raise RuntimeError(f"POST {path}: no text came")
    return ttft, time.perf_counter() - started


def first_line(http: httpx.Client, path: str, body: dict, wanted: str) -> float:
    """Seconds to the line ``wanted`` (the stream's first event), then the request is left (and cancelled)."""
    started = time.perf_counter()
    with http.stream("POST", path, json=body) as reply:
        for line in reply.iter_lines():
            if line == wanted:
                return time.perf_counter() - started
    raise RuntimeError(f"POST {path}: no {wanted!r}")


def figures(values: list[float]) -> str:
    ordered = sorted(values)
    p90 = ordered[min(len(ordered) - 1, int(len(ordered) * 0.9))]
    return f"median {statistics.median(ordered) * 1000:7.1f} ms  p90 {p90 * 1000:7.1f} ms"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--long-tokens", type=int, default=14_000, help="the count_tokens prompt's size")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()

    svc = Service(SimpleNamespace(threads=args.threads, device="cpu"))
    try:
        svc.prepare_models(["demo"])
        model = endless_name("demo")
        svc.start_web("web")
        svc.use_worker("threads", 4, 8)
        headers = {"Authorization": f"Bearer {svc.token}", "anthropic-version": "2023-06-01"}
        with httpx.Client(base_url=svc.base_url, headers=headers, timeout=300) as http:
            for build, first in PROTOCOLS.values():  # warm each path once
                timed_stream(http, *build(model, PROMPT, 4), first)
            ttfts: dict[str, list[float]] = {name: [] for name in PROTOCOLS}
            wholes: dict[str, list[float]] = {name: [] for name in PROTOCOLS}
            for _ in range(args.repeats):
                for name, (build, first) in PROTOCOLS.items():
                    ttft, whole = timed_stream(http, *build(model, PROMPT, args.tokens), first)
                    ttfts[name].append(ttft)
                    wholes[name].append(whole)
            print(f"one request at a time, {args.tokens} tokens of {model}, {args.repeats} each (client side):")
            for name in PROTOCOLS:
                print(f"  {name:9s}  TTFT {figures(ttfts[name])}   whole {figures(wholes[name])}")

            text = long_prompt_text(endless_folder(svc.models_dir, "demo"), args.long_tokens)
            count_body = {"model": model, "messages": [{"role": "user", "content": text}]}
            started = time.perf_counter()
            counted = http.post("/lmsp/v1/messages/count_tokens", json=count_body).json()["input_tokens"]
            cold = time.perf_counter() - started
            later = []
            for _ in range(args.repeats):
                started = time.perf_counter()
                http.post("/lmsp/v1/messages/count_tokens", json=count_body).raise_for_status()
                later.append(time.perf_counter() - started)
            print(f"count_tokens of a {counted}-token prompt: first {cold * 1000:.1f} ms, then {figures(later)}")
            starts = {"lmsp": [], "anthropic": []}
            for _ in range(args.repeats):
                path, body = _lmsp(model, text, 1)
                starts["lmsp"].append(first_line(http, path, body, "event: response.created"))
                path, body = _anthropic(model, text, 1)
                starts["anthropic"].append(first_line(http, path, body, "event: message_start"))
            print(f"first event of a {counted}-token request (accept, and for Messages the count):")
            print(f"  lmsp       response.created  {figures(starts['lmsp'])}")
            print(f"  anthropic  message_start     {figures(starts['anthropic'])}")
        return 0
    except Exception as exc:
        log(f"bench failed: {type(exc).__name__}: {exc}\nweb log:\n{svc.tail('web.log')}")
        return 1
    finally:
        svc.stop_all()
        svc.cleanup_redis()
        shutil.rmtree(svc.tmp, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
