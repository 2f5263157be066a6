"""Recovery and the reaper through their services, on the real database, without processes.

The crashes themselves are in test_recovery.py; here are the rules around
them: which tasks count as leftovers, the compare-and-set against a worker
that is alive after all, attempts, chunked scans, a second run, and the
sweeper's share (tasks left waiting for a worker to resume them).
"""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys
from datetime import timedelta

import pytest
from django.db import connection
from django.test import Client as DjangoClient
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from tasks_app import states
from tasks_app.core import lifecycle
from tasks_app.core.lifecycle import RecoveryMove
from tasks_app.exceptions import ServerRestarted
from tasks_app.models import Task, TaskEvent, TaskSnapshot
from tasks_app.plumbing.notify import key, redis_client
from tasks_app.services.dispatch import queued_tasks_sweep
from tasks_app.services.recovery import (
    CANCELLED,
    FAILED,
    LOST_RACE,
    RAISED,
    REQUEUED,
    RESUMED,
    LiveWorkers,
    abandoned_tasks_reap,
    held_task_release,
    leftover_tasks_recover,
)
from tasks_app.services.tasks import task_cancel
from tasks_app.states import RestartPolicy, TaskStatus
from tests.support.db import database_url
from tests.support.namespace import REDIS_PREFIX
from tests.support.queues import queued_ids
from tests.support.server import REPO
from tests.support.specs import spec_json
from tests.support.waiting import wait_until
from tests.support.worker import process_stopped
from workers.shutdown import task_handed_back_log

S = TaskStatus
GHOST = "ghost@nowhere/1"
FAILURE = ServerRestarted("test").to_problem()


@pytest.fixture
def held(make_client, demo_model, queue, settings):
    """``held(status, policy, age=seconds)``: a task a worker GHOST took, its last heartbeat that old."""
    client, _ = make_client()

    def make(
        status: TaskStatus,
        policy: RestartPolicy = RestartPolicy.FAIL,
        age: int = 600,
        attempts: int = 1,
        started: bool = True,
    ) -> str:
        task = lifecycle.task_insert(
            client=client,
            request={"model": "demo", "input": "x"},
            generation=spec_json({"model": "demo", "input": "x"}),
            model="demo",
        )
        Task.objects.filter(pk=task.id).update(on_restart=policy)
        if status == S.QUEUED:
            return task.id
        beat = timezone.now() - timedelta(seconds=age)
        assert lifecycle.task_claim(task_id=task.id, worker=GHOST).won
        if status == S.RUNNING or (status == S.CANCELLING and started):
            snapshot = {"token_ids": [], "state": {"item_id": "msg_1", "backend": {}}}
            assert lifecycle.task_start(task_id=task.id, worker=GHOST, item_id="msg_1", snapshot=snapshot).won
            assert lifecycle.task_progress(
                task_id=task.id, worker=GHOST, item_id="msg_1", deltas=[], output_tokens=7
            ).won
        if status == S.CANCELLING:
            assert lifecycle.task_request_cancel(task_id=task.id).won
        # (started=False: cancelled while loading, before its output item opened.)
        # The worker's last heartbeat, `age` seconds ago, after `attempts` starts.
        Task.objects.filter(pk=task.id).update(heartbeat_at=beat, attempts=attempts)
        return task.id

    return make


def nobody(asked_at=None) -> LiveWorkers:
    return LiveWorkers(frozenset(), frozenset(), asked_at or timezone.now())


def status(task_id: str) -> str:
    return Task.objects.get(pk=task_id).status


def test_a_task_started_too_often_fails_instead_of_running_again(held, settings):
    settings.LMSP_MAX_ATTEMPTS = 3
    worn = held(S.RUNNING, RestartPolicy.RETRY, attempts=3)
    fresh = held(S.RUNNING, RestartPolicy.RETRY, attempts=2)

    summary = leftover_tasks_recover(live=nobody())

    assert summary.task_ids["failed"] == [worn] and summary.task_ids["queued"] == [fresh]
    # A retry starts over: no output counted yet; the failed task keeps its count.
    assert Task.objects.get(pk=fresh).output_tokens == 0
    assert Task.objects.get(pk=worn).output_tokens == 7
    error = Task.objects.get(pk=worn).error
    assert error["code"] == "server_restarted"
    assert "started 3 times" in error["detail"]


