"""The admin as an on-call operator uses it (issue 47), in a real browser against real workers.

Headless chromium (Playwright) on the session's uvicorn; tasks run on real
Celery workers over the test database (SQLite and PostgreSQL). A worker
frozen with SIGSTOP shows silent on the workers page, with its task counted
stuck, and its task page says so, all before the reaper's heartbeat timeout;
"Hand back now" refuses a live worker's task and hands back the frozen
one's, after asking; "Run again" makes a linked task that runs; a reaped
task and one its worker handed back at shutdown show both attempts with
their reasons. With ``LMSP_ADMIN_SCREENSHOTS=<folder>`` the tests keep
screenshots of the pages they pass (``docs/admin.md`` shows them).
"""

from __future__ import annotations

import os
import re
import signal
import socket
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from django.conf import settings as django_settings
from django.contrib.admin.models import LogEntry
from django.contrib.auth.models import User
from django.db import DatabaseError, transaction
from django.db.models import F

from tasks_app.core import lifecycle
from tasks_app.exceptions import DatabaseBusy, ModelLoadFailed
from tasks_app.models import Task, TaskAttempt, TaskEvent, WorkerNode
from tasks_app.plumbing.db_locks import lock_wait, stale_before
from tasks_app.services.dispatch import task_dispatch
from tasks_app.services.recovery import abandoned_tasks_reap
from tasks_app.states import AttemptEnd, TaskStatus
from tests.conftest import WORKER_QUEUE, shared_worker
from tests.support.browser import assert_static_served, login
from tests.support.demo import ENDLESS_MODEL
from tests.support.specs import spec_json
from tests.support.tasks import create, wait_for_status
from tests.support.waiting import wait_until
from tests.support.worker import WorkerProcess, process_stopped

pytestmark = pytest.mark.slow

OPERATOR = "operator"
WIDTH = 1280
# The text of a node's row on the workers page (the script's argument is its name).
NODE_ROW = (
    "[...document.querySelectorAll('#result_list tbody tr')]"
    ".find(r => r.querySelector('th.field-name')?.innerText.trim() === name)?.innerText || ''"
)
# The freezable worker's node name (``<name>@<host>``), apart from the session's workers (``test@<host>``).
FREEZABLE = "freezable"


@pytest.fixture
def freezable_worker(django_db_setup, django_db_blocker, worker_models_root: Path, tmp_path: Path) -> Iterator:
    """A threads-pool worker of the test's own (the Procfile's kind), slowed to 4 ms a step, on its own queue.

    The test may freeze it (SIGSTOP to its process group: the worker and its engine process) or stop it
    (SIGTERM); it is woken before it is stopped at the end.
    """
    queue = f"{WORKER_QUEUE}-freezable-{uuid.uuid4().hex[:6]}"
    with shared_worker(
        django_db_blocker,
        worker_models_root,
        tmp_path,
        queue=queue,
        pool="threads",
        name=FREEZABLE,
        # Reports every second (the session's workers every 5 s, the default): the web calls it silent after 4.
        LMSP_WORKER_REPORT_SECONDS="1",
        LMSP_FAULT_MODEL_CALL_SECONDS="0.004",
        LMSP_DRAIN_SECONDS="0.5",
    ) as worker:
        try:
            yield worker
        finally:
            if worker.proc.poll() is None:
                os.killpg(worker.proc.pid, signal.SIGCONT)


def freeze(worker: WorkerProcess, task_id: str) -> None:
    """Stop the worker between two of its commits: stopped inside one, it would hold the task's row lock
    (SQLite: the database's write lock) until it thaws, and neither the reaper nor an operator could move
    its task (tests/test_lock_contention.py is about that case). Stopped again until the row is free."""
    for _ in range(100):
        os.killpg(worker.proc.pid, signal.SIGSTOP)
        wait_until(lambda: process_stopped(worker.proc.pid), what="the worker did not stop")
        if row_free(task_id):
            return
        thaw(worker)
        time.sleep(0.05)
    raise AssertionError(f"the worker was inside a commit at each of 100 stops:\n{worker.log()[-3000:]}")


