"""A writer frozen inside its transaction (SIGSTOP, a paused VM, swap) makes nobody wait unbounded.

The freeze is real: a worker process stops itself (``tasks_app.faults``)
inside the transaction of its first batch commit, holding SQLite's write lock
or the task row's lock on PostgreSQL, until the test sends SIGCONT.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from django.db import connection
from django.utils import timezone

from tasks_app.core import lifecycle
from tasks_app.models import Task, TaskEvent
from tasks_app.registry.scan import model_scan
from tasks_app.services.recovery import BUSY, abandoned_tasks_reap
from tasks_app.services.retention import retention_cleanup
from tasks_app.services.tasks import task_create
from tasks_app.states import TaskStatus
from tests.support.db import database_url, raw_connection
from tests.support.demo import ENDLESS_MODEL, ENDLESS_TAG
from tests.support.namespace import REDIS_PREFIX
from tests.support.server import uvicorn_process
from tests.support.specs import spec_json, spec_of
from tests.support.sse import call_with_headers
from tests.support.waiting import wait_until
from tests.support.worker import celery_worker, kill_process_group, maintenance_queue, process_stopped

S = TaskStatus
WORKER = "test@host/1"


@pytest.fixture
def lab_env(
    transactional_db, demo_models_root: Path, endless_model_dir: Path, tmp_path: Path, settings
) -> dict[str, str]:
    """Models and a queue of the test's own; the environment of its web and worker processes."""
    models = tmp_path / "models"
    shutil.copytree(demo_models_root / "demo", models / "demo")
    shutil.copytree(endless_model_dir, models / "demo" / ENDLESS_TAG)
    settings.LMSP_MODELS_DIR = models
    model_scan(models_dir=models)
    queue = f"{REDIS_PREFIX}-{tmp_path.name}"
    settings.LMSP_TASK_QUEUE = queue
    return {
        "DATABASE_URL": database_url(),
        "REDIS_URL": settings.REDIS_URL,
        "LMSP_REDIS_PREFIX": REDIS_PREFIX,
        "LMSP_TASK_QUEUE": queue,
        "LMSP_MODELS_DIR": str(models),
        "LMSP_DB_LOCK_TIMEOUT_SECONDS": "1",
        "LMSP_HEARTBEAT_SECONDS": "1",
    }


def _running_pid(task_id: str, worker: Any) -> int:
    held = wait_until(
        lambda: Task.objects.filter(pk=task_id, status=S.RUNNING).exclude(worker="").first(),
        what=lambda: f"the task never ran:\n{worker.log()[-3000:]}",
    )
    return int(held.worker.rpartition("/")[2])


BODY = {"type": "response", "input": {"model": "demo", "input": "Tell me a story", "max_output_tokens": 64}}


@pytest.mark.slow
def test_a_worker_frozen_inside_its_commit_gets_503s_and_skipped_rows_not_waits(
    lab_env: dict[str, str], make_client, tmp_path: Path
):
    _, token = make_client("alice")
    body = BODY
    # Slowed model calls: the 64 tokens outlast the worker's first commit window (50 ms), so a progress
    # commit comes, and freezes, however fast the machine (a fast one made them all before it, in 49 ms).
    worker_env = {**lab_env, "LMSP_FAULT_FREEZE": "task_progress", "LMSP_FAULT_MODEL_CALL_SECONDS": "0.01"}
    with (
        uvicorn_process(database_url(), lab_env) as web,
        celery_worker(env=worker_env, queue=lab_env["LMSP_TASK_QUEUE"], log_path=tmp_path / "worker.log") as worker,
    ):
        status, _, task = call_with_headers(web.base, "POST", "/lmsp/v1/tasks", token=token, body=body)
        assert status == 202
        pid = _running_pid(task["id"], worker)
        wait_until(lambda: process_stopped(pid), what=lambda: f"the worker did not freeze:\n{worker.log()[-3000:]}")
        try:
            before = Task.objects.count()
            # A cancel needs the frozen task's row: its lock (PostgreSQL) or the write lock (SQLite).
            status, headers, problem = call_with_headers(
                web.base, "POST", f"/lmsp/v1/tasks/{task['id']}/cancel", token=token
            )
            assert (status, problem["code"]) == (503, "service_unavailable"), problem
            assert int(headers["retry-after"]) >= 1
            status, headers, problem = call_with_headers(web.base, "POST", "/lmsp/v1/tasks", token=token, body=body)
            if connection.vendor == "sqlite":
                # One write lock for the whole file: a creation waits its bounded time and writes nothing.
                assert (status, problem["code"]) == (503, "service_unavailable"), problem
                assert "retry-after" in headers
                assert Task.objects.count() == before
            else:
                # Row locks: a new task does not touch the frozen one.
                assert status == 202
            # The reaper (every heartbeat counts as stale here) leaves the locked task for its next round.
            summary = abandoned_tasks_reap(timeout_seconds=0)
            assert summary.task_ids.get(BUSY) == [task["id"]]
            assert Task.objects.get(pk=task["id"]).status == S.RUNNING
        finally:
            os.kill(pid, signal.SIGCONT)
        done = wait_until(
            lambda: Task.objects.filter(pk=task["id"], status=S.SUCCEEDED).first(),
            what=lambda: f"the task did not finish after the thaw:\n{worker.log()[-3000:]}",
        )
        # The batch that was frozen mid-commit is in the log once, in order.
        sequences = list(TaskEvent.objects.filter(task_id=done.id).values_list("sequence_number", flat=True))
        assert sequences == list(range(done.last_sequence + 1))
        status, _, _ = call_with_headers(web.base, "POST", "/lmsp/v1/tasks", token=token, body=body)
        assert status == 202


