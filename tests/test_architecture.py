"""The layering rules, read from the source: who may write task state, who imports whom,
and where the vocabulary lives. Each rule names the lines that break it."""

from __future__ import annotations

import ast
import functools
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tasks_app.events import EventType

# No database of the pass here: the PostgreSQL pass of scripts/test leaves these out (tests/conftest.py).
pytestmark = pytest.mark.database_free

REPO = Path(__file__).resolve().parent.parent
PACKAGES = ("tasks_app", "workers", "lmsp_project", "fixture_models")
# The lifecycle and the modules it is made of: the verbs, their compare-and-set, recovery's moves, the log's
# rows, the attempt log.
LIFECYCLE = frozenset(
    REPO / "tasks_app" / "core" / f"{name}.py"
    for name in ("lifecycle", "transitions", "recovery_moves", "log_rows", "attempt_log")
)
STATE_MODELS = {"Task", "TaskEvent", "TaskSnapshot", "Response", "TaskAttempt"}
WRITES = {"update", "create", "bulk_create", "get_or_create", "update_or_create", "bulk_update"}


def sources() -> Iterator[tuple[Path, ast.Module]]:
    return iter(_parsed_sources())


@functools.cache
def _parsed_sources() -> tuple[tuple[Path, ast.Module], ...]:
    # Parsed once for the file's eleven tests (ast.parse of every module was most of the file's 15 s of CPU);
    # no test changes a tree.
    return tuple(
        (path, ast.parse(path.read_text(), filename=str(path)))
        for package in PACKAGES
        for path in sorted((REPO / package).rglob("*.py"))
        if "migrations" not in path.parts
    )


def where(path: Path, node: ast.AST) -> str:
    return f"{path.relative_to(REPO)}:{node.lineno}"


def _receiver_models(node: ast.expr) -> set[str]:
    """The names a call chain starts from (``Task`` in ``Task.objects.filter(...).update``)."""
    while True:
        if isinstance(node, ast.Attribute):
            node = node.value
        elif isinstance(node, ast.Call):
            node = node.func
        elif isinstance(node, ast.Subscript):
            node = node.value
        else:
            return {node.id} if isinstance(node, ast.Name) else set()


def test_only_the_lifecycle_writes_tasks_events_snapshots_responses_and_attempts():
    assert all(path.is_file() for path in LIFECYCLE)
    found = []
    for path, tree in sources():
        if path in LIFECYCLE:
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in WRITES:
                if _receiver_models(node.func.value) & STATE_MODELS:
                    found.append(where(path, node))
    assert found == []


def test_the_checker_sees_a_write_outside_the_lifecycle():
    tree = ast.parse("Task.objects.filter(pk=1).update(status='failed')\nTaskEvent.objects.bulk_create([])\n")
    calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call) and getattr(n.func, "attr", None) in WRITES]
    assert [_receiver_models(call.func.value) for call in calls] == [{"Task"}, {"TaskEvent"}]


# The one door (docs/decisions/0014): a web process counts a prompt's tokens with the worker's own renderer.
WEB_DOOR_INTO_WORKERS = "workers.prompt_counts"


def test_tasks_app_imports_no_worker_module_but_the_prompt_counter_and_only_from_an_adapter():
    found = []
    for path, tree in sources():
        if not path.is_relative_to(REPO / "tasks_app"):
            continue
        adapter = wing_of(module_name(path)) in ADAPTERS
        for node in ast.walk(tree):
            names = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            into_workers = [name for name in names if name == "workers" or name.startswith("workers.")]
            if any(name != WEB_DOOR_INTO_WORKERS or not adapter for name in into_workers):
                found.append(where(path, node))
    assert found == []


def test_no_worker_code_uses_the_fixture_model_builders():
    found = [
        where(path, node)
        for path, tree in sources()
        if path.is_relative_to(REPO / "workers")
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("fixture_models")
    ]
    assert found == []


@pytest.mark.parametrize("module", ["lmsp_project.celery"])
def test_only_the_broker_module_imports_the_celery_app(module):
    found = [
        where(path, node)
        for path, tree in sources()
        if path.is_relative_to(REPO / "tasks_app") or path.is_relative_to(REPO / "workers")
        if path != REPO / "tasks_app" / "plumbing" / "broker.py"
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom) and node.module == module
    ]
    assert found == []


def test_event_type_strings_live_in_the_events_module():
    types = {member.value for member in EventType}
    found = [
        where(path, node)
        for path, tree in sources()
        if path != REPO / "tasks_app" / "events.py"
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant) and node.value in types
    ]
    assert found == []


def test_groups_of_statuses_are_named_in_the_states_module():
    """No other module spells out a set of two or more statuses; it names a group of ``states``."""
    members = {"QUEUED", "LOADING", "RUNNING", "CANCELLING", "SUCCEEDED", "FAILED", "CANCELLED"}
    found = []
    for path, tree in sources():
        if path == REPO / "tasks_app" / "states.py":
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Set | ast.Tuple | ast.List):
                statuses = [
                    e for e in node.elts if isinstance(e, ast.Attribute) and e.attr in members and _is_status(e.value)
                ]
                if len(statuses) >= 2:
                    found.append(where(path, node))
    assert found == []