def row_free(task_id: str) -> bool:
    """Whether this process can take the task row's write lock at once (a no-op UPDATE, rolled back)."""
    try:
        with lock_wait(0.3), transaction.atomic():
            Task.objects.filter(pk=task_id).update(status=F("status"))
            transaction.set_rollback(True)
    except (DatabaseError, DatabaseBusy):
        return False
    return True


def thaw(worker: WorkerProcess) -> None:
    os.killpg(worker.proc.pid, signal.SIGCONT)


def node_of(worker: WorkerProcess) -> WorkerNode:
    """The worker's row on the workers page, once it has reported itself."""
    return wait_until(
        lambda: WorkerNode.objects.filter(pk=f"{FREEZABLE}@{socket.gethostname()}").first(),
        what=lambda: f"worker on {worker.queue} never reported itself:\n{worker.log()[-3000:]}",
    )


def on_queue(settings, queue: str, make):
    """``make()`` with the test process dispatching to ``queue``; the setting is restored after."""
    before = settings.LMSP_TASK_QUEUE
    settings.LMSP_TASK_QUEUE = queue
    try:
        return make()
    finally:
        settings.LMSP_TASK_QUEUE = before


def reload_until(tab, condition: str, arg: object = None, timeout: float = 60) -> None:
    """Reload the page until the script ``condition`` holds (a page that does not follow the change itself)."""
    deadline = time.monotonic() + timeout
    while not tab.evaluate(condition, arg):
        if time.monotonic() > deadline:
            raise AssertionError(f"{condition} never held; the page says:\n{tab.inner_text('body')[:3000]}")
        tab.wait_for_timeout(500)
        tab.reload()


def screenshot(tab, name: str) -> None:
    folder = os.environ.get("LMSP_ADMIN_SCREENSHOTS")
    if folder:
        Path(folder).mkdir(parents=True, exist_ok=True)
        # JPEG at 70: the pages are text on flat colours, a tenth of the PNG's bytes, kept in docs/.
        tab.screenshot(path=str(Path(folder) / f"{name}.jpg"), type="jpeg", quality=70, full_page=False)


def attempt_rows(tab) -> list[list[str]]:
    return tab.evaluate(
        "() => [...document.querySelectorAll('tr.lmsp-attempt')].map(r => [...r.cells].map(c => c.innerText.trim()))"
    )


def confirm(tab, button: str) -> None:
    """Press an action's button, see its confirmation page (nothing done yet), and confirm."""
    tab.click(button)
    tab.wait_for_selector("#lmsp-confirm-yes")
    assert "/change/" not in tab.url