def test_live_workers_keep_their_tasks_and_queued_tasks_wait_for_them(held):
    asked = timezone.now()
    running_live = held(S.RUNNING)
    running_dead = held(S.RUNNING)
    queued = held(S.QUEUED)
    live = LiveWorkers(frozenset({"w1@host"}), frozenset({running_live}), asked)

    summary = leftover_tasks_recover(live=live)

    assert summary.task_ids["held by a live worker"] == [running_live]
    assert summary.task_ids["left queued"] == [queued]
    assert summary.task_ids["failed"] == [running_dead]
    assert (status(running_live), status(queued), status(running_dead)) == (S.RUNNING, S.QUEUED, S.FAILED)


def test_a_task_of_a_live_worker_that_did_not_list_its_tasks_in_time_is_left_alone(held):
    task_id = held(S.RUNNING)
    node = GHOST.partition("/")[0]
    live = LiveWorkers(frozenset({node}), frozenset(), timezone.now(), silent=frozenset({node}))

    summary = leftover_tasks_recover(live=live)

    assert summary.task_ids["held by a live worker"] == [task_id]
    assert status(task_id) == S.RUNNING


def test_a_task_claimed_after_the_workers_were_asked_is_not_a_leftover(held):
    asked = timezone.now() - timedelta(seconds=5)
    claimed_later = held(S.LOADING, age=0)

    summary = leftover_tasks_recover(live=nobody(asked))

    assert summary.task_ids["held by a live worker"] == [claimed_later]
    assert status(claimed_later) == S.LOADING


def test_the_scan_reads_in_chunks_and_a_second_run_changes_nothing(held, queue):
    ids = [held(S.RUNNING, RestartPolicy.RESUME) for _ in range(5)]
    with CaptureQueriesContext(connection) as queries:
        first = leftover_tasks_recover(live=nobody(), batch_size=2)
    scans = [q["sql"] for q in queries if '"tasks"."id" >' in q["sql"] and q["sql"].endswith("LIMIT 2")]
    assert len(scans) == 3  # 2 + 2 + 1
    assert first.task_ids["running (to resume)"] == ids
    assert all(Task.objects.get(pk=i).worker == "" for i in ids)
    assert sorted(queued_ids(queue)) == sorted(ids)
    rows = {t.id: (t.status, t.updated_at, t.last_sequence) for t in Task.objects.filter(pk__in=ids)}

    second = leftover_tasks_recover(live=nobody(), batch_size=2)

    assert second.moved == 0
    assert second.task_ids["left waiting to resume"] == ids
    assert {t.id: (t.status, t.updated_at, t.last_sequence) for t in Task.objects.filter(pk__in=ids)} == rows


def test_the_reaper_takes_only_tasks_whose_heartbeat_stopped(held, settings):
    settings.LMSP_HEARTBEAT_TIMEOUT_SECONDS = 60
    stale = held(S.RUNNING, RestartPolicy.RESUME, age=120)
    fresh = held(S.RUNNING, RestartPolicy.RESUME, age=5)
    stale_loading = held(S.LOADING, RestartPolicy.FAIL, age=120)
    stale_cancelling = held(S.CANCELLING, RestartPolicy.RETRY, age=120)
    queued = held(S.QUEUED)

    summary = abandoned_tasks_reap()

    assert summary.task_ids == {
        "running (to resume)": [stale],
        "failed": [stale_loading],
        "cancelled": [stale_cancelling],
    }
    assert Task.objects.get(pk=fresh).worker == GHOST
    assert status(queued) == S.QUEUED
    assert "stopped reporting" in Task.objects.get(pk=stale_loading).error["detail"]
    assert TaskEvent.objects.filter(task_id=stale_cancelling, type="response.cancelled").count() == 1


def test_a_heartbeat_that_lands_after_the_reaper_looked_keeps_the_task(held):
    task_id = held(S.RUNNING, RestartPolicy.FAIL, age=120)
    seen = Task.objects.get(pk=task_id)
    # The worker was only slow: its heartbeat arrives between the reaper's read and its move.
    assert lifecycle.task_heartbeat(task_id=task_id, worker=GHOST).won

    move = RecoveryMove(task_id, S.RUNNING, S.FAILED, seen.worker, seen.heartbeat_at, FAILURE)
    batch = lifecycle.tasks_recover(moves=[move])

    assert batch.lost == (task_id,) and not batch.won
    assert status(task_id) == S.RUNNING