def _is_status(node: ast.expr) -> bool:
    return isinstance(node, ast.Name) and node.id in {"S", "TaskStatus"}


def test_worker_code_opens_no_transaction_of_its_own():
    """A worker's only transactions are the lifecycle's verbs, each a few statements long: none spans a
    decode step, model I/O or a network call, so a frozen or slow worker never holds a lock while it
    computes (the Redis wake-up is sent after the commit, ``transaction.on_commit``)."""
    found = [
        where(path, node)
        for path, tree in sources()
        if path.is_relative_to(REPO / "workers")
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute) and node.attr in {"atomic", "select_for_update", "set_autocommit"}
    ]
    assert found == []


def test_the_lifecycle_reaches_redis_only_after_the_commit():
    imported = {
        alias.name
        for path in LIFECYCLE
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.ImportFrom)
        for alias in node.names
    }
    assert {"redis_client", "publish", "broker"}.isdisjoint(imported)
    assert {"task_changed_on_commit", "tasks_changed_on_commit"} <= imported


def test_starting_a_web_or_worker_process_imports_no_inference_library():
    """ONNX Runtime, numpy and llguidance load with the first model or the first structured request,
    never at a process's start: the suite starts hundreds of processes, and a user's web process never
    needs them (docs/decisions/0003-a-test-run-bound-by-its-cpu.md)."""
    probe = (
        "import os, sys; os.environ.setdefault('DJANGO_SETTINGS_MODULE', 'lmsp_project.settings');"
        "import django; django.setup();"
        "import lmsp_project.asgi, lmsp_project.celery, workers.tasks;"
        "print(sorted(m for m in ('onnxruntime', 'numpy', 'llguidance', 'tokenizers') if m in sys.modules))"
    )
    env = {**os.environ, "DATABASE_URL": "sqlite:///:memory:"}
    shown = subprocess.run([sys.executable, "-c", probe], cwd=REPO, env=env, capture_output=True, text=True, check=True)
    assert shown.stdout.strip() == "[]"


def test_the_engine_process_imports_no_django_celery_or_redis():
    """The engine process (docs/workers.md) holds the models and their model threads and nothing else: no
    module of the worker's side (the commits, Celery, Redis) may reach it, or its GIL is shared again."""
    probe = (
        "import sys, workers.engine_process.host;"
        "print(sorted(m for m in ('django', 'celery', 'kombu', 'redis') if m in sys.modules))"
    )
    shown = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True, check=True)
    assert shown.stdout.strip() == "[]"


def test_counting_a_prompt_in_a_web_process_loads_no_onnx_runtime(demo_models_root):
    """The web's ``count_tokens`` and context check (decision 0014) read the tokenizer and the template
    only: the runtime, and the memory it takes, stay out of the web process."""
    probe = (
        "import os, sys, pathlib; os.environ.setdefault('DJANGO_SETTINGS_MODULE', 'lmsp_project.settings');"
        "import django; django.setup();"
        "from workers.backends.base import Prompt;"
        "from workers.backends.onnx.prompt_text import PromptText;"
        f"text = PromptText.of_folder(pathlib.Path({str(demo_models_root / 'demo')!r}));"
        "ids = text.ids(Prompt.of_text('Hello', system='Be brief.'));"
        "print(len(ids) > 0, sorted(m for m in ('onnxruntime', 'onnx') if m in sys.modules))"
    )
    env = {**os.environ, "DATABASE_URL": "sqlite:///:memory:"}
    shown = subprocess.run([sys.executable, "-c", probe], cwd=REPO, env=env, capture_output=True, text=True, check=True)
    assert shown.stdout.strip() == "True []"


# --------------------------------------------------------------------------- #
# The wings, and which way they import (docs/architecture.md)
# --------------------------------------------------------------------------- #

# tasks_app's top level: the data model and its vocabulary, which every wing may read.
DATA_MODULES = {"models", "states", "fields", "ids", "exceptions", "model_layouts", "faults", "events", "db"}
# What each wing may import, besides itself. The protocol adapters (the edge, LMSP's own API, the OpenAI
# surface, the admin, the commands, the project's wiring) stand on the rest and may use each other; nothing
# below them imports one, the core imports no service, the generation spec knows no protocol and the runtimes
# know neither tasks nor protocols.
BELOW = {
    "data": set(),
    "generation": {"data"},
    "metrics": {"data", "plumbing"},
    "plumbing": {"data", "metrics", "project"},
    "registry": {"data"},
    "core": {"data", "generation", "plumbing"},
    "selectors": {"data", "core", "generation", "plumbing"},
    "services": {"data", "core", "generation", "plumbing", "metrics", "selectors", "registry"},
    "runtime": set(),
    "worker": {"data", "core", "generation", "plumbing", "metrics", "selectors", "services", "runtime"},
}
ADAPTERS = {"edge", "api", "openai", "anthropic", "ollama", "admin", "commands", "app", "project"}
# project: lmsp_project's settings, URLs and servers; plumbing's broker owns the one Celery app it defines.