@pytest.mark.usefixtures("running_worker")
def test_a_frozen_worker_shows_stuck_and_an_operator_hands_its_task_back_then_runs_it_again(
    api, freezable_worker, web_server, page, settings
):
    assert_static_served(web_server.base)
    User.objects.create_superuser(OPERATOR, "ops@example.org", "an operator password")
    page.set_viewport_size({"width": WIDTH, "height": 900})
    body = {"model": ENDLESS_MODEL, "max_output_tokens": 1500, "seed": 3}
    task = on_queue(settings, freezable_worker.queue, lambda: create(api, "Tell me a long story", **body))
    wait_for_status(api, task["id"], {"running"})
    node = node_of(freezable_worker)
    detail = f"/admin/tasks_app/task/{task['id']}/change/"

    # A live worker's task is not handed back: asked first, then refused, and it keeps running.
    login(page, web_server.base, detail)
    confirm(page, "#lmsp-hand-back")
    page.click("#lmsp-confirm-yes")
    page.wait_for_url(f"{web_server.base}{detail}")
    assert "was not handed back" in page.inner_text(".messagelist"), page.inner_text("body")[:2000]
    assert "it is alive" in page.inner_text(".messagelist")
    assert Task.objects.get(pk=task["id"]).status == TaskStatus.RUNNING

    freeze(freezable_worker, task["id"])
    # The workers page: the node silent, its task counted stuck.
    page.goto(f"{web_server.base}/admin/tasks_app/workernode/")
    # The node goes silent first (its report), then its task's heartbeat: both within seconds.
    reload_until(page, f"name => ({NODE_ROW}).includes('silent for') && ({NODE_ROW}).includes('1 stuck')", node.name)
    row = page.evaluate(f"name => {NODE_ROW}", node.name)
    assert "1 stuck" in row, row
    assert "demo:endless" in row, row
    screenshot(page, "workers")

    # Its task page says the worker went silent (the page polls the heartbeat's age).
    page.goto(f"{web_server.base}{detail}")
    page.wait_for_selector("#lmsp-silent-note", state="visible")
    assert "no heartbeat" in page.inner_text("#lmsp-silent-note")
    screenshot(page, "task-silent")
    # All of it before the reaper would have acted: the task is still its worker's, and not yet stale to
    # the reaper (whose own predicate, on the heartbeats' clock, is this).
    timeout = django_settings.LMSP_HEARTBEAT_TIMEOUT_SECONDS
    assert Task.objects.get(pk=task["id"]).status == TaskStatus.RUNNING
    assert not Task.objects.filter(pk=task["id"], heartbeat_at__lt=stale_before(timeout)).exists()

    # Hand back now: its policy (fail) fails it, and its attempt says who ended it and why.
    confirm(page, "#lmsp-hand-back")
    assert "Hand task" in page.inner_text("h1")
    page.click("#lmsp-confirm-yes")
    page.wait_for_url(f"{web_server.base}{detail}")
    stored = Task.objects.get(pk=task["id"])
    assert stored.status == TaskStatus.FAILED
    assert stored.error["code"] == "server_restarted"
    assert f"an operator ({OPERATOR}) handed it back" in stored.error["detail"]
    [first] = attempt_rows(page)
    assert first[0] == "1" and first[8] == "handed back by an operator", first
    assert f"an operator ({OPERATOR})" in first[9]
    assert "server_restarted" in page.inner_text("#lmsp-summary-error")
    assert LogEntry.objects.filter(object_id=task["id"], change_message__startswith="Hand back").exists()
    screenshot(page, "task-failed")

    # Run again: asked first, then a new task from the same request, linked to this one, that runs.
    confirm(page, "#lmsp-rerun")
    page.click("#lmsp-confirm-yes")
    page.wait_for_url(re.compile(r".*/admin/tasks_app/task/task_\w+/change/$"))
    rerun = Task.objects.get(rerun_of_id=task["id"])
    assert rerun.id in page.url
    assert task["id"] in page.inner_text(".field-rerun_links")
    wait_for_status(api, rerun.id, {"succeeded"})
    assert Task.objects.get(pk=task["id"]).status == TaskStatus.FAILED
    assert LogEntry.objects.filter(object_id=rerun.id, change_message=f"Run again from {task['id']}").exists()
    assert page.problems == []


@pytest.mark.usefixtures("running_worker")
def test_cancel_asks_first_and_the_list_at_1280_px_shows_status_and_error(api, make_client, web_server, page):
    User.objects.create_superuser(OPERATOR, "ops@example.org", "an operator password")
    # A failed task beside it in the list (failed as a worker fails one whose model no longer loads).
    failed = lifecycle.task_insert(
        client=make_client("failing")[0],
        request={"model": "demo", "input": "Hi"},
        generation=spec_json({"model": "demo", "input": "Hi"}),
        model="demo",
    )
    problem = ModelLoadFailed("the model's files were removed while it was queued").to_problem()
    assert lifecycle.task_fail(task_id=failed.id, error=problem).won
    page.set_viewport_size({"width": WIDTH, "height": 900})
    running = create(api, "Tell me a long story", model=ENDLESS_MODEL, max_output_tokens=30000, seed=4)
    wait_for_status(api, running["id"], {"running"})
    detail = f"/admin/tasks_app/task/{running['id']}/change/"

    login(page, web_server.base, detail)
    confirm(page, "#lmsp-cancel")
    assert "running" in page.inner_text("#lmsp-confirm")
    # Asking changed nothing.
    assert Task.objects.get(pk=running["id"]).status == TaskStatus.RUNNING
    page.click("#lmsp-confirm-yes")
    page.wait_for_url(f"{web_server.base}{detail}")
    wait_for_status(api, running["id"], {"cancelled"})

    # The list: every row's status and error readable at 1280 px, nothing cut or off screen.
    page.goto(f"{web_server.base}/admin/tasks_app/task/")
    # Inside the list's own box (it scrolls sideways past it), itself inside the window.
    shown = page.locator("#changelist .results").bounding_box()
    assert shown["x"] + shown["width"] <= WIDTH
    for column in ("id", "status_column", "error_column", "worker_column", "duration_column", "created_column"):
        box = page.locator(f"th.column-{column}").bounding_box()
        assert box is not None and box["x"] + box["width"] <= shown["x"] + shown["width"], (column, box, shown)
    for task_id, status, error in ((running["id"], "cancelled", "-"), (failed.id, "failed", "model_load_failed")):
        row = page.locator(f"tr:has(a:text-is('{task_id}'))")
        assert row.locator("td.field-status_column").inner_text() == status
        assert row.locator("td.field-error_column").inner_text() == error
        for cell in ("status_column", "error_column"):
            assert row.locator(f"td.field-{cell}").evaluate("cell => cell.scrollWidth <= cell.clientWidth")
    screenshot(page, "tasks")
    assert page.problems == []


