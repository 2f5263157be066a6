"""What the service logs: one access line per request (never a query string), and
maintenance rounds that did nothing stay out of the INFO log."""

from __future__ import annotations

import logging
import re
import time
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace

import pytest
from asgiref.sync import async_to_sync
from django.http import HttpResponse
from django.test import AsyncClient, RequestFactory
from django.utils import timezone

from lmsp_project.celery import app
from tasks_app.edge.access_log import access_line
from tasks_app.models import Task
from tasks_app.plumbing.notify import key, redis_client
from tests.support.db import database_url
from tests.support.namespace import REDIS_PREFIX
from tests.support.tasks import create, wait_for_status
from tests.support.waiting import wait_until
from tests.support.worker import celery_worker

ACCESS = "lmsp.access"
# Celery's routine lines about the maintenance jobs, as they were before: three per round.
ROUTINE = re.compile(r"Sending due task|lmsp\.(sweep_queued|reap_abandoned|cleanup)\[")


def access_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [record.getMessage() for record in caplog.records if record.name == ACCESS]


def test_each_request_gets_one_access_line_with_its_status_and_client_and_no_query(api, caplog):
    task = create(api)
    caplog.clear()
    caplog.set_level(logging.INFO, logger=ACCESS)

    reply = api.get(f"/lmsp/v1/tasks/{task['id']}", token="secret", after="x")
    assert reply.status_code == 200
    missing = api.get("/lmsp/v1/nothing-here", token="secret")
    assert missing.status_code == 404

    lines = access_lines(caplog)
    assert len(lines) == 2, lines
    assert re.fullmatch(
        rf"GET /lmsp/v1/tasks/{task['id']} 200 \d+\.\dms client={api.client.pk} peer=127\.0\.0\.1", lines[0]
    ), lines
    assert re.fullmatch(
        r"GET /lmsp/v1/nothing-here 404 \d+\.\dms problem=not_found client=- peer=127\.0\.0\.1", lines[1]
    ), lines
    # The query string (a stream token rides there) is in no record at all.
    assert not [record for record in caplog.records if "secret" in record.getMessage()]
    # The access line says it; Django's warning per 4xx would say it twice.
    assert not [record for record in caplog.records if record.name == "django.request"]


def test_a_refusal_s_access_line_names_its_problem_and_the_field_at_fault(api, caplog):
    caplog.set_level(logging.INFO, logger=ACCESS)

    refused = api.post("/lmsp/v1/responses", {"model": "demo", "input": "Hi", "top_logprobs": 3})
    invalid = api.post("/lmsp/v1/responses", {"model": "demo", "input": "Hi", "max_output_tokens": "many"})
    # A field name is the client's text: it stays one token on the line, whatever it holds.
    forged = api.post("/lmsp/v1/responses", {"model": "demo", "input": "Hi", "x\nGET / 200": 1})

    assert [reply.status_code for reply in (refused, invalid, forged)] == [400, 400, 400]
    lines = access_lines(caplog)
    assert re.fullmatch(
        rf"POST /lmsp/v1/responses 400 \d+\.\dms problem=unsupported_parameter param=top_logprobs "
        rf"client={api.client.pk} peer=127\.0\.0\.1",
        lines[0],
    ), lines
    assert " problem=invalid_request param=max_output_tokens " in lines[1], lines
    assert " problem=invalid_request param=x%0AGET%20/%20200 " in lines[2], lines
    assert all("\n" not in line for line in lines)


def test_an_event_stream_answered_by_its_headers_alone_is_logged_as_a_stream(caplog):
    """Under the ASGI server a stream's view answers only the headers; the events follow outside Django."""
    caplog.set_level(logging.INFO, logger=ACCESS)
    request = RequestFactory().post("/lmsp/v1/responses", REMOTE_ADDR="127.0.0.1")
    headers_only = HttpResponse(status=200, content_type="text/event-stream; charset=utf-8")

    access_line(request, headers_only, time.perf_counter())

    assert re.fullmatch(
        r"POST /lmsp/v1/responses 200 \d+\.\dms stream client=- peer=127\.0\.0\.1", access_lines(caplog)[0]
    )


def test_a_stream_token_in_the_url_never_reaches_the_log(db, caplog):
    """The event stream (an async view, through the middleware's async path) with ``?token=``."""
    caplog.set_level(logging.INFO, logger=ACCESS)

    get = async_to_sync(AsyncClient().get)
    reply = get("/lmsp/v1/tasks/task_01J00000000000000000000000/events", {"token": "secret"})

    assert reply.status_code == 401
    lines = access_lines(caplog)
    assert len(lines) == 1, lines
    assert lines[0].startswith("GET /lmsp/v1/tasks/task_01J00000000000000000000000/events 401 "), lines
    assert lines[0].endswith(" client=- peer=127.0.0.1"), lines
    assert not [record for record in caplog.records if "secret" in record.getMessage()]