def module_name(path: Path) -> str:
    name = ".".join(path.relative_to(REPO).with_suffix("").parts)
    return name.removesuffix(".__init__")


def wing_of(module: str) -> str:
    parts = module.split(".")
    if parts[0] == "lmsp_project":
        return "project"
    if parts[0] == "workers":
        return "runtime" if parts[1:2] == ["backends"] else "worker"
    if parts[0] == "fixture_models":
        return "fixtures"
    if len(parts) == 1 or parts[1] == "apps":
        return "app"
    if parts[1] in DATA_MODULES:
        return "data"
    return {"management": "commands"}.get(parts[1], parts[1])


def imported_modules(path: Path, tree: ast.Module, known: set[str]) -> Iterator[tuple[ast.AST, str]]:
    """Every module of ours that ``path`` imports, at any depth (a function's import too), named as the
    longest known module it reaches (``from tasks_app.core import lifecycle`` is ``tasks_app.core.lifecycle``)."""
    package = module_name(path).split(".")
    if path.name != "__init__.py":
        package = package[:-1]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join([*package[: len(package) - node.level + 1], *([base] if base else [])])
            targets = [f"{base}.{alias.name}" for alias in node.names]
        else:
            continue
        for target in targets:
            parts = target.split(".")
            while parts and ".".join(parts) not in known:
                parts.pop()
            if parts:
                yield node, ".".join(parts)


def import_graph() -> tuple[dict[str, set[str]], dict[tuple[str, str], str]]:
    parsed = [(path, tree) for path, tree in sources() if not path.is_relative_to(REPO / "fixture_models")]
    known = {module_name(path) for path, _ in parsed}
    graph: dict[str, set[str]] = {module_name(path): set() for path, _ in parsed}
    lines: dict[tuple[str, str], str] = {}
    for path, tree in parsed:
        source = module_name(path)
        for node, target in imported_modules(path, tree, known):
            if target != source:
                graph[source].add(target)
                lines.setdefault((source, target), where(path, node))
    return graph, lines


def test_each_wing_imports_only_the_wings_below_it():
    graph, lines = import_graph()
    found = []
    for source, targets in graph.items():
        wing = wing_of(source)
        if wing in ADAPTERS:
            continue
        allowed = BELOW[wing] | {wing}
        found += [f"{lines[source, t]} ({wing} -> {wing_of(t)})" for t in sorted(targets) if wing_of(t) not in allowed]
    assert found == []


def test_the_adapters_are_the_only_wings_outside_the_table():
    graph, _ = import_graph()
    assert {wing_of(module) for module in graph} <= set(BELOW) | ADAPTERS


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iteratively)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_no_import_cycle_even_through_a_function_level_import():
    graph, _ = import_graph()
    assert cycles(graph) == []


def test_the_cycle_finder_sees_a_cycle_and_an_import_inside_a_function(tmp_path):
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []
    tree = ast.parse("def f():\n    from tasks_app.core import lifecycle\n")
    found = list(imported_modules(REPO / "tasks_app" / "x.py", tree, {"tasks_app.core.lifecycle"}))
    assert [target for _, target in found] == ["tasks_app.core.lifecycle"]


# A module past this is doing several jobs (issue 42): carve it by its concerns instead.
MAX_MODULE_LINES = 600


def test_no_module_of_tasks_app_or_workers_is_longer_than_a_reader_can_hold():
    found = [
        f"{path.relative_to(REPO)}: {lines} lines"
        for path, _ in sources()
        if path.is_relative_to(REPO / "tasks_app") or path.is_relative_to(REPO / "workers")
        if (lines := len(path.read_text().splitlines())) > MAX_MODULE_LINES
    ]
    assert found == []


# A Responses or Chat request's own field names: the adapters translate them into the generation spec, and
# nothing that runs a task reads them (the worker, the runtimes, the generation wing past the spec itself).
REQUEST_FIELDS = {
    "input",
    "instructions",
    "tool_choice",
    "parallel_tool_calls",
    "previous_response_id",
    "max_output_tokens",
    "max_tokens",
    "max_completion_tokens",
    "truncation",
    "response_format",
    "prompt_cache_key",
    "messages",
}


def test_the_worker_and_the_runtimes_read_the_spec_not_the_request():
    found = [
        f"{where(path, node)} {node.value!r}"
        for path, tree in sources()
        if path.is_relative_to(REPO / "workers") or path.is_relative_to(REPO / "tasks_app" / "generation")
        if path != REPO / "tasks_app" / "generation" / "spec.py"  # the spec's own stored form
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant) and node.value in REQUEST_FIELDS
    ]
    assert found == []
