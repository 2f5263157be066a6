"""The layering rules, read from the source: who may write task state, who imports whom,
and where the vocabulary lives. Each rule names the lines that break it."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tasks_app.core.events import EventType

# No database of the pass here: the PostgreSQL pass of scripts/test leaves these out (tests/conftest.py).
pytestmark = pytest.mark.database_free

REPO = Path(__file__).resolve().parent.parent
PACKAGES = ("tasks_app", "workers", "lmsp_project", "fixture_models")
# The lifecycle and the modules it is made of: the verbs, their compare-and-set, recovery's moves, the log's rows.
LIFECYCLE = frozenset(
    REPO / "tasks_app" / "core" / f"{name}.py" for name in ("lifecycle", "transitions", "recovery_moves", "log_rows")
)
STATE_MODELS = {"Task", "TaskEvent", "TaskSnapshot", "Response"}
WRITES = {"update", "create", "bulk_create", "get_or_create", "update_or_create", "bulk_update"}


def sources() -> Iterator[tuple[Path, ast.Module]]:
    for package in PACKAGES:
        for path in sorted((REPO / package).rglob("*.py")):
            if "migrations" not in path.parts:
                yield path, ast.parse(path.read_text(), filename=str(path))


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


def test_only_the_lifecycle_writes_tasks_events_snapshots_and_responses():
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


def test_tasks_app_never_imports_workers():
    found = []
    for path, tree in sources():
        if not path.is_relative_to(REPO / "tasks_app"):
            continue
        for node in ast.walk(tree):
            names = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            if any(name == "workers" or name.startswith("workers.") for name in names):
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
        if path != REPO / "tasks_app" / "core" / "events.py"
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