def _deltas(task_id: str) -> str:
    rows = TaskEvent.objects.filter(task_id=task_id, type="response.output_text.delta").order_by("sequence_number")
    return "".join(json.loads(payload)["delta"] for payload in rows.values_list("payload", flat=True))


@pytest.mark.slow
def test_a_writer_frozen_inside_its_commit_costs_the_other_rows_nothing_they_committed(
    lab_env: dict[str, str], make_client, tmp_path: Path, settings
):
    """Issue 24: one worker frozen inside a commit (SIGSTOP), another generating a ``resume`` task beside it.

    SQLite: the frozen process holds the only write lock, so the other worker cannot commit; after the
    heartbeat timeout it stops its row and hands the task back by its policy (or, the lock still held, leaves
    it to the reaper): the ``resume`` task is resumed from what it committed, never failed. PostgreSQL: the
    frozen process holds only its own task's row, the other runs on untouched, and the server ends the frozen
    session's transaction, so the reaper takes the frozen task while its process is still stopped.
    """
    client, _ = make_client("alice")
    timeouts = {
        # Room for a loaded machine: the steady worker must not look dead while it can write.
        "LMSP_HEARTBEAT_TIMEOUT_SECONDS": "6",
        "LMSP_REAP_INTERVAL_SECONDS": "1",
        "LMSP_SWEEP_INTERVAL_SECONDS": "1",
        "LMSP_SWEEP_GRACE_SECONDS": "1",
        "LMSP_DB_IDLE_IN_TRANSACTION_SECONDS": "2",
        # Slowed model calls: both rows are still generating at the freeze, however fast the machine.
        "LMSP_FAULT_MODEL_CALL_SECONDS": "0.002",
    }
    env = {**lab_env, **timeouts}
    queue = lab_env["LMSP_TASK_QUEUE"]
    # The freezer consumes a queue of its own and is up before the task beside starts: that row's
    # 3,000 slowed tokens then only have to outlast the frozen task's first three commits, not a
    # worker's start on a loaded machine (which once took longer than the row).
    freezer_queue = f"{queue}-freezer"

    def create(policy: str) -> str:
        request = {"model": ENDLESS_MODEL, "input": "Tell me a long story", "max_output_tokens": 3000}
        reply = task_create(
            client=client,
            request=request,
            spec=spec_of(request),
            on_restart=policy,
            idempotency_key=f"k-{policy}",
            request_hash="h",
        )
        return reply.body["id"]

    with (
        celery_worker(
            env=env,
            queue=maintenance_queue(queue),
            log_path=tmp_path / "maintenance.log",
            name="maintenance",
            beat=True,
            maintenance=False,
        ),
        # The row beside is slowed more: on a loaded machine the freezer's claim, model load and first three
        # commits once took longer than 3,000 tokens at 2 ms (17 s), and the row had ended before the freeze.
        celery_worker(
            env={**env, "LMSP_FAULT_MODEL_CALL_SECONDS": "0.005"},
            queue=queue,
            log_path=tmp_path / "steady.log",
            name="steady",
        ) as steady,
        celery_worker(
            env={**env, "LMSP_FAULT_FREEZE": "task_progress@3", "LMSP_TASK_QUEUE": freezer_queue},
            queue=freezer_queue,
            log_path=tmp_path / "freezer.log",
            name="freezer",
        ) as freezer,
    ):
        beside = create("resume")
        _running_pid(beside, steady)
        settings.LMSP_TASK_QUEUE = freezer_queue
        frozen = create("fail")
        pid = _running_pid(frozen, freezer)
        wait_until(lambda: process_stopped(pid), what=lambda: f"no freeze:\n{freezer.log()[-3000:]}")
        if connection.vendor == "sqlite":
            steady.wait_for_log(f"task {beside} stopped: task_progress", timeout=60)
            kill_process_group(freezer.proc)  # the frozen writer dies: the lock is free again
        else:
            # The server ended the frozen session: the reaper takes its task while the process still sleeps.
            wait_until(
                lambda: Task.objects.get(pk=frozen).status == S.FAILED,
                what=lambda: f"the frozen task was not reaped:\n{steady.log()[-2000:]}",
                timeout=60,
            )
            assert process_stopped(pid)
            kill_process_group(freezer.proc)
        done = wait_until(
            lambda: Task.objects.filter(pk=beside, status=S.SUCCEEDED).first(),
            what=lambda: f"the task beside did not finish:\n{steady.log()[-3000:]}",
            timeout=120,
        )
        ended = wait_until(lambda: Task.objects.filter(pk=frozen, status=S.FAILED).first(), what="not reaped")

    # Beside: one output item, every committed delta kept, the text is its deltas; never a backend_error.
    log = list(TaskEvent.objects.filter(task_id=beside).order_by("sequence_number").values_list("type", flat=True))
    assert log.count("response.output_item.added") == 1 and log[-1] == "response.incomplete"
    assert done.response.output[0]["content"][0]["text"] == _deltas(beside)
    assert done.attempts == (2 if connection.vendor == "sqlite" else 1)
    if connection.vendor == "sqlite":
        assert "adopted to resume" in steady.log()
    # The frozen task: its policy (fail), server_restarted, and the text it had committed.
    assert ended.error["code"] == "server_restarted"
    assert ended.response.output[0]["content"][0]["text"] == _deltas(frozen)
    assert "backend_error" not in steady.log()