def test_a_worker_that_lost_its_task_can_no_longer_write_to_it(held):
    task_id = held(S.RUNNING, RestartPolicy.RESUME, age=120)
    abandoned_tasks_reap()
    assert lifecycle.task_adopt(task_id=task_id, worker="new@host/2").won

    late = lifecycle.task_progress(task_id=task_id, worker=GHOST, item_id="msg_1", deltas=["stale"], output_tokens=8)

    assert not late.won
    assert not TaskEvent.objects.filter(task_id=task_id, type="response.output_text.delta").exists()
    assert not lifecycle.task_adopt(task_id=task_id, worker="third@host/3").won


SHUTDOWN = "its worker shut down before it finished"


def test_a_stopping_worker_hands_its_tasks_back_by_their_policies(held, queue, settings):
    settings.LMSP_MAX_ATTEMPTS = 3
    failing = held(S.RUNNING, RestartPolicy.FAIL, age=0)
    retried = held(S.RUNNING, RestartPolicy.RETRY, age=0)
    resumed = held(S.RUNNING, RestartPolicy.RESUME, age=0)
    loading = held(S.LOADING, RestartPolicy.RESUME, age=0)
    cancelling = held(S.CANCELLING, RestartPolicy.RESUME, age=0)
    worn = held(S.RUNNING, RestartPolicy.RETRY, age=0, attempts=3)

    summaries = {
        task_id: held_task_release(task_id=task_id, worker=GHOST, reason=SHUTDOWN)
        for task_id in (failing, retried, resumed, loading, cancelling, worn)
    }

    assert {task_id: dict(summary.task_ids) for task_id, summary in summaries.items()} == {
        failing: {FAILED: [failing]},
        retried: {REQUEUED: [retried]},
        resumed: {RESUMED: [resumed]},
        # A task still loading has nothing to resume from: it starts over, as it would after a crash.
        loading: {REQUEUED: [loading]},
        cancelling: {CANCELLED: [cancelling]},
        worn: {FAILED: [worn]},
    }
    rows = {t.id: t for t in Task.objects.filter(pk__in=summaries)}
    assert {task_id: (row.status, row.worker) for task_id, row in rows.items()} == {
        failing: (S.FAILED, GHOST),
        retried: (S.QUEUED, ""),
        resumed: (S.RUNNING, ""),
        loading: (S.QUEUED, ""),
        cancelling: (S.CANCELLED, GHOST),
        worn: (S.FAILED, GHOST),
    }
    assert rows[failing].error["code"] == "server_restarted"
    assert rows[failing].error["detail"] == f"The task was running when {SHUTDOWN}"
    assert "started 3 times" in rows[worn].error["detail"]
    assert TaskEvent.objects.filter(task_id=failing, type="response.failed").count() == 1
    assert TaskEvent.objects.filter(task_id=cancelling, type="response.cancelled").count() == 1
    # Attempts are counted by the claim, as after any recovery: a hand-back adds none.
    assert {task_id: row.attempts for task_id, row in rows.items()} == {
        **dict.fromkeys((failing, retried, resumed, loading, cancelling), 1),
        worn: 3,
    }
    # The resumed task keeps what it committed; the rerun starts from nothing.
    assert TaskSnapshot.objects.filter(task_id=resumed).exists()
    assert not TaskSnapshot.objects.filter(task_id=retried).exists()
    assert rows[retried].output_tokens == 0 and rows[resumed].output_tokens == 7
    # What runs again is sent to the workers at once.
    assert sorted(queued_ids(queue)) == sorted([retried, resumed, loading])
    assert all(summaries[task_id].dispatched == 1 for task_id in (retried, resumed, loading))


def test_a_hand_back_touches_only_a_task_that_worker_process_still_holds(held, queue):
    ghost_task = held(S.RUNNING, RestartPolicy.FAIL, age=0)
    taken_over = held(S.RUNNING, RestartPolicy.FAIL, age=0)
    Task.objects.filter(pk=taken_over).update(worker="new@host/2")
    finished = held(S.RUNNING, RestartPolicy.RETRY, age=0)
    assert lifecycle.task_succeed(
        task_id=finished, worker=GHOST, item_id="msg_1", text="", usage=None, output_tokens=7
    ).won
    waiting = held(S.QUEUED, RestartPolicy.FAIL)
    rows = ("status", "worker", "heartbeat_at", "last_sequence", "updated_at")
    before = {t["id"]: t for t in Task.objects.values("id", *rows)}

    touched = [
        # Another process of the same node, and one whose pid merely starts the same: not this one.
        held_task_release(task_id=ghost_task, worker=f"{GHOST}1", reason=SHUTDOWN),
        held_task_release(task_id=ghost_task, worker=GHOST.replace("/1", "/2"), reason=SHUTDOWN),
        held_task_release(task_id=taken_over, worker=GHOST, reason=SHUTDOWN),
        held_task_release(task_id=finished, worker=GHOST, reason=SHUTDOWN),
        held_task_release(task_id=waiting, worker=GHOST, reason=SHUTDOWN),
        held_task_release(task_id="task_missing", worker=GHOST, reason=SHUTDOWN),
    ]

    assert [summary.task_ids for summary in touched] == [{}] * len(touched)
    assert {t["id"]: t for t in Task.objects.values("id", *rows)} == before
    # Nothing was sent: none of them runs again.
    assert queued_ids(queue) == []
    # And the process that does hold it gets its move.
    assert held_task_release(task_id=ghost_task, worker=GHOST, reason=SHUTDOWN).task_ids == {FAILED: [ghost_task]}


