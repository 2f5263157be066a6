"""The database goes away (issue 46): a client gets ``503`` with ``Retry-After`` in the problem shape (``507`` for a
full disk), never a ``500``; nothing accepted is lost; each process logs the outage once and its end once.

PostgreSQL: a proxy in front of the server goes down as a crashed server does (every connection closed, new ones
refused) under a running web, worker, maintenance node and webhook deliverer, and comes back. SQLite: its own
versions of it, for real: a writer holding the lock past the timeout, a read-only file (a read-only bind mount) and
a full disk (a small tmpfs).
"""

from __future__ import annotations

import sqlite3
import subprocess
import threading
import time
import urllib.request
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import pytest
from django.db import connection
from openai import OpenAI

from tasks_app.models import Task, TaskEvent
from tasks_app.services.capabilities import service_id_get
from tests.support.db import database_url, database_write_locked, is_postgres
from tests.support.namespace import REDIS_PREFIX
from tests.support.outage_proxy import OutageProxy, outage_proxy
from tests.support.server import uvicorn_process
from tests.support.sse import call, call_with_headers, open_stream
from tests.support.waiting import wait_until
from tests.support.webhooks import deliverer_process
from tests.support.worker import celery_worker, maintenance_queue

PROBLEM = "application/problem+json"
STARTED = "database unavailable: "
ENDED = "database available again: "
TERMINAL = {"succeeded", "failed", "cancelled"}


def assert_retryable_problem(status: int, headers: dict[str, str], body: Any, *, code: int = 503) -> dict:
    """A problem object the SDKs retry: its status, ``Retry-After``, and the code they read in ``error``."""
    assert status == code, (status, body)
    assert headers["content-type"].startswith(PROBLEM), headers
    assert int(headers["retry-after"]) > 0, headers
    assert body["status"] == code and body["type"].endswith(body["code"]), body
    assert body["code"] == ("service_unavailable" if code == 503 else "insufficient_storage"), body
    assert body["error"]["code"] == body["code"] and body["error"]["type"] == "server_error", body
    assert "Traceback" not in str(body) and "127.0.0.1" not in body["detail"], body
    return body


def outage_lines(log: Path) -> tuple[list[str], list[str]]:
    text = log.read_text(errors="replace")
    return [line for line in text.splitlines() if STARTED in line], [
        line for line in text.splitlines() if ENDED in line
    ]


def metrics_text(base: str) -> str:
    with urllib.request.urlopen(base + "/metrics", timeout=10) as reply:
        return reply.read().decode()


def task_body(model: str = "demo", tokens: int = 8, prompt: str = "Are you there?") -> dict:
    return {"type": "response", "input": {"model": model, "input": prompt, "max_output_tokens": tokens}}


def finished(base: str, token: str, task_id: str) -> dict | None:
    status, current = call(base, "GET", f"/lmsp/v1/tasks/{task_id}", token=token)
    return current if status == 200 and current["status"] in TERMINAL else None


def assert_contiguous_events(task_id: str) -> None:
    numbers = list(
        TaskEvent.objects.filter(task_id=task_id).order_by("sequence_number").values_list("sequence_number", flat=True)
    )
    assert numbers == list(range(numbers[0], numbers[0] + len(numbers))), numbers


@pytest.fixture
def outage_env(transactional_db, make_client, worker_models_root: Path, settings) -> dict[str, Any]:
    from tasks_app.registry.scan import model_scan

    settings.LMSP_MODELS_DIR = worker_models_root
    model_scan(models_dir=worker_models_root)
    _, token = make_client("outage")
    prefix = f"{REDIS_PREFIX}-outage"
    return {
        "token": token,
        "queue": f"{prefix}-work",
        "env": {
            "REDIS_URL": settings.REDIS_URL,
            # Its own prefix: the outage counters it reads are this stack's alone.
            "LMSP_REDIS_PREFIX": prefix,
            "LMSP_TASK_QUEUE": f"{prefix}-work",
            "LMSP_MODELS_DIR": str(worker_models_root),
            "LMSP_DB_UNAVAILABLE_RETRY_AFTER_SECONDS": "2",
            "LMSP_STREAM_KEEPALIVE_SECONDS": "1",
            "LMSP_HEARTBEAT_SECONDS": "1",
            "LMSP_DELTA_BATCH_MS": "20",
            "LMSP_SWEEP_INTERVAL_SECONDS": "1",
            "LMSP_WEBHOOK_POLL_SECONDS": "0.5",
            # 4 ms a step: a 600-token task takes 2.4 s at least, so it is still generating when the outage comes
            # (within a second of its start), and its end commit waits for the database's return.
            "LMSP_FAULT_MODEL_CALL_SECONDS": "0.004",
        },
    }


