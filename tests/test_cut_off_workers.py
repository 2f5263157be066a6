"""Workers cut off from the database (issue 24): the message of a claim that could not be made is kept,
a message that vanished is sent again within a bound, and (PostgreSQL) a host silent in the middle of a
commit loses its tasks to the reaper within the heartbeat timeout and two reaper rounds.

Everything here runs real processes: Celery workers, a maintenance node with beat, the broker.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from django.conf import settings
from django.db import connection

from tasks_app.models import Task, TaskEvent
from tasks_app.plumbing import broker
from tasks_app.plumbing.notify import key, redis_client
from tasks_app.states import TaskStatus
from tests.support.db import database_url, is_postgres, raw_connection
from tests.support.lab import Lab
from tests.support.queues import drop_messages
from tests.support.server import free_port
from tests.support.tcp_proxy import cuttable_proxy
from tests.support.waiting import wait_until

TERMINAL = {"succeeded", "failed", "cancelled"}


def unreachable_database(tmp_path: Path) -> str:
    """A DATABASE_URL the worker cannot open: a PostgreSQL port nobody listens on, a SQLite "file" that is a folder."""
    if is_postgres():
        return f"postgres://postgres@127.0.0.1:{free_port()}/test"
    folder = tmp_path / "unreachable.sqlite3"
    folder.mkdir()
    return f"sqlite:///{folder}"


def message_on_broker(task_id: str) -> bool:
    found = broker.run_messages_find()
    assert found is not None and found.complete
    return task_id in found.task_ids


def test_a_worker_that_reaches_redis_but_not_the_database_puts_the_message_back(lab: Lab, tmp_path: Path):
    with lab.worker("cut-off", DATABASE_URL=unreachable_database(tmp_path)) as cut_off:
        task_id = lab.create("fail")
        cut_off.wait_for_log(f"task {task_id}: task_claim", timeout=60)
        cut_off.wait_for_log("sending its message again", timeout=60)
    # The cut-off worker stopped (warm: its try ended first). Neither lost nor hidden: still queued,
    # a message of it waits on the queue, and its marker says so.
    assert Task.objects.get(pk=task_id).status == TaskStatus.QUEUED
    assert message_on_broker(task_id)
    assert redis_client().exists(key("dispatched", task_id))
    with lab.worker("healthy") as healthy:
        done = lab.wait_for(task_id, TERMINAL, healthy)
    assert done["status"] == "succeeded"
    assert Task.objects.get(pk=task_id).attempts == 1
    assert "Traceback" not in cut_off.log()


def test_a_queued_task_whose_message_is_gone_is_sent_again_within_the_sweep_bound(lab: Lab, tmp_path: Path):
    # No worker yet: the task waits with its marker; then its message vanishes (the marker stays).
    task_id = lab.create("fail")
    drop_messages(lab.queue, [task_id])
    assert redis_client().exists(key("dispatched", task_id))
    with (
        lab.maintenance(LMSP_SWEEP_GRACE_SECONDS="1", LMSP_SWEEP_INTERVAL_SECONDS="1") as maintenance,
        lab.worker("runner") as runner,
    ):
        # Its marker would vouch for it for an hour (LMSP_DISPATCH_MARKER_TTL_SECONDS); the sweeper's check
        # of the queue finds it gone within the grace period and a sweep (docs/scaling.md), waited for here
        # with room for a slow machine.
        maintenance.wait_for_log(f"have no message on the broker (lost); sending again: {task_id}", timeout=60)
        done = lab.wait_for(task_id, TERMINAL, runner)
    assert done["status"] == "succeeded"


ON_POSTGRES = settings.DATABASES["default"]["ENGINE"].endswith("postgresql")


def sessions_idle_in_transaction(ports: set[int]) -> list[tuple[int, float]]:
    """(client port, seconds idle) of the server's sessions from ``ports`` that sit idle inside a transaction."""
    raw = raw_connection()
    try:
        rows = raw.execute(
            "SELECT client_port, extract(epoch FROM now() - state_change) FROM pg_stat_activity "
            "WHERE state = 'idle in transaction'"
        ).fetchall()
    finally:
        raw.close()
    return [(port, float(idle)) for port, idle in rows if port in ports]


def deltas(task_id: str) -> list[dict]:
    rows = TaskEvent.objects.filter(task_id=task_id).order_by("sequence_number").values_list("payload", flat=True)
    return [json.loads(row) for row in rows]