def _wait_stale(task_id: str, *, seconds: float) -> None:
    stamped = Task.objects.get(pk=task_id).heartbeat_at
    wait_until(lambda: timezone.now() - stamped > timedelta(seconds=seconds), what="the clock did not move")


@pytest.mark.slow
def test_a_worker_frozen_between_commits_past_the_timeout_is_reaped_and_its_late_writes_lost(
    lab_env: dict[str, str], make_client, tmp_path: Path
):
    """The issue's case: a `fail` task whose worker froze longer than the heartbeat timeout ends
    `failed` by the reaper, and the worker, when it thaws, can no longer write to it."""
    client, _ = make_client("alice")
    # The endless model: a demo generation can end by itself while the worker runs between two stops,
    # and a task that succeeded is never reaped.
    long_body = {**BODY["input"], "model": ENDLESS_MODEL, "max_output_tokens": 4000}
    with celery_worker(env=lab_env, queue=lab_env["LMSP_TASK_QUEUE"], log_path=tmp_path / "worker.log") as worker:
        task = task_create(
            client=client,
            request=long_body,
            spec=spec_of(long_body),
            on_restart="fail",
            idempotency_key=None,
            request_hash=None,
        )
        task_id = task.body["id"]
        pid = _running_pid(task_id, worker)
        os.kill(pid, signal.SIGSTOP)
        try:
            _wait_stale(task_id, seconds=2)
            # A stop that landed inside a commit holds the lock: let it finish that one commit and stop again.
            for _ in range(30):
                if abandoned_tasks_reap(timeout_seconds=2).moved:
                    break
                os.kill(pid, signal.SIGCONT)
                time.sleep(0.01)
                os.kill(pid, signal.SIGSTOP)
                wait_until(lambda: process_stopped(pid), what="the worker did not stop")
                _wait_stale(task_id, seconds=2)
            else:
                pytest.fail(f"the reaper never moved the frozen task: {Task.objects.get(pk=task_id).status}")
        finally:
            os.kill(pid, signal.SIGCONT)
        worker.wait_for_log(f"task {task_id} left to failed by another writer")
    done = Task.objects.get(pk=task_id)
    assert done.status == S.FAILED and done.error["code"] == "server_restarted"
    types = list(TaskEvent.objects.filter(task_id=task_id).order_by("sequence_number").values_list("type", flat=True))
    assert types[-1] == "response.failed" and types.count("response.failed") == 1
    assert len(types) == done.last_sequence + 1


