"""Shared fixtures: a real database (SQLite file or PostgreSQL), a real demo model."""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path

import pytest
import redis

from tasks_app.models import Client, ModelRecord
from tasks_app.registry.scan import model_scan
from tasks_app.services.clients import client_create
from tests.support import flush
from tests.support.api import ApiClient
from tests.support.browser import page  # noqa: F401 (a fixture: the admin's browser tests)
from tests.support.built import built_once
from tests.support.db import database_url
from tests.support.demo import ENDLESS_TAG
from tests.support.lab import lab  # noqa: F401 (a fixture: the recovery and batched-worker tests share it)
from tests.support.layouts import loaded  # noqa: F401 (a fixture: the engine and prefix cache tests share it)
from tests.support.namespace import (
    IDLE_QUEUE,
    NAMESPACE_ENV,
    REDIS_PREFIX,
    default_namespace_keys,
    namespace_cleanup,
)
from tests.support.server import Server, uvicorn_process
from tests.support.waiting import wait_until
from tests.support.worker import RedisServer, WorkerProcess, celery_worker, maintenance_queue, private_redis

WORKER_QUEUE = f"{REDIS_PREFIX}-work"


def _test_process_keeps_idle_transactions() -> None:
    """The test process itself (not its servers and workers) may hold a transaction while it waits on a child.

    pytest-django's ``db`` fixture wraps a test in one transaction, and a test
    may sit in it for longer than the service's
    ``idle_in_transaction_session_timeout`` while it waits for a process; the
    server must not end the harness's session for that. Children get the
    service's own settings (``tests/test_cut_off_workers.py`` relies on them).
    """
    from django.conf import settings

    options = settings.DATABASES["default"].get("OPTIONS", {})
    if "idle_in_transaction_session_timeout" in options.get("options", ""):
        options["options"] += " -c idle_in_transaction_session_timeout=0"


_test_process_keeps_idle_transactions()
flush.install()
# What _redis_namespace found outside the run's namespace, for the end of the report.
_NAMESPACE_WARNINGS: list[str] = []


@contextmanager
def environment(values: dict[str, str]) -> Iterator[None]:
    """``values`` in this process's environment (what its children inherit) for the block, then as before."""
    saved = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def pytest_report_header(config: pytest.Config) -> str:
    from django.conf import settings

    db = settings.DATABASES["default"]
    return f"lmsp database: {db['ENGINE'].rsplit('.', 1)[-1]} {db.get('HOST') or ''}"


@pytest.fixture(scope="session", autouse=True)
def _redis_namespace() -> Iterator[None]:
    """Everything of the run, in this process and in every child, under the run's prefix; removed at the end.

    The settings were read before this runs, so the values derived from the
    prefix are set here too. The environment is what a child process (a web
    server, a worker, a script) inherits when a test gives it no namespace of
    its own: without it, such a child used the default prefix and queue, and a
    quick start on the same Redis later ran the tests' tasks.
    """
    from django.conf import settings

    from lmsp_project.celery import app

    settings.LMSP_REDIS_PREFIX = REDIS_PREFIX
    settings.LMSP_TASK_QUEUE = IDLE_QUEUE
    settings.LMSP_MAINTENANCE_QUEUE = maintenance_queue(IDLE_QUEUE)
    app.conf.task_default_queue = IDLE_QUEUE
    app.conf.control_exchange = REDIS_PREFIX
    app.__dict__.pop("control", None)  # its mailbox is named after the exchange when first made
    try:
        before: list[str] | None = default_namespace_keys()
    except redis.RedisError:  # no Redis: the tests that need one fail on their own
        before = None
    with environment(NAMESPACE_ENV):
        yield
    try:
        left = namespace_cleanup()
        written = [] if before is None else sorted(set(default_namespace_keys()) - set(before))
    except redis.RedisError:  # cleanup of a scratch namespace; Redis may be gone
        return
    if left:
        pytest.fail(f"Redis keys of the run written after its end (by a process still running?): {left[:20]}")
    if written:
        message = (
            f"new Redis keys under the default prefix, by a process without LMSP_REDIS_PREFIX={REDIS_PREFIX} "
            f"or by another installation on this Redis: {written[:20]}"
        )
        # Under CI nothing else uses the Redis; a developer's may serve a quick start meanwhile.
        if os.environ.get("CI") == "true":
            pytest.fail(message, pytrace=False)
        _NAMESPACE_WARNINGS.append(message)


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    for message in _NAMESPACE_WARNINGS:
        terminalreporter.write_sep("=", "Redis namespace", yellow=True)
        terminalreporter.write_line(f"WARNING: {message}", yellow=True)


