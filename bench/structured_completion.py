"""How often the quick start's model finishes a structured answer (issue 41, point 3), through the real service.

The services of ``bench/concurrency.py`` (the Procfile's web line, a worker of
the threads pool, a SQLite file, Redis) on ``demo``. For each seed, four
requests at ``temperature`` 1 with a limit of 200 tokens:

* **schema**: a ``json_schema`` answer with a framework's default schema, the
  one pydantic writes for a model with a ``str`` and an ``int`` field
  (``additionalProperties`` unset), on Responses (``text.format``) and Chat
  Completions (``response_format``);
* **tool**: a forced call (``tool_choice`` naming the one function, whose
  parameters are a string and an integer), on both APIs.

One counts as complete when its status is ``completed`` (Chat:
``finish_reason`` ``stop`` / ``tool_calls``) and its JSON parses and has
exactly the schema's keys, of the schema's types. Goal: at least 95 % of
100 seeds for each of the four. Nothing is asserted here; the test at CI size
is ``tests/test_structured_completion.py``.

    .venv/bin/python bench/structured_completion.py [--seeds 100] [--limit 200] [--parallel 8]
"""

from __future__ import annotations

import argparse
import json
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))

from concurrency import Service, log

# What pydantic (2.x) writes for ``class Person(BaseModel): name: str; age: int``.
PERSON = {
    "properties": {"name": {"title": "Name", "type": "string"}, "age": {"title": "Age", "type": "integer"}},
    "required": ["name", "age"],
    "title": "Person",
    "type": "object",
}
WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
    "required": ["city", "days"],
}
TOOL = {"name": "get_weather", "description": "The weather forecast for a city", "parameters": WEATHER}
QUESTION = "Alice is 31 and lives in Paris. Who is she, and what is the weather there this week?"


def matches(text: str | None, schema: dict[str, Any]) -> bool:
    """Whether ``text`` is a JSON object with exactly the schema's keys, each of its type."""
    try:
        value = json.loads(text or "")
    except ValueError:
        return False
    types = {"string": str, "integer": int}
    if not isinstance(value, dict) or set(value) != set(schema["properties"]):
        return False
    return all(
        isinstance(value[key], types[spec["type"]]) and not isinstance(value[key], bool)
        for key, spec in schema["properties"].items()
    )


def responses_request(kind: str, seed: int, limit: int) -> dict[str, Any]:
    body: dict[str, Any] = {"model": "demo", "input": QUESTION, "seed": seed, "max_output_tokens": limit}
    if kind == "schema":
        body["text"] = {"format": {"type": "json_schema", "name": "Person", "schema": PERSON}}
    else:
        body["tools"] = [{"type": "function", **TOOL}]
        body["tool_choice"] = {"type": "function", "name": TOOL["name"]}
    return body


def chat_request(kind: str, seed: int, limit: int) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": "demo",
        "messages": [{"role": "user", "content": QUESTION}],
        "seed": seed,
        "max_tokens": limit,
    }
    if kind == "schema":
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "Person", "schema": PERSON}}
    else:
        body["tools"] = [{"type": "function", "function": TOOL}]
        body["tool_choice"] = {"type": "function", "function": {"name": TOOL["name"]}}
    return body