def test_postgresql_going_away_answers_503s_the_sdk_retries_through_and_loses_nothing(outage_env, tmp_path: Path):
    if not is_postgres():
        pytest.skip("a database server's outage; SQLite's own versions are the tests below")
    token, queue = outage_env["token"], outage_env["queue"]
    settings_dict = connection.settings_dict
    host, port = settings_dict.get("HOST") or "127.0.0.1", int(settings_dict.get("PORT") or 5432)
    logs = {name: tmp_path / f"{name}.log" for name in ("web", "worker", "maintenance", "webhooks")}
    with ExitStack() as stack:
        proxy = stack.enter_context(outage_proxy((host, port)))
        url = database_url().replace(f"@{host}:{port}/", f"@127.0.0.1:{proxy.port}/")
        env = {**outage_env["env"], "DATABASE_URL": url}
        web = stack.enter_context(uvicorn_process(url, env, log_path=logs["web"]))
        stack.enter_context(celery_worker(env=env, queue=queue, log_path=logs["worker"], pool="threads", concurrency=4))
        stack.enter_context(
            celery_worker(
                env=env,
                queue=maintenance_queue(queue),
                log_path=logs["maintenance"],
                beat=True,
                maintenance=False,
                name="maintenance",
            )
        )
        stack.enter_context(deliverer_process(env, logs["webhooks"]))
        base = web.base

        status, short = call(base, "POST", "/lmsp/v1/tasks", token=token, body=task_body())
        assert status == 202
        status, long = call(base, "POST", "/lmsp/v1/tasks", token=token, body=task_body("demo:endless", 600))
        assert status == 202
        stream = stack.enter_context(open_stream(base, f"/lmsp/v1/tasks/{long['id']}/events", token=token))
        assert stream.status == 200
        seen = stream.take(3)  # queued, then running and its first deltas
        # And a streamed response through the openai SDK, read as it comes, across the outage.
        streamed: dict[str, Any] = {"events": []}

        def read_streamed() -> None:
            try:
                client = OpenAI(base_url=f"{base}/lmsp/v1", api_key=token, timeout=60)
                with client.responses.create(
                    model="demo:endless", input="Go on", max_output_tokens=500, stream=True
                ) as events:
                    for event in events:
                        streamed["events"].append(event)
            except Exception as error:  # reported by the assertion below
                streamed["error"] = error

        reading = threading.Thread(target=read_streamed)
        reading.start()
        wait_until(lambda: len(streamed["events"]) > 3, what="the SDK's stream did not start")

        proxy.down()
        # Every route and every adapter: the same problem, retryable.
        for method, path, body in (
            ("POST", "/lmsp/v1/tasks", task_body()),
            ("GET", f"/lmsp/v1/tasks/{short['id']}", None),
            ("GET", "/lmsp/v1/tasks", None),
            ("POST", "/lmsp/v1/responses", {"model": "demo", "input": "Hi", "max_output_tokens": 4}),
            ("POST", "/lmsp/v1/chat/completions", {"model": "demo", "messages": [{"role": "user", "content": "Hi"}]}),
            ("GET", f"/lmsp/v1/tasks/{short['id']}/events", None),
        ):
            assert_retryable_problem(*call_with_headers(base, method, path, token=token, body=body))
        status, headers, health = call_with_headers(base, "GET", "/healthz")
        assert_retryable_problem(status, headers, health)
        assert health["checks"]["database"] == {
            "status": "down",
            "reason": "unreachable",
            **health["checks"]["database"],
        }
        assert "lmsp_database_up 0.0" in metrics_text(base)

        # The openai SDK, as a user runs it (2 retries, after Retry-After): its first try lands in the outage.
        answer: dict[str, Any] = {}

        def ask() -> None:
            try:
                client = OpenAI(base_url=f"{base}/lmsp/v1", api_key=token, timeout=60)
                answer["response"] = client.responses.create(model="demo", input="Still there?", max_output_tokens=8)
            except Exception as error:  # reported by the assertion below
                answer["error"] = error

        refused_before = logs["web"].read_text().count("POST /lmsp/v1/responses 503")
        asking = threading.Thread(target=ask)
        asking.start()
        wait_until(
            lambda: logs["web"].read_text().count("POST /lmsp/v1/responses 503") > refused_before,
            what="the SDK's first try did not reach the web",
        )
        for name, log in logs.items():
            wait_until(
                lambda log=log: outage_lines(log)[0], what=f"the {name} process never saw the outage", timeout=30
            )
        proxy.up()

        # The first request after the return is served (a stale connection replaced, not answered with an error).
        status, again = call(base, "GET", f"/lmsp/v1/tasks/{short['id']}", token=token)
        assert (status, again["id"]) == (200, short["id"]), again
        asking.join(timeout=60)
        assert "error" not in answer, answer
        assert answer["response"].status in ("completed", "incomplete"), answer

        # The stream opened before the outage went on through it: every event once, in order, to the end.
        events = seen + stream.all()
        numbers = [int(event.id) for event in events]
        assert numbers == list(range(numbers[0], numbers[0] + len(numbers))), numbers
        assert events[-1].event in ("task.succeeded", "response.completed", "response.incomplete"), events[-1]
        done = wait_until(lambda: finished(base, token, long["id"]), what="the long task never ended", timeout=120)
        assert done["status"] == "succeeded", done
        assert_contiguous_events(long["id"])
        reading.join(timeout=120)
        assert "error" not in streamed, streamed.get("error")
        numbers = [event.sequence_number for event in streamed["events"]]
        assert numbers == list(range(numbers[0], numbers[0] + len(numbers))), numbers
        assert streamed["events"][-1].type in ("response.completed", "response.incomplete"), streamed["events"][-1]

        # One line per process for the outage, one for its end; no traceback anywhere.
        for name, log in logs.items():
            wait_until(lambda log=log: outage_lines(log)[1], what=f"the {name} process never saw the end", timeout=30)
        for name, log in logs.items():
            started, ended = outage_lines(log)
            assert len(started) == 1 and len(ended) == 1, (name, started, ended)
            assert f"PostgreSQL at 127.0.0.1:{proxy.port}/" in started[0] and "cannot be reached" in started[0]
            assert "Traceback" not in log.read_text(), (name, log.read_text()[-3000:])
        assert " 500 " not in logs["web"].read_text()
        access = [
            line for line in logs["web"].read_text().splitlines() if " 503 " in line and "POST /lmsp/v1/tasks" in line
        ]
        assert access and all("problem=service_unavailable" in line and "client=-" not in line for line in access)

        scraped = metrics_text(base)
        assert "lmsp_database_up 1.0" in scraped
        for process in ("web", "worker", "maintenance", "webhooks"):
            assert f'lmsp_database_unavailable_total{{process="{process}",reason="unreachable"}} 1.0' in scraped
        status, health = call(base, "GET", "/healthz")
        assert (status, health["checks"]["database"]) == (200, {"status": "up"})
        # Nothing accepted was lost: the four tasks the service took, and only those, all ended well.
        assert sorted(Task.objects.values_list("status", flat=True)) == ["succeeded"] * 4


