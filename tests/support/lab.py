"""A queue, models and workers of a test's own (the ``lab`` fixture, in tests/conftest.py)."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from io import StringIO
from pathlib import Path
from typing import Any

import pytest
from django.core.management import call_command

from tasks_app.registry.scan import model_scan
from tests.support.api import ApiClient
from tests.support.db import database_url
from tests.support.demo import ENDLESS_MODEL, ENDLESS_TAG
from tests.support.namespace import REDIS_PREFIX
from tests.support.waiting import wait_until
from tests.support.worker import WorkerProcess, celery_worker, maintenance_queue


@dataclass
class Lab:
    """A queue, models and workers of the test's own, on the test database and the main Redis."""

    queue: str
    env: dict[str, str]
    api: ApiClient
    tmp: Path
    models: Path

    @contextmanager
    def worker(
        self, name: str, *, concurrency: int = 1, beat: bool = False, pool: str = "prefork", **env: str
    ) -> Iterator[WorkerProcess]:
        with celery_worker(
            env={**self.env, **env},
            queue=self.queue,
            log_path=self.tmp / f"{name}.log",
            name=name,
            concurrency=concurrency,
            beat=beat,
            pool=pool,
        ) as worker:
            yield worker

    @contextmanager
    def maintenance(self, **env: str) -> Iterator[WorkerProcess]:
        """The maintenance node (beat: sweeper, reaper, cleanup) on the lab's queues, with ``env`` on top."""
        with celery_worker(
            env={**self.env, "LMSP_TASK_QUEUE": self.queue, **env},
            queue=maintenance_queue(self.queue),
            log_path=self.tmp / "maintenance.log",
            name="maintenance",
            beat=True,
            maintenance=False,
        ) as node:
            yield node

    def recover(self, inspect_timeout: float = 0.5) -> str:
        out = StringIO()
        call_command("lmsp_recover", "--inspect-timeout", str(inspect_timeout), stdout=out)
        return out.getvalue()

    def create(self, policy: str, *, model: str = ENDLESS_MODEL, tokens: int = 8, **request: Any) -> str:
        headers = {"Idempotency-Key": f"k-{os.urandom(6).hex()}"}
        body = {"model": model, "input": "Tell me a long story", "max_output_tokens": tokens, **request}
        reply = self.api.create_task(headers=headers, on_restart=policy, input=body)
        assert reply.status_code == 202, reply.content
        return reply.json()["id"]

    def task(self, task_id: str) -> dict[str, Any]:
        reply = self.api.get(f"/lmsp/v1/tasks/{task_id}")
        assert reply.status_code == 200
        return reply.json()

    def wait_for(self, task_id: str, wanted: set[str], worker: WorkerProcess | None = None) -> dict[str, Any]:
        def probe() -> dict[str, Any] | None:
            body = self.task(task_id)
            return body if body["status"] in wanted else None

        def why() -> str:
            log = worker.log()[-3000:] if worker is not None else ""
            return f"task {task_id} is {self.task(task_id)['status']}, not {sorted(wanted)}\n{log}"

        return wait_until(probe, what=why, timeout=120)


@pytest.fixture
def lab(
    transactional_db, make_client, demo_models_root: Path, endless_model_dir: Path, tmp_path: Path, settings
) -> Lab:
    models = tmp_path / "models"
    shutil.copytree(demo_models_root / "demo", models / "demo")
    shutil.copytree(endless_model_dir, models / "demo" / ENDLESS_TAG)
    # A second copy whose config can be swapped for a FIFO (see stalled_model).
    shutil.copytree(demo_models_root / "demo", models / "stall")
    settings.LMSP_MODELS_DIR = models
    model_scan(models_dir=models)
    queue = f"{REDIS_PREFIX}-{tmp_path.name}"
    settings.LMSP_TASK_QUEUE = queue
    settings.LMSP_MAINTENANCE_QUEUE = maintenance_queue(queue)
    client, token = make_client("alice")
    env = {
        "DATABASE_URL": database_url(),
        "REDIS_URL": settings.REDIS_URL,
        "LMSP_REDIS_PREFIX": REDIS_PREFIX,
        "LMSP_MODELS_DIR": str(models),
        "LMSP_HEARTBEAT_SECONDS": "1",
    }
    return Lab(queue=queue, env=env, api=ApiClient(token, client), tmp=tmp_path, models=models)