def test_a_handed_back_task_gets_one_line_saying_what_its_policy_made_of_it(held, caplog):
    retried = held(S.RUNNING, RestartPolicy.RETRY, age=0)
    taken_over = held(S.RUNNING, RestartPolicy.FAIL, age=0)
    Task.objects.filter(pk=taken_over).update(worker="new@host/2")

    with caplog.at_level(logging.WARNING, logger="workers.shutdown"):
        for task_id in (retried, taken_over):
            summary = held_task_release(task_id=task_id, worker=GHOST, reason=SHUTDOWN)
            task_handed_back_log(task_id=task_id, summary=summary)

    lines = [record.getMessage() for record in caplog.records if record.name == "workers.shutdown"]
    assert lines == [
        f"task {retried} interrupted by shutdown; on_restart=retry: it is queued again and runs anew "
        "at the next start (or on another running worker)",
        f"task {taken_over} interrupted by shutdown; on_restart=fail: new@host/2 holds it now",
    ]


def test_the_sweeper_resends_tasks_waiting_to_be_resumed_and_a_cancel_reaches_them(held, queue):
    waiting = held(S.RUNNING, RestartPolicy.RESUME, age=120)
    abandoned_tasks_reap()
    redis_client().delete(queue, key("dispatched", waiting))
    Task.objects.filter(pk=waiting).update(updated_at=timezone.now() - timedelta(seconds=60))

    assert queued_tasks_sweep(grace_seconds=30) == [waiting]

    # Cancelled while it waits: the adopting worker finishes the cancel, so it stays sendable.
    task_cancel(task=Task.objects.get(pk=waiting))
    redis_client().delete(queue, key("dispatched", waiting))
    Task.objects.filter(pk=waiting).update(updated_at=timezone.now() - timedelta(seconds=60))
    assert status(waiting) == S.CANCELLING
    assert queued_tasks_sweep(grace_seconds=30) == [waiting]


def test_the_command_as_a_service_start_runs_it(held, queue):
    """``manage.py lmsp_recover`` in its own process, as scripts/quickstart runs it."""
    running = held(S.RUNNING, RestartPolicy.FAIL)
    cancelling = held(S.CANCELLING, RestartPolicy.RESUME)
    env = {
        **os.environ,
        "DATABASE_URL": database_url(),
        "LMSP_REDIS_PREFIX": REDIS_PREFIX,
        "LMSP_TASK_QUEUE": queue,
        "LMSP_RECOVER_INSPECT_SECONDS": "0.3",
    }

    done = subprocess.run(
        [sys.executable, "manage.py", "lmsp_recover"], cwd=REPO, env=env, capture_output=True, text=True, timeout=60
    )

    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert "lmsp_recover: live workers: none" in lines
    assert "lmsp_recover: failed: 1" in lines and "lmsp_recover: cancelled: 1" in lines
    assert (status(running), status(cancelling)) == (S.FAILED, S.CANCELLED)


def task_writers() -> set[int]:
    """PostgreSQL: the server processes of the other sessions that hold a write lock on this database's tasks
    table. None on SQLite, whose file locks end with the process that held them."""
    if connection.vendor != "postgresql":
        return set()
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT DISTINCT l.pid FROM pg_locks l JOIN pg_class c ON c.oid = l.relation"
            " WHERE l.database = (SELECT oid FROM pg_database WHERE datname = current_database())"
            " AND c.relname = %s AND l.mode = 'RowExclusiveLock' AND l.granted AND l.pid <> pg_backend_pid()",
            [Task._meta.db_table],
        )
        return {pid for (pid,) in cursor.fetchall()}


