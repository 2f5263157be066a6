"""A task accepted while the broker is down is kept, and runs once the broker is back."""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path

from tasks_app.models import Task, TaskStatus
from tasks_app.services.models import model_scan
from tests.conftest import REDIS_PREFIX
from tests.support.db import database_url
from tests.support.server import uvicorn_server
from tests.support.waiting import wait_until
from tests.support.worker import celery_worker, private_redis


def _call(base: str, token: str, method: str, path: str, body: dict | None = None) -> tuple[int, dict]:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(base + path, data=data, method=method)
    request.add_header("Authorization", f"Bearer {token}")
    if data is not None:
        request.add_header("Content-Type", "application/json")
    with urllib.request.urlopen(request, timeout=30) as reply:
        return reply.status, json.loads(reply.read())


def test_task_created_while_the_broker_is_down_runs_after_it_returns(
    transactional_db, make_client, worker_models_root: Path, tmp_path: Path, settings
):
    settings.LMSP_MODELS_DIR = worker_models_root
    model_scan(models_dir=worker_models_root)
    _, token = make_client("alice")
    queue = f"{REDIS_PREFIX}-outage"
    with private_redis(tmp_path) as broker:
        env = {
            "DATABASE_URL": database_url(),
            "REDIS_URL": broker.url,
            "LMSP_REDIS_PREFIX": REDIS_PREFIX,
            "LMSP_TASK_QUEUE": queue,
            "LMSP_MODELS_DIR": str(worker_models_root),
            "LMSP_SWEEP_INTERVAL_SECONDS": "1",
            "LMSP_SWEEP_GRACE_SECONDS": "0",
        }
        with (
            uvicorn_server(env["DATABASE_URL"], env) as base,
            celery_worker(env=env, queue=queue, log_path=tmp_path / "worker.log", beat=True) as worker,
        ):
            broker.stop()

            status, task = _call(
                base,
                token,
                "POST",
                "/lmsp/v1/tasks",
                {"type": "response", "input": {"model": "demo", "input": "Are you there?", "max_output_tokens": 8}},
            )

            assert status == 202
            assert task["status"] == "queued"
            assert Task.objects.get(pk=task["id"]).status == TaskStatus.QUEUED
            broker.start()

            def finished() -> dict | None:
                _, current = _call(base, token, "GET", f"/lmsp/v1/tasks/{task['id']}")
                return current if current["status"] in {"succeeded", "failed", "cancelled"} else None

            current = wait_until(finished, what=lambda: f"the task never ended:\n{worker.log()[-3000:]}", timeout=90)
            assert current["status"] == "succeeded"
            assert current["response"]["usage"]["output_tokens"] == 8
            assert "sweeper re-dispatched 1 queued task(s): " + task["id"] in worker.log()
