"""How one web process serves the sync views: long-lived threads, their own connections, dispatch after the 202.

Everything here goes through a real uvicorn process started like the
Procfile's (``lmsp_project.asgi:application``), over real sockets.
"""

from __future__ import annotations

import base64
import http.cookiejar
import json
import os
import re
import signal
import urllib.parse
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest
import redis
from django.contrib.auth.models import User

from tasks_app.models import IdempotencyKey, Task, TaskEvent
from tests.support.crash import post_json
from tests.support.db import database_url, open_database_handles
from tests.support.namespace import REDIS_PREFIX
from tests.support.server import uvicorn_process
from tests.support.sse import call, open_stream
from tests.support.waiting import wait_until
from tests.support.worker import private_redis

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]

TASK_BODY = {"type": "response", "input": {"model": "demo", "input": "hi", "max_output_tokens": 4}}


def _post_task(base: str, token: str, **headers: str) -> tuple[int, dict]:
    return post_json(base, "/lmsp/v1/tasks", token=token, body=TASK_BODY, headers=headers, timeout=30)


def test_sync_views_keep_their_database_connections_from_one_request_to_the_next(api, models_dir):
    # Under Django's ASGI handler every request had connection objects of its
    # own: 60 requests left dozens of connections open (until the garbage
    # collector found them), on PostgreSQL up to "too many clients".
    env = {"LMSP_MODELS_DIR": str(models_dir), "LMSP_WEB_THREADS": "2", "LMSP_STREAM_DB_THREADS": "1"}
    with uvicorn_process(database_url(), env) as server:
        task_id = _post_task(server.base, api.token)[1]["id"]

        def some_requests(_: int) -> list[int]:
            return [
                call(server.base, "GET", "/lmsp/v1/tasks", token=api.token)[0],
                call(server.base, "GET", f"/lmsp/v1/tasks/{task_id}", token=api.token)[0],
                _post_task(server.base, api.token)[0],
            ]

        with ThreadPoolExecutor(4) as pool:
            statuses = [status for batch in pool.map(some_requests, range(20)) for status in batch]

        assert sorted(set(statuses)) == [200, 202]
        # One per web thread (the stream thread has nothing to read here), and the batch keeper's
        # (docs/batches.md), which keeps its own.
        assert open_database_handles(server.pid) <= 3


def test_sixteen_clients_at_once_are_all_accepted_and_each_task_is_durable_with_its_first_event(api, models_dir):
    with uvicorn_process(database_url(), {"LMSP_MODELS_DIR": str(models_dir)}) as server:

        def post(n: int) -> tuple[int, dict]:
            return _post_task(server.base, api.token, **{"Idempotency-Key": f"k-{n}"})

        with ThreadPoolExecutor(16) as pool:
            replies = list(pool.map(post, range(64)))

        assert [status for status, _ in replies] == [202] * 64, [body for status, body in replies if status != 202]
        ids = {body["id"] for _, body in replies}
        assert len(ids) == 64
        assert set(Task.objects.filter(client=api.client).values_list("id", flat=True)) == ids
        events = TaskEvent.objects.filter(task_id__in=ids).values_list("task_id", "sequence_number", "type")
        assert sorted(events) == sorted((task_id, 0, "response.created") for task_id in ids)
        assert IdempotencyKey.objects.filter(client=api.client).count() == 64
        replay = open_stream(
            server.base,
            "/lmsp/v1/tasks",
            token=api.token,
            method="POST",
            body=TASK_BODY,
            headers={"Idempotency-Key": "k-7"},
        )
        assert (replay.status, replay.headers.get("idempotent-replayed")) == (202, "true")
        assert json.loads(replay.body)["id"] in ids


def _queued_task_ids(client: redis.Redis, queue: str) -> list[str]:
    """Newest first."""
    return [json.loads(base64.b64decode(json.loads(raw)["body"]))[0][0] for raw in client.lrange(queue, 0, -1)]


def test_a_broker_that_hangs_does_not_hold_up_acceptance_and_the_task_is_sent_once_it_answers(
    api, models_dir, tmp_path
):
    queue = f"{REDIS_PREFIX}-hanging-broker"
    with private_redis(tmp_path) as broker:
        env = {
            "LMSP_MODELS_DIR": str(models_dir),
            "REDIS_URL": broker.url,
            "LMSP_REDIS_PREFIX": REDIS_PREFIX,
            "LMSP_TASK_QUEUE": queue,
        }
        client = redis.Redis.from_url(broker.url)
        with uvicorn_process(database_url(), env) as server:
            first = _post_task(server.base, api.token)[1]["id"]
            wait_until(lambda: _queued_task_ids(client, queue) == [first], what="the first task was never sent")
            os.kill(broker.proc.pid, signal.SIGSTOP)  # up, connected, and answering nothing
            try:
                # The send used to be made before the 202: this request waited for Redis forever.
                status, body = _post_task(server.base, api.token)
                assert status == 202
                second = body["id"]
                assert Task.objects.get(pk=second).status == "queued"
            finally:
                os.kill(broker.proc.pid, signal.SIGCONT)
            wait_until(
                lambda: _queued_task_ids(client, queue) == [second, first],
                what=lambda: f"the second task was not sent once Redis answered: {_queued_task_ids(client, queue)}",
            )
            wait_until(lambda: client.exists(f"{REDIS_PREFIX}:dispatched:{second}"), what="no dispatch marker")


def test_the_admin_login_session_and_static_files_work_through_the_web_server(db, models_dir):
    User.objects.create_superuser("root", password="pw-for-the-test")
    jar = http.cookiejar.CookieJar()
    browser = urllib.request.build_opener(urllib.request.HTTPCookieProcessor(jar))
    with uvicorn_process(database_url(), {"LMSP_MODELS_DIR": str(models_dir)}) as server:
        page = browser.open(server.base + "/admin/login/?next=/admin/", timeout=30).read().decode()
        csrf = re.search(r'name="csrfmiddlewaretoken" value="([^"]+)"', page).group(1)
        form = urllib.parse.urlencode(
            {"username": "root", "password": "pw-for-the-test", "csrfmiddlewaretoken": csrf, "next": "/admin/"}
        ).encode()
        with browser.open(server.base + "/admin/login/?next=/admin/", data=form, timeout=30) as landed:
            assert landed.url == server.base + "/admin/"
            index = landed.read().decode()
        assert 'name="password"' not in index
        assert "/admin/logout/" in index
        assert {cookie.name for cookie in jar} >= {"csrftoken", "sessionid"}
        with browser.open(server.base + "/static/admin/css/base.css", timeout=30) as css:
            assert css.headers["Content-Type"].startswith("text/css")
            assert len(css.read()) > 1000
        head = open_stream(server.base, "/lmsp/v1/capabilities", method="HEAD")
        assert (head.status, head.body) == (200, b"")
        assert int(head.headers["content-length"]) > 0