@contextmanager
def worker_through_proxy(outage_env: dict[str, Any], log: Path) -> Iterator[tuple[OutageProxy, str]]:
    """A web on the database and a worker (threads pool) reaching it through an outage proxy: the proxy and the
    web's base URL. PostgreSQL only."""
    if not is_postgres():
        pytest.skip("a database server's outage, under the worker alone")
    settings_dict = connection.settings_dict
    host, port = settings_dict.get("HOST") or "127.0.0.1", int(settings_dict.get("PORT") or 5432)
    with outage_proxy((host, port)) as proxy:
        through_proxy = database_url().replace(f"@{host}:{port}/", f"@127.0.0.1:{proxy.port}/")
        env = outage_env["env"]
        with (
            uvicorn_process(database_url(), env) as web,
            # Its node does not report itself: a report's connection, opened at any moment, would send the
            # statements (its connection's set-up ends with a COMMIT) that a test's proxy waits for from a verb.
            celery_worker(
                env={**env, "DATABASE_URL": through_proxy, "LMSP_WORKER_REPORT_SECONDS": "0"},
                queue=outage_env["queue"],
                log_path=log,
                pool="threads",
            ),
        ):
            yield proxy, web.base


def test_a_task_whose_worker_loses_the_database_as_it_starts_waits_and_runs_once(outage_env, tmp_path: Path):
    """Two moments of a task's start, each made exact by the proxy going down right after the worker sent it:

    - its claim's ``COMMIT``: the server commits it and the answer is lost, so the claim's retry finds the task
      ``loading`` under this worker's name; before, the worker dropped it as another's and it stayed ``loading``
      until the reaper failed it by its policy (seen in bench/database_outage.py);
    - the read of its model's record: before, the task failed with ``model_load_failed``.

    Each task waits for the database and runs, once; each outage is one line and its end one line."""
    token, log = outage_env["token"], tmp_path / "worker.log"
    with worker_through_proxy(outage_env, log) as (proxy, base):
        # The idle worker's first commit is the claim's.
        for number, pattern in enumerate((b"COMMIT", b'FROM "models" WHERE "models"."name" IN'), start=1):
            proxy.down_after(pattern)
            status, task = call(base, "POST", "/lmsp/v1/tasks", token=token, body=task_body())
            assert status == 202
            assert proxy.went_down.wait(30), f"the worker never sent {pattern!r}"
            time.sleep(1)
            proxy.up()
            done = wait_until(lambda task=task: finished(base, token, task["id"]), what="no end", timeout=60)
            assert done["status"] == "succeeded", (pattern, done)
            assert Task.objects.get(pk=task["id"]).attempts == 1
            wait_until(lambda number=number: len(outage_lines(log)[1]) == number, what="the end was not logged")
    text = log.read_text()
    assert "claimed (its first claim's answer was lost)" in text, text[-6000:]
    started, ended = outage_lines(log)
    assert len(started) == len(ended) == 2 and all("cannot be reached" in line for line in started), started
    assert "Traceback" not in text, text[-3000:]