@pytest.mark.usefixtures("running_worker")
def test_a_reaped_and_a_handed_back_task_show_both_attempts_with_their_reasons(
    api, freezable_worker, web_server, page, settings
):
    User.objects.create_superuser(OPERATOR, "ops@example.org", "an operator password")

    def retry_task(prompt: str) -> str:
        body = {
            "type": "response",
            "on_restart": "retry",
            "input": {"model": ENDLESS_MODEL, "input": prompt, "max_output_tokens": 1500, "seed": 5},
        }
        reply = api.post("/lmsp/v1/tasks", body, headers={"Idempotency-Key": str(uuid.uuid4())})
        assert reply.status_code == 202, reply.content
        return reply.json()["id"]

    # Reaped: its worker frozen, the reaper (the maintenance task's service) finds its heartbeat stale.
    reaped = on_queue(settings, freezable_worker.queue, lambda: retry_task("Tell me a story"))
    wait_for_status(api, reaped, {"running"})
    freeze(freezable_worker, reaped)
    wait_until(
        lambda: abandoned_tasks_reap(timeout_seconds=2).counts["queued"] == 1,
        what="the reaper never found the frozen worker's task",
    )
    wait_for_status(api, reaped, {"succeeded"})

    # Handed back by its worker: stopped (SIGTERM) in the middle of the task, after its short drain.
    thaw(freezable_worker)
    handed = on_queue(settings, freezable_worker.queue, lambda: retry_task("Tell me another story"))
    wait_for_status(api, handed, {"running"})
    freezable_worker.proc.send_signal(signal.SIGTERM)
    freezable_worker.proc.wait(timeout=60)
    assert Task.objects.get(pk=handed).status == TaskStatus.QUEUED, freezable_worker.log()[-3000:]
    # Its own requeue message went to its own queue, which no one consumes now: the sweeper's job, done here.
    task_dispatch(task_id=handed)
    wait_for_status(api, handed, {"succeeded"})

    login(page, web_server.base, f"/admin/tasks_app/task/{reaped}/change/")
    first, second = attempt_rows(page)
    # The endless model stops at max_output_tokens: succeeded, its response incomplete.
    assert (first[8], second[8]) == ("reaped", "succeeded, incomplete")
    assert "stopped reporting" in first[9]
    screenshot(page, "task-attempts")
    page.goto(f"{web_server.base}/admin/tasks_app/task/{handed}/change/")
    first, second = attempt_rows(page)
    assert (first[8], second[8]) == ("handed back by its worker", "succeeded, incomplete")
    assert first[9], first
    # The log says it too: the requeue's response.queued between the attempts, shown with the lifecycle.
    assert "response.queued" in page.inner_text("table.lmsp-events")
    for task_id in (reaped, handed):
        ends = list(TaskAttempt.objects.filter(task_id=task_id).order_by("number").values_list("end", flat=True))
        assert ends[-1] == AttemptEnd.INCOMPLETE and len(ends) == 2
        assert TaskEvent.objects.filter(task_id=task_id, type="response.queued").count() == 1
    assert page.problems == []