@pytest.mark.skipif(not ON_POSTGRES, reason="SQLite has no connection to cut: its frozen writer is in test_recovery.py")
def test_a_worker_host_cut_off_in_the_middle_of_a_commit_loses_its_task_within_the_reap_bound(lab: Lab, tmp_path: Path):
    # A heartbeat timeout with room for a loaded machine: the healthy worker must not look dead.
    heartbeat_timeout, reap_interval, idle = 6, 1, 2
    sd = connection.settings_dict
    host, port = sd.get("HOST") or "127.0.0.1", int(sd.get("PORT") or 5432)
    maintenance_env = {
        "LMSP_HEARTBEAT_TIMEOUT_SECONDS": str(heartbeat_timeout),
        "LMSP_REAP_INTERVAL_SECONDS": str(reap_interval),
        "LMSP_SWEEP_INTERVAL_SECONDS": "1",
        "LMSP_SWEEP_GRACE_SECONDS": "1",
    }
    with cuttable_proxy((host, port)) as proxy:
        through_proxy = database_url().replace(f":{port}/", f":{proxy.port}/")
        cut_off_env = {
            "DATABASE_URL": through_proxy,
            "LMSP_DB_IDLE_IN_TRANSACTION_SECONDS": str(idle),
            "LMSP_HEARTBEAT_TIMEOUT_SECONDS": str(heartbeat_timeout),
            # Every model call waits a little: still generating when cut, however fast the machine.
            "LMSP_FAULT_MODEL_CALL_SECONDS": "0.002",
        }
        with (
            lab.maintenance(**maintenance_env) as maintenance,
            lab.worker("cut-off", **cut_off_env) as cut_off,
        ):
            task_id = lab.create("resume", tokens=3000)
            wait_until(
                lambda: TaskEvent.objects.filter(task_id=task_id, type="response.output_text.delta").count() >= 3,
                what=lambda: f"no deltas:\n{cut_off.log()[-3000:]}",
            )
            held_by = Task.objects.get(pk=task_id).worker
            # Cut once the next batch's snapshot row reached the server: its transaction holds the task's row.
            # (The lifecycle writes that row with its own INSERT statement, unquoted.)
            proxy.cut_after(b"INSERT INTO task_snapshots ")
            assert proxy.cut_happened.wait(30), (
                f"the worker committed no batch through the proxy: the task is {Task.objects.get(pk=task_id).status}"
                f"\n{cut_off.log()[-3000:]}"
            )
            cut_at = time.monotonic()
            shown = deltas(task_id)
            with lab.worker("healthy") as healthy:
                # The server drops the silent session's transaction (and its row lock) within seconds...
                wait_until(
                    lambda: not sessions_idle_in_transaction(proxy.upstream_ports),
                    what=lambda: f"still idle in transaction: {sessions_idle_in_transaction(proxy.upstream_ports)}",
                    timeout=idle + 15,
                )
                # ...so the reaper takes the task within the heartbeat timeout and two rounds (docs/scaling.md;
                # with room for a slow machine), and a healthy worker resumes it.
                wait_until(
                    lambda: Task.objects.get(pk=task_id).worker not in (held_by,),
                    what=lambda: f"the task was not reaped:\n{maintenance.log()[-3000:]}",
                    timeout=heartbeat_timeout + 2 * reap_interval + 15,
                )
                reaped_after = time.monotonic() - cut_at
                done = lab.wait_for(task_id, TERMINAL, healthy)
                # The cut heals: the cut-off worker's late commit is refused, it stops.
                proxy.heal()
                cut_off.wait_for_log(f"task {task_id} was taken from this worker while it could not write", timeout=60)
    print(f"reaped {reaped_after:.1f} s after the cut (heartbeat timeout {heartbeat_timeout} s)")
    assert "reaper:" in maintenance.log()
    assert done["status"] == "succeeded"
    log = deltas(task_id)
    assert [event["sequence_number"] for event in log] == list(range(len(log)))
    assert log[: len(shown)] == shown
    assert [event["type"] for event in log].count("response.output_item.added") == 1
    text = "".join(event["delta"] for event in log if event["type"] == "response.output_text.delta")
    assert done["response"]["output"][0]["content"][0]["text"] == text
    assert Task.objects.get(pk=task_id).attempts == 2