def test_a_lock_held_past_the_timeout_is_a_503_the_sdk_retries_through_logged_once(outage_env, tmp_path: Path):
    """Another writer frozen inside its transaction holds SQLite's write lock past ``LMSP_DB_LOCK_TIMEOUT_SECONDS``.
    (PostgreSQL's row locks answer the same 503 through the same code: tests/test_lock_contention.py.)"""
    if is_postgres():
        pytest.skip("SQLite's one write lock; PostgreSQL's are in tests/test_lock_contention.py")
    log = tmp_path / "web.log"
    env = {**outage_env["env"], "LMSP_DB_LOCK_TIMEOUT_SECONDS": "0.5", "LMSP_DB_BUSY_RETRY_AFTER_SECONDS": "1"}
    with uvicorn_process(database_url(), env, log_path=log) as web:
        client = OpenAI(base_url=f"{web.base}/lmsp/v1", api_key=outage_env["token"], timeout=60)
        answer: dict[str, Any] = {}

        def ask() -> None:
            answer["response"] = client.responses.create(model="demo", input="Hi", background=True)

        with database_write_locked():
            status, headers, body = call_with_headers(
                web.base, "POST", "/lmsp/v1/tasks", token=outage_env["token"], body=task_body()
            )
            assert_retryable_problem(status, headers, body)
            asking = threading.Thread(target=ask)
            asking.start()
            wait_until(lambda: log.read_text().count(" 503 ") >= 2, what="the SDK's first try was not refused")
        asking.join(timeout=30)
        assert answer["response"].status == "queued", answer
        wait_until(lambda: outage_lines(log)[1], what="the web never logged the lock's end")
        started, ended = outage_lines(log)
        assert len(started) == 1 and "locked by another writer" in started[0], started
        assert len(ended) == 1, ended
        assert "Traceback" not in log.read_text() and " 500 " not in log.read_text()
    assert Task.objects.count() == 1