def _rounds(node: str) -> dict[str, int]:
    """How often the node ran each maintenance job (Celery's own counters)."""
    stats = app.control.inspect(destination=[node], timeout=2).stats() or {}
    return stats.get(node, {}).get("total", {})


def test_a_maintenance_round_that_does_nothing_logs_nothing_at_info(api, transactional_db, tmp_path: Path):
    queue = f"{REDIS_PREFIX}-quiet"
    env = {
        "DATABASE_URL": database_url(),
        "LMSP_REDIS_PREFIX": REDIS_PREFIX,
        # Runs go to a queue nobody consumes: this node only does maintenance.
        "LMSP_TASK_QUEUE": f"{REDIS_PREFIX}-idle",
        "LMSP_MAINTENANCE_QUEUE": f"{queue}-maintenance",
        "LMSP_SWEEP_INTERVAL_SECONDS": "1",
        "LMSP_REAP_INTERVAL_SECONDS": "1",
        "LMSP_CLEANUP_INTERVAL_SECONDS": "1",
        "LMSP_SWEEP_GRACE_SECONDS": "0",
    }
    with celery_worker(env=env, queue=queue, log_path=tmp_path / "beat.log", beat=True, name="quiet") as node:
        # The node logs "ready" before its control consumer answers; a loaded machine can take seconds more.
        names = wait_until(
            lambda: [name for name in (app.control.inspect(timeout=2).ping() or {}) if name.startswith("quiet@")],
            what=lambda: f"the maintenance node never answered a ping:\n{node.log()[-3000:]}",
        )
        assert len(names) == 1, names
        wait_until(
            lambda: all(_rounds(names[0]).get(job, 0) >= 2 for job in ("lmsp.sweep_queued", "lmsp.reap_abandoned")),
            what=lambda: f"no two maintenance rounds ran:\n{node.log()[-3000:]}",
        )
        assert not ROUTINE.findall(node.log()), node.log()[-3000:]

        # A round that does something still says so: a waiting task whose message is lost.
        waiting = create(api)["id"]
        redis_client().delete(key("dispatched", waiting))
        Task.objects.filter(pk=waiting).update(updated_at=timezone.now() - timedelta(seconds=60))
        node.wait_for_log(f"sweeper re-dispatched 1 waiting task(s): {waiting}")
        assert not ROUTINE.findall(node.log()), node.log()[-3000:]


# --------------------------------------------------------------------------- #
# The worker's log (issue 41): a client's problem is one line, a fault its traceback
# --------------------------------------------------------------------------- #


def test_a_prompt_over_the_context_is_one_line_in_the_worker_log_not_a_traceback(api, running_worker):
    context_length = api.get("/lmsp/v1/models/demo").json()["context_length"]
    task = create(api, "word " * context_length, max_output_tokens=5)
    done = wait_for_status(api, task["id"], {"succeeded", "failed", "cancelled"})
    assert (done["status"], done["error"]["code"]) == ("failed", "context_length_exceeded")

    line = f"task {task['id']} failed: context_length_exceeded: {done['error']['detail']}"
    running_worker.wait_for_log(line)
    log = running_worker.log()
    # From the claim to the failure: that one line, at INFO, and no traceback or error line.
    run = log[log.index(f"task {task['id']} claimed") : log.index(line)]
    assert "Traceback" not in run and " ERROR " not in run and " WARNING " not in run, run
    assert f" INFO workers.execution: {line}" in log


@pytest.mark.database_free
def test_a_runs_fault_keeps_its_traceback_and_a_clients_problem_does_not(monkeypatch, caplog):
    """What the worker logs as it fails a task, for each kind of error its run raises (the failing
    commit itself is replaced: what is logged before it is under test)."""
    from workers import run_endings
    from workers.backends.errors import ContextTooLong, PromptRejected

    monkeypatch.setattr(run_endings, "fail", lambda run, problem, sources: problem["code"])
    run = SimpleNamespace(task_id="task_01J00000000000000000000000")
    caplog.set_level(logging.INFO, logger="workers.execution")

    for client_error in (ContextTooLong("the prompt has 9 tokens"), PromptRejected("the template rejects it")):
        assert run_endings.failed_by(run, client_error, sources=[]) in ("context_length_exceeded", "invalid_request")
    assert not caplog.records

    try:
        raise RuntimeError("a bug")
    except RuntimeError as exc:
        assert run_endings.failed_by(run, exc, sources=[]) == "backend_error"
    (record,) = caplog.records
    assert record.levelno == logging.ERROR and record.exc_info is not None
    assert record.getMessage() == f"task {run.task_id}: backend error" and "a bug" in str(record.exc_info[1])