def database_sessions() -> set[int]:
    """PostgreSQL: the server processes of every session now open (none on SQLite)."""
    if connection.vendor != "postgresql":
        return set()
    with connection.cursor() as cursor:
        cursor.execute("SELECT pid FROM pg_stat_activity")
        return {pid for (pid,) in cursor.fetchall()}


@pytest.mark.slow
def test_a_recovery_killed_mid_run_leaves_each_task_moved_with_its_event_or_untouched(held, queue):
    """A page of tasks moves in one transaction: killed inside its second page, the first page stays
    moved (each task with its one event: terminal, or response.queued for a rerun), every other task untouched;
    a rerun finishes."""
    policies = [RestartPolicy.FAIL, RestartPolicy.RETRY, RestartPolicy.RESUME]
    ids = sorted(held(found, policy) for found in (S.QUEUED, S.LOADING, S.RUNNING, S.CANCELLING) for policy in policies)
    row = ("status", "worker", "last_sequence", "updated_at")
    before = {t["id"]: t for t in Task.objects.filter(pk__in=ids).values("id", "on_restart", *row)}
    env = {
        **os.environ,
        "DATABASE_URL": database_url(),
        "LMSP_REDIS_PREFIX": REDIS_PREFIX,
        "LMSP_TASK_QUEUE": queue,
        "LMSP_RECOVER_INSPECT_SECONDS": "0.2",
        "LMSP_FAULT_FREEZE": "tasks_recover@2",
    }
    proc = subprocess.Popen(
        [sys.executable, "manage.py", "lmsp_recover", "--batch-size", "5"],
        cwd=REPO,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    try:
        wait_until(
            lambda: proc.poll() is not None or process_stopped(proc.pid), what="lmsp_recover did not reach its fault"
        )
        assert proc.poll() is None, proc.stderr.read()
        frozen_sessions = task_writers()
        assert frozen_sessions or connection.vendor != "postgresql"
    finally:
        proc.kill()  # a crash inside the second page's transaction
        proc.wait()
    # PostgreSQL ends a dead client's transaction when its server process sees the connection close: on a
    # loaded machine after the rerun below had started, which then found the page's rows still locked
    # and rightly left them for its next round (a parallel CI run). The rerun waits for that end here.
    wait_until(
        lambda: not frozen_sessions & database_sessions(), what="the killed recovery's database session never ended"
    )

    after = {t["id"]: t for t in Task.objects.filter(pk__in=ids).values("id", *row)}
    for task_id in ids:
        old, new = before[task_id], after[task_id]
        added = list(
            TaskEvent.objects.filter(task_id=task_id, sequence_number__gt=old["last_sequence"]).values_list(
                "type", flat=True
            )
        )
        target = states.recovery_target(old["status"], old["on_restart"])
        if task_id in ids[:5] and (old["status"], target) != (S.QUEUED, S.QUEUED):
            assert new["status"] == target, task_id
            if target in states.RUNS_AGAIN:
                assert new["worker"] == "", task_id
            # A terminal move writes its terminal event; a requeue its response.queued; a resume none.
            expected = [f"response.{target}"] if target in states.TERMINAL or target == S.QUEUED else []
            assert added == expected, task_id
        else:
            assert {name: new[name] for name in row} == {name: old[name] for name in row}, task_id
            assert added == [], task_id

    again = leftover_tasks_recover(live=nobody(), batch_size=5)
    assert again.counts[FAILED] + again.counts[CANCELLED] + again.counts[REQUEUED] + again.counts[RESUMED] > 0
    assert not again.counts[LOST_RACE]
    assert leftover_tasks_recover(live=nobody(), batch_size=5).moved == 0


# --------------------------------------------------------------------------- #
# No single task stops recovery (issue 24)
# --------------------------------------------------------------------------- #


def recovery_errors() -> dict[str, int]:
    from tasks_app.metrics.store import recovery_errors_key

    return {name.decode(): int(count) for name, count in redis_client().hgetall(recovery_errors_key()).items()}


@pytest.mark.parametrize("recovery", ["startup", "reaper"])
def test_a_task_cancelled_before_its_start_is_cancelled_without_output(held, queue, recovery):
    cancelled = held(S.CANCELLING, RestartPolicy.RESUME, started=False)
    beside = held(S.LOADING, RestartPolicy.FAIL)

    summary = leftover_tasks_recover(live=nobody()) if recovery == "startup" else abandoned_tasks_reap()

    assert summary.task_ids == {CANCELLED: [cancelled], FAILED: [beside]}
    log = list(TaskEvent.objects.filter(task_id=cancelled).order_by("sequence_number").values_list("type", flat=True))
    assert log == ["response.created", "response.cancelled"]
    response = Task.objects.select_related("response").get(pk=cancelled).response
    assert (response.status, response.output) == ("cancelled", [])


def corrupt_output_item(task_id: str) -> None:
    """What a damaged row in the event log leaves: an output item whose stored payload no longer parses."""
    TaskEvent.objects.filter(task_id=task_id, type="response.output_item.added").update(payload="{damaged")


@pytest.mark.parametrize("recovery", ["startup", "reaper"])
def test_a_task_whose_recovery_raises_is_logged_counted_and_left_while_the_rest_move(held, queue, recovery, caplog):
    # Pages of two: the damaged task shares its page with a healthy one, and later pages follow.
    ids = [held(S.RUNNING, RestartPolicy.FAIL) for _ in range(5)]
    damaged = ids[1]
    corrupt_output_item(damaged)
    before = Task.objects.values("status", "worker", "last_sequence", "heartbeat_at").get(pk=damaged)
    errors_before = recovery_errors().get(recovery, 0)

    def recover():
        if recovery == "startup":
            return leftover_tasks_recover(live=nobody(), batch_size=2)
        return abandoned_tasks_reap(batch_size=2)

    with caplog.at_level(logging.ERROR, logger="tasks_app.services.recovery"):
        summary = recover()

    assert summary.task_ids == {FAILED: [i for i in ids if i != damaged], RAISED: [damaged]}
    assert Task.objects.values("status", "worker", "last_sequence", "heartbeat_at").get(pk=damaged) == before
    assert not TaskEvent.objects.filter(task_id=damaged, type="response.failed").exists()
    for task_id in ids:
        if task_id != damaged:
            assert TaskEvent.objects.filter(task_id=task_id, type="response.failed").count() == 1
    logged = [record for record in caplog.records if record.levelno == logging.ERROR]
    assert len(logged) == 1 and damaged in logged[0].getMessage()
    assert "JSONDecodeError" in logged[0].getMessage() and logged[0].exc_info
    assert recovery_errors().get(recovery, 0) == errors_before + 1
    assert "could not be recovered (next round): 1" in summary.lines()

    # Left for the next round: tried again (and counted again) until someone repairs it.
    assert recover().task_ids == {RAISED: [damaged]}
    assert recovery_errors().get(recovery, 0) == errors_before + 2
    scraped = DjangoClient().get("/metrics").content.decode()
    assert f'lmsp_recovery_errors_total{{source="{recovery}"}} {errors_before + 2}.0' in scraped


def run_recover_command(database: str, queue: str) -> subprocess.CompletedProcess:
    env = {
        **os.environ,
        "DATABASE_URL": database,
        "LMSP_REDIS_PREFIX": REDIS_PREFIX,
        "LMSP_TASK_QUEUE": queue,
        "LMSP_RECOVER_INSPECT_SECONDS": "0.3",
    }
    return subprocess.run(
        [sys.executable, "manage.py", "lmsp_recover"], cwd=REPO, env=env, capture_output=True, text=True, timeout=60
    )


def test_the_command_exits_zero_when_a_task_raises_and_non_zero_only_without_a_database(held, queue, tmp_path):
    damaged = held(S.RUNNING, RestartPolicy.FAIL)
    corrupt_output_item(damaged)
    healthy = held(S.CANCELLING, RestartPolicy.FAIL, started=False)

    done = run_recover_command(database_url(), queue)

    assert done.returncode == 0, done.stderr
    assert "lmsp_recover: could not be recovered (next round): 1" in done.stdout.splitlines()
    assert "lmsp_recover: cancelled: 1" in done.stdout.splitlines()
    assert damaged in done.stderr  # the log line names it
    assert (status(damaged), status(healthy)) == (S.RUNNING, S.CANCELLED)

    # A database that cannot be reached: a PostgreSQL port nobody listens on, a SQLite "file" that is a folder.
    if connection.vendor == "sqlite":
        (tmp_path / "not-a-file.sqlite3").mkdir()
        unreachable = f"sqlite:///{tmp_path / 'not-a-file.sqlite3'}"
    else:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        unreachable = f"postgres://postgres@127.0.0.1:{port}/test"

    done = run_recover_command(unreachable, queue)

    assert done.returncode == 1
    assert "the database cannot be reached" in done.stderr
    assert "Traceback" not in done.stderr
    assert status(damaged) == S.RUNNING