@pytest.fixture(scope="session", autouse=True)
def _worker_directories(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """A data and a models directory of this test process's own, for every child that is given none.

    Parallel workers (pytest-xdist) then share no directory a child writes
    to; the data directory starts with the run's signing key, so a child
    signs admin sessions and stream tokens as this process does.
    """
    from django.conf import settings

    from lmsp_project.secret_key import KEY_FILE_NAME

    data = tmp_path_factory.mktemp("data")
    models = tmp_path_factory.mktemp("models-default")
    key_file = data / KEY_FILE_NAME
    key_file.write_text(settings.SECRET_KEY + "\n")
    key_file.chmod(0o600)
    with environment({"LMSP_DATA_DIR": str(data), "LMSP_MODELS_DIR": str(models)}):
        yield


@pytest.fixture(scope="session", autouse=True)
def _quick_password_hashing() -> Iterator[None]:
    """Users made in the test process (the admin tests make one per test) cost no second of CPU each."""
    from django.test.utils import override_settings

    with override_settings(PASSWORD_HASHERS=["tests.support.hashers.QuickPBKDF2PasswordHasher"]):
        yield


@pytest.fixture(scope="session", autouse=True)
def _close_db_pool(django_db_setup) -> Iterator[None]:
    """Views run in this process read through ``dbpool``; its connections
    must close before the test database is dropped."""
    yield
    from tasks_app.plumbing.dbpool import close_pool

    close_pool()


@pytest.fixture(scope="session")
def demo_models_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A models folder holding the real demo model, built once per run (read only: copy it to change it)."""
    from fixture_models.demo import build_demo_model

    return built_once(tmp_path_factory, "models", lambda root: build_demo_model(root / "demo", size="demo"))


@pytest.fixture(scope="session")
def endless_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The demo model without its EOS head (``demo:endless``): for tests that need long generations."""
    from fixture_models.demo import build_demo_model

    root = built_once(
        tmp_path_factory, "endless", lambda root: build_demo_model(root / ENDLESS_TAG, size="demo", endless=True)
    )
    return root / ENDLESS_TAG


@pytest.fixture
def models_dir(demo_models_root: Path, settings) -> Path:
    settings.LMSP_MODELS_DIR = demo_models_root
    return demo_models_root


@pytest.fixture
def demo_model(db, models_dir: Path) -> ModelRecord:
    model_scan(models_dir=models_dir)
    return ModelRecord.objects.get(name="demo")


@pytest.fixture
def make_client(db) -> Callable[..., tuple[Client, str]]:
    counter = {"n": 0}

    def make(name: str | None = None, scopes: str = "responses,read") -> tuple[Client, str]:
        counter["n"] += 1
        return client_create(name=name or f"client-{counter['n']}", scopes=scopes)

    return make


@pytest.fixture
def api(make_client, demo_model) -> ApiClient:
    client, token = make_client("alice")
    return ApiClient(token, client)


@pytest.fixture
def other_api(make_client, demo_model) -> ApiClient:
    client, token = make_client("bob")
    return ApiClient(token, client)


@pytest.fixture
def queue(transactional_db, settings, request: pytest.FixtureRequest) -> Iterator[str]:
    """A task queue nobody consumes, for this test alone, emptied before and after."""
    from tasks_app.plumbing.notify import redis_client

    name = f"{REDIS_PREFIX}-queue-{request.node.name}"
    settings.LMSP_TASK_QUEUE = name
    redis_client().delete(name)
    yield name
    redis_client().delete(name)


@pytest.fixture(scope="session")
def worker_models_root(
    tmp_path_factory: pytest.TempPathFactory, demo_models_root: Path, endless_model_dir: Path
) -> Path:
    """The worker's models folder: ``demo``, ``demo:endless`` (as scripts/prepare builds them) and what a test adds."""
    root = tmp_path_factory.mktemp("worker-models")
    shutil.copytree(demo_models_root / "demo", root / "demo")
    shutil.copytree(endless_model_dir, root / "demo" / ENDLESS_TAG)
    return root


@contextmanager
def shared_worker(
    django_db_blocker,
    worker_models_root: Path,
    log_dir: Path,
    *,
    queue: str,
    pool: str = "prefork",
    name: str = "test",
    **extra_env: str,
) -> Iterator[WorkerProcess]:
    """A real ``celery worker`` on the test database, consuming ``queue`` (``pool``, ``name``: ``celery_worker``'s)."""
    from django.conf import settings

    with django_db_blocker.unblock():
        url = database_url()
    env = {
        "DATABASE_URL": url,
        "REDIS_URL": settings.REDIS_URL,
        "LMSP_REDIS_PREFIX": REDIS_PREFIX,
        "LMSP_MODELS_DIR": str(worker_models_root),
        "LMSP_DELTA_BATCH_MS": "20",
        "LMSP_HEARTBEAT_SECONDS": "1",
        **extra_env,
    }
    with celery_worker(env=env, queue=queue, log_path=log_dir / "worker.log", pool=pool, name=name) as worker:
        yield worker


@pytest.fixture(scope="session")
def celery_worker_proc(
    django_db_setup, django_db_blocker, worker_models_root: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[WorkerProcess]:
    """One real ``celery worker`` for the session, on the test database."""
    with shared_worker(
        django_db_blocker, worker_models_root, tmp_path_factory.mktemp("worker"), queue=WORKER_QUEUE
    ) as w:
        yield w


@pytest.fixture(scope="module")
def slow_device_worker_proc(
    django_db_setup, django_db_blocker, worker_models_root: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[WorkerProcess]:
    """A worker whose every model call first waits 4 ms, as a slow device would (tasks_app.faults).

    For a test whose task must still be generating after a slow step of the test's own (a browser
    logging in and loading a page): a fast machine's worker otherwise ends it first. Tokens are
    unchanged; a 2,000-token task takes at least 8 s.
    """
    log_dir = tmp_path_factory.mktemp("slow-worker")
    queue = f"{WORKER_QUEUE}-slow-device"
    with shared_worker(
        django_db_blocker, worker_models_root, log_dir, queue=queue, LMSP_FAULT_MODEL_CALL_SECONDS="0.004"
    ) as worker:
        yield worker


@pytest.fixture(scope="module")
def patient_fold_worker_proc(
    django_db_setup, django_db_blocker, worker_models_root: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[WorkerProcess]:
    """A worker whose start waits up to 2 s for the first token to commit both at once (LMSP_START_FOLD_MS).

    The default 25 ms is what a user's short prompt needs; a loaded CI machine sometimes takes longer for the
    first token, which is right (two commits), but not what a test of the fold can check.
    """
    log_dir = tmp_path_factory.mktemp("patient-fold-worker")
    queue = f"{WORKER_QUEUE}-patient-fold"
    with shared_worker(django_db_blocker, worker_models_root, log_dir, queue=queue, LMSP_START_FOLD_MS="2000") as w:
        yield w


def _running(settings, worker: WorkerProcess, worker_models_root: Path) -> Iterator[WorkerProcess]:
    settings.LMSP_TASK_QUEUE = worker.queue
    settings.LMSP_MODELS_DIR = worker_models_root
    model_scan(models_dir=worker_models_root)
    yield worker
    from tasks_app.models import Task
    from tasks_app.services.tasks import task_cancel
    from tasks_app.states import ACTIVE

    for task in Task.objects.filter(status__in=ACTIVE):
        task_cancel(task=task)
    wait_until(
        lambda: not Task.objects.filter(status__in=ACTIVE).exists(),
        what="the worker did not let go of the test's tasks",
    )


@pytest.fixture
def running_worker(transactional_db, demo_model, celery_worker_proc: WorkerProcess, worker_models_root: Path, settings):
    """A live worker consuming this test's dispatches; the test's tasks end before the next test."""
    yield from _running(settings, celery_worker_proc, worker_models_root)


@pytest.fixture
def running_patient_fold_worker(
    transactional_db, demo_model, patient_fold_worker_proc: WorkerProcess, worker_models_root: Path, settings
):
    """``running_worker``, on the worker that waits 2 s to fold the start (``patient_fold_worker_proc``)."""
    yield from _running(settings, patient_fold_worker_proc, worker_models_root)


@pytest.fixture
def running_slow_device_worker(
    transactional_db, demo_model, slow_device_worker_proc: WorkerProcess, worker_models_root: Path, settings
):
    """``running_worker``, on the slowed worker (``slow_device_worker_proc``)."""
    yield from _running(settings, slow_device_worker_proc, worker_models_root)


@pytest.fixture(scope="session")
def web_server(django_db_setup, django_db_blocker, worker_models_root: Path) -> Iterator[Server]:
    """One real uvicorn process for the session, on the test database.

    Its tasks go to the worker's queue; streams send a keepalive every second.
    """
    from django.conf import settings

    with django_db_blocker.unblock():
        url = database_url()
    env = {
        "REDIS_URL": settings.REDIS_URL,
        "LMSP_REDIS_PREFIX": REDIS_PREFIX,
        "LMSP_TASK_QUEUE": WORKER_QUEUE,
        "LMSP_MODELS_DIR": str(worker_models_root),
        "LMSP_STREAM_KEEPALIVE_SECONDS": "1",
        # The admin's thresholds for the tests' workers, which beat every second (test_admin_operator.py's
        # freezable worker also reports every second).
        "LMSP_HEARTBEAT_SILENT_SECONDS": "4",
        "LMSP_WORKER_REPORT_SECONDS": "1",
        "LMSP_WORKER_SILENT_SECONDS": "4",
    }
    with uvicorn_process(url, env) as server:
        yield server


@dataclass
class PrivateStack:
    """A web server and a worker of their own, on a Redis the test may stop and start."""

    base: str
    token: str
    redis: RedisServer
    worker: WorkerProcess
    env: dict[str, str]


@pytest.fixture
def private_stack(transactional_db, make_client, worker_models_root: Path, tmp_path: Path, settings):
    """``with private_stack("name", env) as stack:`` a live web server, worker and Redis of the test's own.

    With ``web=False`` there is no web server (``base`` is empty): the test
    runs its own from ``stack.env``, to kill and restart it.
    """
    settings.LMSP_MODELS_DIR = worker_models_root
    model_scan(models_dir=worker_models_root)
    _, token = make_client("alice")

    @contextmanager
    def start(
        name: str, extra_env: dict[str, str] | None = None, beat: bool = False, web: bool = True
    ) -> Iterator[PrivateStack]:
        queue = f"{REDIS_PREFIX}-{name}"
        with private_redis(tmp_path) as redis_server:
            env = {
                "DATABASE_URL": database_url(),
                "REDIS_URL": redis_server.url,
                "LMSP_REDIS_PREFIX": REDIS_PREFIX,
                "LMSP_TASK_QUEUE": queue,
                "LMSP_MODELS_DIR": str(worker_models_root),
                **(extra_env or {}),
            }
            with (
                uvicorn_process(env["DATABASE_URL"], env) if web else nullcontext() as server,
                celery_worker(env=env, queue=queue, log_path=tmp_path / f"{name}-worker.log", beat=beat) as worker,
            ):
                yield PrivateStack(server.base if server else "", token, redis_server, worker, env)

    return start


# Fixtures that start a process (a web server, a worker, a Redis, a browser): a test that uses
# one, directly or through another fixture, is marked slow and left out of scripts/test --quick.
PROCESS_FIXTURES = frozenset(
    {
        *("web_server", "celery_worker_proc", "running_worker", "lab", "private_stack", "page"),
        "patient_fold_worker_proc",
        # A module's own servers: tests/test_real_models.py, test_http_server.py, test_stream_limits.py,
        # test_edge_security.py.
        *("whole_prompt_stack", "chunked_stack", "edge", "limited", "edge_server"),
    }
)


# The files that take longest, longest first (seconds of one pass, measured on the 2-core CI machine with two
# workers per pass). scripts/test's parallel workers take whole files in collection order
# (``--no-loadscope-reorder``), so these go first and the short ones fill the gaps at the end: a long file
# started last would keep its worker busy long after the others ran out of work. Only the order follows
# from this list; a file missing from it still runs, after these.
LONGEST_FILES = (
    *("test_schemathesis.py", "test_recovery.py", "test_launcher.py", "test_real_models.py", "test_model_pull.py"),
    *("test_batches.py", "test_batched_worker.py", "test_admin_operator.py", "test_crashes.py"),
    *("test_lock_contention.py", "test_admin_browser.py", "test_cut_off_workers.py", "test_lifecycle_machine.py"),
    *("test_demo_model.py", "test_http_server.py", "test_background_responses.py", "test_conversations.py"),
    *("test_database_outages.py", "test_openapi.py", "test_engine_process.py", "test_worker_drain.py"),
    *("test_claude_code.py", "test_webhooks.py", "test_cancel_race.py", "test_admin.py", "test_web_serving.py"),
    *("test_metrics.py", "test_recovery_service.py", "test_broker_outage.py", "test_affinity.py"),
    *("test_continuations.py", "test_tool_calls.py", "test_api_bad_input.py", "test_streams.py"),
    "test_stream_redis_restart.py",
)
_FILE_RANK = {name: rank for rank, name in enumerate(LONGEST_FILES)}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark the tests that start processes ``slow``; leave out of a pass what another pass of the same
    scripts/test run covers: with LMSP_TEST_DATABASE_FREE_DONE=1 (the PostgreSQL pass) the ``database_free``
    tests, which already ran in the SQLite pass and no database changes; with LMSP_TEST_POSTGRES_PASS_FOLLOWS=1
    (the SQLite pass beside a PostgreSQL one) the ``postgres_pass`` tests. The longest files go first
    (``LONGEST_FILES``); a file's tests keep their order."""
    items.sort(key=lambda item: _FILE_RANK.get(item.path.name, len(_FILE_RANK)))
    for item in items:
        if PROCESS_FIXTURES.intersection(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.slow)
    left_to_another_pass = [
        marker
        for marker, variable in (
            ("database_free", "LMSP_TEST_DATABASE_FREE_DONE"),
            ("sqlite_pass", "LMSP_TEST_DATABASE_FREE_DONE"),
            ("postgres_pass", "LMSP_TEST_POSTGRES_PASS_FOLLOWS"),
        )
        if os.environ.get(variable) == "1"
    ]
    if not left_to_another_pass:
        return
    left = [item for item in items if any(item.get_closest_marker(marker) for marker in left_to_another_pass)]
    if left:
        config.hook.pytest_deselected(items=left)
        gone = set(map(id, left))
        items[:] = [item for item in items if id(item) not in gone]
