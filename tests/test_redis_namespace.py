"""A test run keeps to its own Redis namespace, in its own process and in every process it starts.

A quick start on the same Redis after the suite must find nothing of it: no
task message in its queue, no dispatch marker, no metrics (issue 14).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from django.conf import settings as django_settings

from lmsp_project.celery import app
from tasks_app.metrics.store import finished_key, metrics_key, worker_key, workers_key
from tasks_app.plumbing import notify
from tests.support.db import database_url
from tests.support.namespace import (
    DEFAULT_PREFIX,
    IDLE_QUEUE,
    REDIS_PREFIX,
    default_namespace_keys,
    is_default_namespace,
    namespace_cleanup,
)
from tests.support.server import uvicorn_server
from tests.support.sse import call
from tests.support.tasks import create, wait_for_status
from tests.support.waiting import wait_until
from tests.support.worker import private_redis


def messages_for(queue: str, task_id: str) -> list[bytes]:
    return [raw for raw in notify.redis_client().lrange(queue, 0, -1) if task_id.encode() in raw]


def test_this_process_and_its_children_inherit_the_runs_namespace():
    assert django_settings.LMSP_REDIS_PREFIX == REDIS_PREFIX
    assert django_settings.LMSP_TASK_QUEUE.startswith(REDIS_PREFIX)
    assert django_settings.LMSP_MAINTENANCE_QUEUE.startswith(REDIS_PREFIX)
    assert app.conf.task_default_queue.startswith(REDIS_PREFIX)
    assert os.environ["LMSP_REDIS_PREFIX"] == REDIS_PREFIX
    assert os.environ["LMSP_TASK_QUEUE"] == IDLE_QUEUE


def test_a_web_server_started_without_a_prefix_of_its_own_writes_under_the_runs(
    transactional_db, api, models_dir: Path
):
    # As tests/test_http_server.py starts one: a database and models, no Redis namespace.
    with uvicorn_server(database_url(), {"LMSP_MODELS_DIR": str(models_dir)}) as base:
        body = {"type": "response", "input": {"model": "demo", "input": "Hello", "max_output_tokens": 4}}
        status, task = call(base, "POST", "/lmsp/v1/tasks", token=api.token, body=body)
        assert status == 202, task
        # Sent after the 202, from the server's sender thread: awaited while the server runs (its stop
        # waits at most 2 s for a send, which a loaded machine can outlast).
        wait_until(lambda: messages_for(IDLE_QUEUE, task["id"]), what="the server never sent the task's message")

    client = notify.redis_client()
    assert client.exists(f"{REDIS_PREFIX}:dispatched:{task['id']}")
    assert messages_for(IDLE_QUEUE, task["id"])
    assert not client.exists(f"{DEFAULT_PREFIX}:dispatched:{task['id']}")
    assert not messages_for(DEFAULT_PREFIX, task["id"])


def test_metrics_keys_expire(api, running_worker):
    task = create(api, "Hello", max_output_tokens=4)
    assert wait_for_status(api, task["id"], {"succeeded", "failed", "cancelled"})["status"] == "succeeded"
    client = notify.redis_client()
    wait_until(lambda: client.exists(workers_key()), what="the worker never reported its metrics")
    nodes = [node.decode() for node in client.zrange(workers_key(), 0, -1)]

    keys = [finished_key(), workers_key(), *(worker_key(node) for node in nodes)]
    ttls = {key: client.ttl(key) for key in keys}

    assert all(0 < ttl <= django_settings.LMSP_METRICS_WORKER_TTL_SECONDS for ttl in ttls.values()), ttls
    # Nothing else under the metrics layout of this run lacks an expiry.
    others = client.scan_iter(match=metrics_key("*"), count=1000)
    # -1: no expiry; -2: the key went between the scan and the read (it expired: fine).
    assert all(client.ttl(key) != -1 for key in others)


@pytest.mark.parametrize(
    ("key", "default"),
    [
        *[("lmsp", True), ("lmsp:dispatched:task_1", True), ("lmsp-maintenance", True), ("lmsp\x06\x163", True)],
        *[("_kombu.binding.lmsp", True), ("_kombu.binding_permanent.lmsp-maintenance", True)],
        # Ids without the run's prefix (its pid): every parallel worker collects the same test ids.
        pytest.param(f"{REDIS_PREFIX}:metrics:finished", False, id="<run prefix>:metrics:finished-False"),
        pytest.param(f"_kombu.binding.{IDLE_QUEUE}", False, id="_kombu.binding.<run idle queue>-False"),
        *[("lmsp-bench-1", False), ("_kombu.binding.celery.pidbox", False), ("unacked", False)],
    ],
)
def test_what_counts_as_the_default_namespace(key: str, default: bool):
    assert is_default_namespace(key) is default


def test_the_cleanup_removes_the_runs_keys_and_unacknowledged_messages_and_nothing_else(tmp_path: Path, settings):
    with private_redis(tmp_path) as redis_server:
        settings.REDIS_URL = redis_server.url
        client = notify.redis_client()
        ours, theirs = json.dumps([{"body": "x"}, "", IDLE_QUEUE]), json.dumps([{"body": "y"}, "", DEFAULT_PREFIX])
        client.hset("unacked", mapping={"tag-ours": ours, "tag-theirs": theirs})
        client.zadd("unacked_index", {"tag-ours": 1.0, "tag-theirs": 1.0})
        client.rpush(IDLE_QUEUE, "message")
        client.set(f"{REDIS_PREFIX}:dispatched:task_1", "1")
        client.rpush(DEFAULT_PREFIX, "someone else's message")

        assert namespace_cleanup() == []

        assert client.hkeys("unacked") == [b"tag-theirs"]
        assert client.zrange("unacked_index", 0, -1) == [b"tag-theirs"]
        assert sorted(key.decode() for key in client.keys("*")) == [DEFAULT_PREFIX, "unacked", "unacked_index"]
        assert default_namespace_keys() == [DEFAULT_PREFIX]
