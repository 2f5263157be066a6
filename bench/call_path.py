"""What a reader follows from ``POST /lmsp/v1/tasks`` to a task's terminal event.

Runs one task in this process: the POST through Django's test client (the
whole middleware and DRF stack), then the worker's ``task_execute`` with the
demo model, and records every call into the project's own code
(``sys.setprofile``). Prints the project functions that ran, grouped by
module, and how many of each; with ``--writes``, the chain of calls that led
to each UPDATE or INSERT of ``tasks``/``task_events`` (the hops between the
caller that decides a move and the statement that makes it).

    .venv/bin/python bench/call_path.py [--tokens 40] [--writes]

Works on any commit with ``task_execute(task_id=, worker=)``, so two versions
can be compared (run it from a worktree of the other commit).
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from pathlib import Path
from typing import Any

from scratch import REPO, demo_model_register, django_in_scratch

PACKAGES = ("tasks_app", "workers", "lmsp_project", "fixture_models")


def _project_module(filename: str) -> str | None:
    path = Path(filename)
    try:
        relative = path.resolve().relative_to(REPO)
    except ValueError:
        return None
    if relative.parts[0] not in PACKAGES or "migrations" in relative.parts:
        return None
    return ".".join(relative.with_suffix("").parts)


def _module_of(name: str) -> str:
    module, _, _ = name.partition(".<")
    parts = module.split(".")
    # A qualname may hold a class: the module is the longest prefix that is one.
    for end in range(len(parts), 0, -1):
        if ".".join(parts[:end]) in sys.modules:
            return ".".join(parts[:end])
    return module


def _short(name: str) -> str:
    return name[len(_module_of(name)) + 1 :]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=40)
    parser.add_argument("--writes", action="store_true", help="show the call chain of each state write")
    args = parser.parse_args()

    scratch = django_in_scratch("callpath")
    from django.db import connection
    from django.test import Client as HttpClient

    from tasks_app.services.clients import client_create
    from workers.execution import task_execute

    demo_model_register(scratch)
    _, token = client_create(name="bench", scopes="responses,read")
    http = HttpClient(HTTP_AUTHORIZATION=f"Bearer {token}")
    body = {
        "type": "response",
        "input": {"model": "demo", "input": "Hello", "max_output_tokens": args.tokens, "seed": 1},
    }
    # Warm imports and the model cache, so the trace shows the path, not first-time setup.
    warm = http.post("/lmsp/v1/tasks", body, content_type="application/json").json()["id"]
    task_execute(task_id=warm, worker="bench/0")

    calls: Counter[tuple[str, str]] = Counter()
    stack: list[str] = []
    chains: list[tuple[str, ...]] = []

    def profile(frame: Any, event: str, arg: Any) -> None:
        if event == "call":
            module = _project_module(frame.f_code.co_filename)
            # Comprehensions and generator expressions are frames, not functions a reader follows.
            if frame.f_code.co_name.startswith("<"):
                module = None
            name = f"{module}.{frame.f_code.co_qualname}" if module else None
            if module:
                calls[(module, frame.f_code.co_qualname)] += 1
            stack.append(name or "")
        elif event == "return" and stack:
            stack.pop()

    def statement(execute: Any, sql: str, params: Any, many: bool, context: Any) -> Any:
        head = sql.lstrip()[:40].upper()
        if head.startswith(('UPDATE "TASKS"', 'INSERT INTO "TASK_EVENTS"')):
            chains.append(tuple(name for name in stack if name))
        return execute(sql, params, many, context)

    with connection.execute_wrapper(statement):
        sys.setprofile(profile)
        try:
            reply = http.post("/lmsp/v1/tasks", body, content_type="application/json")
            task_execute(task_id=reply.json()["id"], worker="bench/1")
        finally:
            sys.setprofile(None)

    modules = Counter(module for module, _ in calls)
    print(f"{len(calls)} project functions in {len(modules)} modules ran from POST to the terminal event")
    for module, count in sorted(modules.items()):
        functions = sorted(name for mod, name in calls if mod == module)
        print(f"  {module} ({count}): {', '.join(functions)}")
    if args.writes:
        print("\nstate writes (outermost project caller -> statement):")
        seen: set[tuple[str, ...]] = set()
        for chain in chains:
            if chain in seen:
                continue
            seen.add(chain)
            start = next((i for i, name in enumerate(chain) if name.startswith("workers.execution")), 0)
            hops = chain[start:]
            files = len({_module_of(name) for name in hops})
            print(f"  {len(hops)} calls in {files} modules: {' -> '.join(_short(name) for name in hops)}")


if __name__ == "__main__":
    main()