def _running_task(make_client) -> str:
    client, _ = make_client("alice")
    task = lifecycle.task_insert(
        client=client,
        request={"model": "demo", "input": "x"},
        generation=spec_json({"model": "demo", "input": "x"}),
        model="demo",
    )
    assert lifecycle.task_claim(task_id=task.id, worker=WORKER).won
    assert lifecycle.task_start(task_id=task.id, worker=WORKER, item_id="msg_1").won
    return task.id


def _hold_write_lock(task_id: str) -> Any:
    """Another connection inside a write transaction: SQLite's write lock, or the task row's lock."""
    raw = raw_connection()
    if connection.vendor == "sqlite":
        raw.isolation_level = None
        raw.execute("BEGIN IMMEDIATE")
    else:
        raw.execute("BEGIN")
        raw.execute("UPDATE tasks SET updated_at = updated_at WHERE id = %s", [task_id])
    return raw


@pytest.mark.django_db(transaction=True)
def test_a_heartbeat_that_waited_for_the_lock_longer_than_the_timeout_is_fresh(make_client):
    task_id = _running_task(make_client)
    Task.objects.filter(pk=task_id).update(heartbeat_at=timezone.now() - timedelta(seconds=120))
    holder = _hold_write_lock(task_id)
    results: list[Any] = []

    def beat() -> None:
        try:
            results.append(lifecycle.task_heartbeat(task_id=task_id, worker=WORKER))
        finally:
            connection.close()

    thread = threading.Thread(target=beat)
    thread.start()
    time.sleep(2.0)  # longer than the reaper's timeout below: the heartbeat waits for the lock all along
    holder.execute("COMMIT")
    holder.close()
    thread.join(timeout=30)
    assert results and results[0].won

    summary = abandoned_tasks_reap(timeout_seconds=1)

    assert summary.moved == 0
    assert Task.objects.get(pk=task_id).status == S.RUNNING


@pytest.mark.django_db(transaction=True)
def test_the_reaper_judges_staleness_on_the_clock_heartbeats_are_written_with(make_client):
    task_id = _running_task(make_client)
    stamped = Task.objects.get(pk=task_id).heartbeat_at
    # A fresh commit is not stale by a timeout of a minute, and is by one of zero once time moves on.
    assert abandoned_tasks_reap(timeout_seconds=60).moved == 0
    wait_until(lambda: timezone.now() > stamped, what="the clock did not move")
    assert abandoned_tasks_reap(timeout_seconds=0).moved == 1


@pytest.mark.django_db(transaction=True)
def test_cleanup_leaves_what_a_frozen_writer_holds_for_its_next_round(make_client, settings):
    client, _ = make_client("alice")
    task = lifecycle.task_insert(
        client=client,
        request={"model": "demo", "input": "x"},
        generation=spec_json({"model": "demo", "input": "x"}),
        model="demo",
    )
    assert lifecycle.task_cancel_queued(task_id=task.id).won
    old = timezone.now() - timedelta(seconds=settings.LMSP_TASK_RETENTION_SECONDS + 60)
    Task.objects.filter(pk=task.id).update(updated_at=old)
    holder = _hold_write_lock(task.id)
    try:
        summary = retention_cleanup()
    finally:
        holder.execute("ROLLBACK")
        holder.close()
    assert summary.tasks == 0
    assert Task.objects.filter(pk=task.id).exists()
    assert retention_cleanup().tasks == 1