@contextmanager
def mounted(*commands: list[str], target: Path) -> Iterator[None]:
    """Run the mount commands (a real read-only view, a real small disk); skip where this machine refuses them."""
    target.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(commands[0], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount here ({done.stderr.decode().strip()}): needs root or CAP_SYS_ADMIN")
    try:
        for command in commands[1:]:
            subprocess.run(command, check=True, capture_output=True)
        yield
    finally:
        subprocess.run(["umount", "-l", str(target)], capture_output=True)


def test_a_read_only_sqlite_file_answers_503_to_writes_and_keeps_what_it_holds(outage_env, api, tmp_path: Path):
    """The web started on a read-only view of the database file (a volume mounted ``:ro``, say): reads are served,
    writes get a 503 that says so, and the tasks accepted before are all there."""
    if is_postgres():
        pytest.skip("a SQLite file's own condition")
    accepted = api.create_task("Before").json()
    # What an installation has from its first start (a test's database was emptied before it).
    service_id_get()
    database = Path(connection.settings_dict["NAME"])
    view = tmp_path / "read-only"
    log = tmp_path / "web.log"
    with mounted(
        ["mount", "--bind", str(database.parent), str(view)],
        ["mount", "-o", "remount,ro,bind", str(view)],
        target=view,
    ):
        url = f"sqlite:///{view / database.name}"
        with uvicorn_process(url, {**outage_env["env"], "DATABASE_URL": url}, log_path=log) as web:
            token = api.token
            status, read = call(web.base, "GET", f"/lmsp/v1/tasks/{accepted['id']}", token=token)
            assert (status, read["status"]) == (200, "queued"), read
            status, headers, body = call_with_headers(web.base, "POST", "/lmsp/v1/tasks", token=token, body=task_body())
            assert "read-only" in assert_retryable_problem(status, headers, body)["detail"]
            status, headers, health = call_with_headers(web.base, "GET", "/healthz")
            assert_retryable_problem(status, headers, health)
            assert health["checks"]["database"]["reason"] == "read_only", health
            for _ in range(3):
                assert call(web.base, "POST", "/lmsp/v1/tasks", token=token, body=task_body())[0] == 503
    started, _ = outage_lines(log)
    assert len(started) == 1 and "refuses writes (read-only)" in started[0], started
    assert "Traceback" not in log.read_text()
    assert list(Task.objects.values_list("id", "status")) == [(accepted["id"], "queued")]


def _copy_database(target: Path) -> None:
    source = sqlite3.connect(connection.settings_dict["NAME"])
    copy = sqlite3.connect(target)
    try:
        source.backup(copy)
        copy.execute("PRAGMA journal_mode=WAL")
    finally:
        copy.close()
        source.close()


def _fill(disk: Path) -> Path:
    """Write a file until the disk has no room left."""
    filler = disk / "filler"
    chunk = b"\0" * 65536
    with filler.open("wb", buffering=0) as out:
        try:
            while True:
                out.write(chunk)
        except OSError:
            pass
        try:
            while True:
                out.write(b"\0" * 512)
        except OSError:
            pass
    return filler


def test_a_full_disk_answers_507_keeps_the_running_task_and_resumes_when_room_is_made(outage_env, tmp_path: Path):
    """SQLite on a small disk of its own (tmpfs): filled while a task generates. New work gets ``507
    insufficient_storage`` with ``Retry-After``; the running task's commits wait, and once room is made it ends
    with every event, in order."""
    if is_postgres():
        pytest.skip("a SQLite file's own condition")
    disk = tmp_path / "disk"
    database = disk / "lmsp.sqlite3"
    logs = {name: tmp_path / f"{name}.log" for name in ("web", "worker")}
    size_mb = Path(connection.settings_dict["NAME"]).stat().st_size // 2**20 + 16
    with mounted(["mount", "-t", "tmpfs", "-o", f"size={size_mb}m", "tmpfs", str(disk)], target=disk):
        _copy_database(database)
        url = f"sqlite:///{database}"
        env = {**outage_env["env"], "DATABASE_URL": url}
        token, base = outage_env["token"], ""
        with (
            uvicorn_process(url, env, log_path=logs["web"]) as web,
            celery_worker(env=env, queue=outage_env["queue"], log_path=logs["worker"], pool="threads"),
        ):
            base = web.base
            status, task = call(base, "POST", "/lmsp/v1/tasks", token=token, body=task_body("demo:endless", 600))
            assert status == 202
            with open_stream(base, f"/lmsp/v1/tasks/{task['id']}/events", token=token) as stream:
                seen = stream.take(3)
                # The log's file is emptied first: from here every new frame needs a new page of the disk.
                with sqlite3.connect(database, timeout=30) as raw:
                    raw.execute("PRAGMA wal_checkpoint(TRUNCATE)")
                filler = _fill(disk)
                # A write may still fit in log pages that a failed write left allocated: every answer is a 507
                # or a 202 whose task is kept, and the disk refuses within a few tries.
                accepted_meanwhile: list[str] = []
                for _ in range(5):
                    status, headers, body = call_with_headers(
                        base, "POST", "/lmsp/v1/tasks", token=token, body=task_body()
                    )
                    if status != 202:
                        break
                    accepted_meanwhile.append(body["id"])
                assert_retryable_problem(status, headers, body, code=507)
                wait_until(lambda: outage_lines(logs["worker"])[0], what="the worker never met the full disk")
                filler.unlink()
                events = seen + stream.all()
            numbers = [int(event.id) for event in events]
            assert numbers == list(range(numbers[0], numbers[0] + len(numbers))), numbers
            for task_id in (task["id"], *accepted_meanwhile):
                done = wait_until(lambda task_id=task_id: finished(base, token, task_id), what="no end", timeout=120)
                assert done["status"] == "succeeded", done
            status, after = call(base, "POST", "/lmsp/v1/tasks", token=token, body=task_body())
            assert status == 202, after
            wait_until(lambda: all(outage_lines(log)[1] for log in logs.values()), what="an end was never logged")
    for name, log in logs.items():
        started, ended = outage_lines(log)
        assert len(started) == 1 and "is full" in started[0], (name, started)
        assert len(ended) == 1, (name, ended)
        assert "Traceback" not in log.read_text(), (name, log.read_text()[-3000:])


# --------------------------------------------------------------------------- #
# What an error means, and one line per outage (in this process)
# --------------------------------------------------------------------------- #


def _django_error(raw: BaseException) -> BaseException:
    """``raw`` as Django raises it, whichever driver raised it: Django's class of the same name, the driver's
    error as its cause (what ``DatabaseErrorWrapper`` does)."""
    import psycopg
    from django.db import utils

    driver = psycopg if isinstance(raw, psycopg.Error) else sqlite3
    for name in ("DataError", "OperationalError", "IntegrityError", "InternalError", "ProgrammingError"):
        if isinstance(raw, getattr(driver, name)):
            wrapped = getattr(utils, name)(*raw.args)
            wrapped.__cause__ = raw
            return wrapped
    raise AssertionError(f"not a driver error: {raw!r}")


def _sqlite_error(tmp_path: Path, statement: str, *, read_only: bool = False, locked: bool = False) -> BaseException:
    path = tmp_path / "classify.sqlite3"
    setup = sqlite3.connect(path, isolation_level=None)
    setup.execute("CREATE TABLE IF NOT EXISTS t (x UNIQUE)")
    setup.execute("INSERT OR IGNORE INTO t VALUES (1)")
    if locked:
        setup.execute("BEGIN IMMEDIATE")
    uri = f"file:{path}?mode=ro" if read_only else f"file:{path}"
    other = sqlite3.connect(uri, uri=True, timeout=0, isolation_level=None)
    try:
        other.execute(statement)
    except sqlite3.Error as error:
        return _django_error(error)
    finally:
        other.close()
        setup.close()
    raise AssertionError(f"{statement} did not fail")


@pytest.mark.database_free
def test_sqlite_errors_are_told_apart_by_their_result_codes(tmp_path: Path):
    from tasks_app.plumbing.database_outages import Unavailable, database_unavailability

    assert database_unavailability(_sqlite_error(tmp_path, "INSERT INTO t VALUES (2)", read_only=True)) == (
        Unavailable.READ_ONLY
    )
    assert database_unavailability(_sqlite_error(tmp_path, "BEGIN IMMEDIATE", locked=True)) == Unavailable.LOCKED
    # A bug or bad data: retrying would fail the same way, so it is not an outage.
    assert database_unavailability(_sqlite_error(tmp_path, "SELECT * FROM missing")) is None
    assert database_unavailability(_sqlite_error(tmp_path, "INSERT INTO t VALUES (1)")) is None
    folder = tmp_path / "a-folder"
    folder.mkdir()
    try:
        sqlite3.connect(folder).execute("SELECT 1")
    except sqlite3.Error as error:
        assert database_unavailability(_django_error(error)) == Unavailable.UNREACHABLE


@pytest.mark.database_free
def test_postgresql_errors_are_told_apart_by_sqlstate_and_a_refused_connection_is_unreachable():
    import psycopg
    from psycopg import errors

    from tasks_app.plumbing.database_outages import Unavailable, database_unavailability
    from tests.support.server import free_port

    try:
        psycopg.connect(host="127.0.0.1", port=free_port(), connect_timeout=2)
    except psycopg.OperationalError as refused:
        assert database_unavailability(_django_error(refused)) == Unavailable.UNREACHABLE
    for error, reason in (
        (errors.AdminShutdown(), Unavailable.UNREACHABLE),
        (errors.CannotConnectNow(), Unavailable.UNREACHABLE),
        (errors.TooManyConnections(), Unavailable.UNREACHABLE),
        (errors.DiskFull(), Unavailable.FULL),
        (errors.ReadOnlySqlTransaction(), Unavailable.READ_ONLY),
        (errors.LockNotAvailable(), Unavailable.LOCKED),
        (errors.UniqueViolation(), None),
        (errors.UndefinedTable(), None),
    ):
        assert database_unavailability(_django_error(error)) == reason, error


@pytest.mark.database_free
def test_an_outage_is_logged_once_and_its_end_once_it_has_held(tmp_path: Path, caplog, monkeypatch):
    from tasks_app.plumbing import database_outages
    from tasks_app.plumbing.database_outages import (
        database_available_noted,
        database_outage,
        database_unavailable_noted,
    )

    monkeypatch.setattr(database_outages, "SETTLE_SECONDS", 0.2)
    caplog.set_level("WARNING", logger="tasks_app.database")
    error = _sqlite_error(tmp_path, "INSERT INTO t VALUES (2)", read_only=True)
    for _ in range(3):
        database_unavailable_noted(error)
    assert database_outage() is not None
    # A flap: one write went through, the next failed within the settling time. Still the same outage.
    database_available_noted()
    assert database_outage() is None
    database_unavailable_noted(error)
    time.sleep(0.3)
    assert database_outage() is not None
    database_available_noted()
    database_available_noted()
    wait_until(lambda: len(caplog.records) == 2, what="the end was never logged")
    time.sleep(0.3)
    lines = [record.getMessage() for record in caplog.records]
    assert len(lines) == 2, lines
    assert lines[0].startswith("database unavailable: ") and "refuses writes (read-only)" in lines[0]
    assert lines[1].startswith("database available again: ") and "3 more failures meanwhile" in lines[1]
    assert database_outage() is None
