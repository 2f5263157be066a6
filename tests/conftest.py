"""Shared fixtures: a real database (SQLite file or PostgreSQL), a real demo model."""

from __future__ import annotations

import shutil
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path

import pytest

from tasks_app.models import Client, ModelRecord
from tasks_app.services.clients import client_create
from tasks_app.services.model_scan import model_scan
from tests.support.api import ApiClient
from tests.support.db import database_url
from tests.support.namespace import REDIS_PREFIX
from tests.support.server import Server, uvicorn_process
from tests.support.waiting import wait_until
from tests.support.worker import RedisServer, WorkerProcess, celery_worker, private_redis

# Tasks created by tests without a worker go to a queue nobody consumes.
IDLE_QUEUE = f"{REDIS_PREFIX}-idle"
WORKER_QUEUE = f"{REDIS_PREFIX}-work"


def pytest_report_header(config: pytest.Config) -> str:
    from django.conf import settings

    db = settings.DATABASES["default"]
    return f"lmsp database: {db['ENGINE'].rsplit('.', 1)[-1]} {db.get('HOST') or ''}"


@pytest.fixture(scope="session", autouse=True)
def _redis_namespace() -> Iterator[None]:
    from django.conf import settings

    from tasks_app.notify import redis_client

    settings.LMSP_REDIS_PREFIX = REDIS_PREFIX
    settings.LMSP_TASK_QUEUE = IDLE_QUEUE
    yield
    try:
        client = redis_client()
        for key in client.scan_iter(match=f"*{REDIS_PREFIX}*", count=1000):
            client.delete(key)
    except Exception:  # cleanup of a scratch namespace; Redis may be gone
        pass


@pytest.fixture(scope="session", autouse=True)
def _close_db_pool(django_db_setup) -> Iterator[None]:
    """Views run in this process read through ``dbpool``; its connections
    must close before the test database is dropped."""
    yield
    from tasks_app.dbpool import close_pool

    close_pool()


@pytest.fixture(scope="session")
def demo_models_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A models folder holding the real demo model, built once per run."""
    from fixture_models.demo import build_demo_model

    root = tmp_path_factory.mktemp("models")
    build_demo_model(root / "demo", size="demo")
    return root


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
    from tasks_app.notify import redis_client

    name = f"{REDIS_PREFIX}-queue-{request.node.name}"
    settings.LMSP_TASK_QUEUE = name
    redis_client().delete(name)
    yield name
    redis_client().delete(name)


@pytest.fixture(scope="session")
def worker_models_root(tmp_path_factory: pytest.TempPathFactory, demo_models_root: Path) -> Path:
    """The worker's models folder: the demo model plus whatever a test adds."""
    root = tmp_path_factory.mktemp("worker-models")
    shutil.copytree(demo_models_root / "demo", root / "demo")
    return root


@pytest.fixture(scope="session")
def celery_worker_proc(
    django_db_setup, django_db_blocker, worker_models_root: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[WorkerProcess]:
    """One real ``celery worker`` for the session, on the test database."""
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
    }
    log_path = tmp_path_factory.mktemp("worker") / "worker.log"
    with celery_worker(env=env, queue=WORKER_QUEUE, log_path=log_path) as worker:
        yield worker


@pytest.fixture
def running_worker(transactional_db, demo_model, celery_worker_proc: WorkerProcess, worker_models_root: Path, settings):
    """A live worker consuming this test's dispatches; the test's tasks end before the next test."""
    settings.LMSP_TASK_QUEUE = celery_worker_proc.queue
    settings.LMSP_MODELS_DIR = worker_models_root
    model_scan(models_dir=worker_models_root)
    yield celery_worker_proc
    from tasks_app.models import Task
    from tasks_app.services.tasks import task_cancel
    from tasks_app.states import ACTIVE

    for task in Task.objects.filter(status__in=ACTIVE):
        task_cancel(task=task)
    wait_until(
        lambda: not Task.objects.filter(status__in=ACTIVE).exists(),
        what="the worker did not let go of the test's tasks",
    )


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