def outcome(api: str, kind: str, body: dict[str, Any]) -> tuple[bool, int, str]:
    """(complete, output tokens, what it wrote) of one answer."""
    if api == "responses":
        tokens = (body.get("usage") or {}).get("output_tokens", 0)
        items = body.get("output") or []
        if kind == "schema":
            texts = [p.get("text", "") for i in items if i.get("type") == "message" for p in i.get("content", [])]
            text = "".join(texts)
            return body.get("status") == "completed" and matches(text, PERSON), tokens, text
        calls = [i for i in items if i.get("type") == "function_call"]
        text = " ".join(c.get("arguments", "") for c in calls)
        good = (
            body.get("status") == "completed" and bool(calls) and all(matches(c["arguments"], WEATHER) for c in calls)
        )
        return good, tokens, text
    tokens = (body.get("usage") or {}).get("completion_tokens", 0)
    choice = (body.get("choices") or [{}])[0]
    message = choice.get("message") or {}
    if kind == "schema":
        text = message.get("content") or ""
        return choice.get("finish_reason") == "stop" and matches(text, PERSON), tokens, text
    calls = message.get("tool_calls") or []
    text = " ".join(c["function"]["arguments"] for c in calls)
    good = (
        choice.get("finish_reason") == "tool_calls"
        and bool(calls)
        and all(matches(c["function"]["arguments"], WEATHER) for c in calls)
    )
    return good, tokens, text


def run(base_url: str, token: str, *, seeds: int, limit: int, parallel: int) -> dict[str, dict[str, Any]]:
    """Every (api, kind) over ``seeds`` seeds: how many complete, their mean length, a few that did not."""
    headers = {"Authorization": f"Bearer {token}"}
    jobs = [(api, kind, seed) for api in ("responses", "chat") for kind in ("schema", "tool") for seed in range(seeds)]

    def one(job: tuple[str, str, int]) -> tuple[str, str, bool, int, str]:
        api, kind, seed = job
        if api == "responses":
            path, request = "/lmsp/v1/responses", responses_request(kind, seed, limit)
        else:
            path, request = "/lmsp/v1/chat/completions", chat_request(kind, seed, limit)
        with httpx.Client(base_url=base_url, headers=headers, timeout=300) as client:
            response = client.post(path, json=request)
        if response.status_code != 200:
            return api, kind, False, 0, f"HTTP {response.status_code}: {response.text[:200]}"
        return api, kind, *outcome(api, kind, response.json())

    results: dict[str, dict[str, Any]] = {}
    with ThreadPoolExecutor(max_workers=parallel) as pool:
        for api, kind, good, tokens, text in pool.map(one, jobs):
            entry = results.setdefault(f"{api} {kind}", {"complete": 0, "runs": 0, "tokens": [], "failed": []})
            entry["runs"] += 1
            if good:
                entry["complete"] += 1
                entry["tokens"].append(tokens)
            elif len(entry["failed"]) < 3:
                entry["failed"].append(text[:160])
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=100)
    parser.add_argument("--limit", type=int, default=200, help="max_output_tokens / max_tokens")
    parser.add_argument("--parallel", type=int, default=8, help="requests in flight (and the worker's rows)")
    parser.add_argument("--threads", type=int, default=1, help="the worker's intra-op threads")
    args = parser.parse_args()

    service = Service(argparse.Namespace(threads=args.threads, device="cpu"))
    try:
        service.manage("migrate", "-v0")
        out = service.manage("lmsp_build_demo_model")
        if "registered demo" not in out:
            raise RuntimeError(f"lmsp_build_demo_model did not register demo:\n{out}")
        service.token = service.manage("lmsp_client", "create", "bench", "--scopes", "responses,read").strip()
        service.start_web("structured")
        service.use_worker("threads", args.parallel, args.parallel)
        log(f"{args.seeds} seeds, limit {args.limit} tokens, {args.parallel} in flight")
        results = run(service.base_url, service.token, seeds=args.seeds, limit=args.limit, parallel=args.parallel)
    finally:
        service.stop_all()
    print(f"\n{'what':<18} | complete | share  | mean output tokens of the complete")
    for name, entry in results.items():
        share = entry["complete"] / entry["runs"]
        mean = sum(entry["tokens"]) / len(entry["tokens"]) if entry["tokens"] else 0
        print(f"{name:<18} | {entry['complete']:>4}/{entry['runs']:<3} | {share:6.1%} | {mean:.0f}")
    for name, entry in results.items():
        for text in entry["failed"]:
            print(f"  not complete, {name}: {text!r}")


if __name__ == "__main__":
    main()
