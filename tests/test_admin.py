"""The operator's admin (/admin/) through Django's test client, on the real database.

Lists of large tables cost a fixed number of queries and never count the
whole table; the task page shows the request, text, error, snapshot and
newest events; Cancel goes through the lifecycle; clients are created (token
shown once) and revoked through the services; models are rescanned; nothing
that the services own can be edited or deleted here.
"""

from __future__ import annotations

import hashlib
import re
import shutil
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from django.contrib.admin.models import LogEntry
from django.contrib.auth.models import Permission, User
from django.core.management import call_command
from django.db import transaction
from django.test import Client as Browser
from django.utils import timezone

from tasks_app.admin import BoundedCountAdmin, TaskAdmin
from tasks_app.core import lifecycle
from tasks_app.core.output_items import OutputItems
from tasks_app.core.wire import usage_object
from tasks_app.exceptions import ServerRestarted
from tasks_app.models import (
    Client,
    IdempotencyKey,
    ModelRecord,
    Task,
    TaskAttempt,
    TaskEvent,
    WorkerNode,
    WorkerNodeState,
)
from tasks_app.registry.scan import model_scan
from tasks_app.selectors import tasks as selectors
from tasks_app.services.idempotency import idempotency_claim
from tasks_app.services.workers import worker_node_report
from tasks_app.states import AttemptEnd, TaskStatus
from tests.support.specs import spec_json
from tests.test_query_plans import assert_read_through, statements, tasks_selects

S = TaskStatus
ITEM_ID = "msg_01ADMINTEST0000000000000000"
WORKER = "w@host"

TASKS = "/admin/tasks_app/task/"
EVENTS = "/admin/tasks_app/taskevent/"
KEYS = "/admin/tasks_app/idempotencykey/"
RESPONSES = "/admin/tasks_app/response/"
CLIENTS = "/admin/tasks_app/client/"
MODELS = "/admin/tasks_app/modelrecord/"


def task_url(task_id: str, action: str = "change") -> str:
    return f"{TASKS}{task_id}/{action}/"


def append(task_id: str, texts: list[str], worker: str = WORKER, **kwargs) -> lifecycle.TransitionResult:
    """A batch of deltas from the worker, leaving the task's output count as it was unless given."""
    kwargs.setdefault("output_tokens", Task.objects.values_list("output_tokens", flat=True).get(pk=task_id))
    return lifecycle.task_progress(task_id=task_id, worker=worker, item_id=ITEM_ID, deltas=texts, **kwargs)


def start_running(task_id: str, worker: str = WORKER) -> None:
    assert lifecycle.task_claim(task_id=task_id, worker=worker).won
    assert lifecycle.task_start(task_id=task_id, worker=worker, item_id=ITEM_ID).won


def recovery_reap(task: Task, reason: str = "its worker w@host/1 stopped reporting") -> None:
    """The reaper's move for ``task`` (queued again, as for ``retry``), whatever its policy."""
    row = Task.objects.get(pk=task.id)
    move = lifecycle.RecoveryMove(
        task.id, S(row.status), S.QUEUED, row.worker, row.heartbeat_at, end=AttemptEnd.REAPED, reason=reason
    )
    assert lifecycle.tasks_recover(moves=[move]).won == (task.id,)


@pytest.fixture
def new_task(make_client, demo_model) -> Callable[..., Task]:
    """``new_task(status)``: a task moved there by the lifecycle, as a worker or recovery would."""
    owner, _ = make_client("owner")

    def make(
        status: TaskStatus = S.QUEUED,
        prompt: str = "Say hi",
        client: Client | None = None,
        worker: str = WORKER,
        model: str = "demo",
        **request: Any,
    ) -> Task:
        task = lifecycle.task_insert(
            client=client or owner,
            request={"model": model, "input": prompt, "max_output_tokens": 50, **request},
            generation=spec_json({"model": model, "input": prompt, "max_output_tokens": 50, **request}),
            model=model,
        )
        if status == S.FAILED:
            problem = ServerRestarted("the server restarted while the task ran").to_problem()
            assert lifecycle.task_fail(task_id=task.id, error=problem).won
        elif status == S.CANCELLED:
            assert lifecycle.task_cancel_queued(task_id=task.id).won
        elif status == S.LOADING:
            assert lifecycle.task_claim(task_id=task.id, worker=worker).won
        elif status in (S.RUNNING, S.CANCELLING, S.SUCCEEDED):
            start_running(task.id, worker)
            snapshot = {"token_ids": [11, 12, 13], "state": {"offset": 3}}
            assert append(task.id, ["Hel", "lo ", "world"], worker, snapshot=snapshot, output_tokens=3).won
            if status == S.CANCELLING:
                assert lifecycle.task_request_cancel(task_id=task.id).won
            if status == S.SUCCEEDED:
                assert lifecycle.task_succeed(
                    task_id=task.id, worker=worker, item_id=ITEM_ID, text="Hello world", usage=None, output_tokens=3
                ).won
        return Task.objects.select_related("response").get(pk=task.id)

    return make


def page_text(response) -> str:
    return response.content.decode()


def messages_of(response) -> list[str]:
    return [str(message) for message in response.context["messages"]]


def events_of(task_id: str) -> list[str]:
    return list(TaskEvent.objects.filter(task_id=task_id).order_by("sequence_number").values_list("type", flat=True))


# --------------------------------------------------------------------------- #
# Large lists
# --------------------------------------------------------------------------- #


@pytest.fixture
def seed(make_client, demo_model) -> Callable[[int], list[Task]]:
    """``seed(n)``: n tasks of three clients (with their responses and event 0) and n idempotency keys."""

    def make(rows: int) -> list[Task]:
        clients = [make_client(f"seed-{n}")[0] for n in range(3)]
        tasks = []
        for index in range(rows):
            client = clients[index % 3]
            with transaction.atomic():
                claim = idempotency_claim(client=client, endpoint="tasks", key=f"key-{index}", request_hash="0" * 64)
                tasks.append(
                    lifecycle.task_insert(
                        client=client,
                        request={"model": "demo", "input": f"n{index}"},
                        generation=spec_json({"model": "demo", "input": f"n{index}"}),
                        model="demo",
                    )
                )
            IdempotencyKey.objects.filter(pk=claim.record.pk).update(task=tasks[-1])
        return tasks

    return make


# The same number for 5 rows and for 300 (three pages): session, user, the
# filters' choices (clients, models), one bounded count, one page of rows.
LIST_QUERIES = {
    TASKS: 6,
    f"{TASKS}?status=queued&model=demo&on_restart__exact=fail": 6,
    EVENTS: 4,
    KEYS: 5,
    RESPONSES: 5,
}


@pytest.mark.parametrize("rows", [5, 300])
@pytest.mark.parametrize("url", list(LIST_QUERIES))
def test_large_lists_render_in_a_fixed_number_of_queries_without_counting_the_table(
    admin_client, seed, rows, url, django_assert_num_queries
):
    seed(rows)
    with django_assert_num_queries(LIST_QUERIES[url]) as captured:
        page = admin_client.get(url)
    assert page.status_code == 200
    shown = min(rows, 100)
    assert len(page.context["cl"].result_list) == shown
    counts = [q["sql"] for q in captured.captured_queries if "COUNT(" in q["sql"].upper()]
    # One count, of at most a window of rows (LIMIT inside a subquery), never the table.
    assert len(counts) == 1, counts
    assert re.search(r"LIMIT \d+", counts[0]), counts[0]
    assert "DISTINCT" not in " ".join(q["sql"].upper() for q in captured.captured_queries)


def test_a_task_events_list_costs_the_same_for_a_long_log(admin_client, new_task, django_assert_num_queries):
    short, long = new_task(S.RUNNING), new_task(S.RUNNING)
    for _ in range(30):
        append(long.id, ["x"] * 10)
    for task in (short, long):
        with django_assert_num_queries(LIST_QUERIES[EVENTS]):
            assert admin_client.get(f"{EVENTS}?task={task.id}").status_code == 200


def test_past_the_count_window_the_list_says_more_than_n_and_later_pages_stay_reachable(
    admin_client, seed, monkeypatch
):
    monkeypatch.setattr(TaskAdmin, "list_per_page", 10)
    monkeypatch.setattr(BoundedCountAdmin, "count_floor", 50)
    monkeypatch.setattr(BoundedCountAdmin, "pages_ahead", 4)
    seed(120)

    first = admin_client.get(TASKS)
    assert "more than 50 tasks" in page_text(first)
    # From page 8 on, the window (page + 4) * 10 covers all 120 rows: an exact count.
    last = admin_client.get(f"{TASKS}?p=12")
    assert last.status_code == 200
    assert "120 tasks" in page_text(last) and "more than" not in page_text(last)
    assert len(last.context["cl"].result_list) == 10
    # Newest first: page 12 holds the ten oldest tasks.
    oldest = list(Task.objects.order_by("id").values_list("id", flat=True)[:10])
    assert sorted(task.id for task in last.context["cl"].result_list) == oldest


def test_filters_pick_tasks_by_status_model_and_client(admin_client, new_task, make_client):
    other_client, _ = make_client("other")
    queued, running, cancelling = new_task(S.QUEUED), new_task(S.RUNNING), new_task(S.CANCELLING)
    foreign = new_task(S.QUEUED, client=other_client)

    def listed(**params: str) -> set[str]:
        return {task.id for task in admin_client.get(TASKS, params).context["cl"].result_list}

    assert listed(status="queued") == {queued.id, foreign.id}
    assert listed(status="running") == {running.id}
    assert listed(status="cancelling") == {cancelling.id}
    assert listed(status="succeeded") == set()
    assert listed(status="queued", client__id__exact=str(other_client.pk)) == {foreign.id}
    assert listed(model="demo") == {queued.id, running.id, cancelling.id, foreign.id}
    assert listed(model="no-such-model") == set()


def test_search_finds_a_task_by_its_id_or_its_response_id_exactly(admin_client, new_task):
    wanted, other = new_task(), new_task()
    for term in (wanted.id, wanted.response_id, f"  {wanted.id} "):
        page = admin_client.get(TASKS, {"q": term})
        assert [task.id for task in page.context["cl"].result_list] == [wanted.id]
    # Exact, not a substring or case-insensitive scan.
    assert list(admin_client.get(TASKS, {"q": wanted.id[:-2]}).context["cl"].result_list) == []
    assert list(admin_client.get(TASKS, {"q": wanted.id.lower()}).context["cl"].result_list) == []
    assert other.id not in page_text(admin_client.get(TASKS, {"q": wanted.id}))


def test_the_task_list_shows_status_error_model_worker_attempts_tokens_and_times(admin_client, new_task):
    running = new_task(S.RUNNING)
    Task.objects.filter(pk=running.id).update(attempts=2)
    failed = new_task(S.FAILED)
    page = page_text(admin_client.get(TASKS))

    def cells(task_id: str) -> dict[str, str]:
        row = re.search(rf'<tr><td class="action-checkbox">.*?{task_id}.*?</tr>', page, re.S).group(0)
        found = re.findall(r'<t[dh] class="field-([a-z_]+)[^"]*">(.*?)</t[dh]>', row, re.S)
        return {name: re.sub(r"<[^>]+>", "", html).strip() for name, html in found}

    shown = cells(running.id)
    assert shown["id"] == running.id
    assert shown["status_column"] == "running"
    assert 'class="lmsp-status lmsp-status-running"' in page
    assert shown["model_column"] == "demo"
    assert shown["worker_column"].startswith("w@host · ") and shown["worker_column"].endswith(" s")
    assert shown["attempts_column"] == "2"
    assert shown["tokens_column"] == "3"
    assert shown["error_column"] == "-"
    # Unfinished: its age so far, in italics.
    assert re.search(rf"{running.id}.*?<em title=\"not finished: its age\">", page, re.S)
    assert cells(failed.id)["status_column"] == "failed"
    assert cells(failed.id)["error_column"] == "server_restarted"
    assert "?model=demo" in page


def test_a_succeeded_task_whose_response_is_incomplete_says_so_and_has_a_filter(admin_client, new_task):
    complete = new_task(S.SUCCEEDED)
    cut = new_task(S.RUNNING)
    assert lifecycle.task_succeed(
        task_id=cut.id, worker=WORKER, item_id=ITEM_ID, text="Hello world", usage=None, output_tokens=3, incomplete=True
    ).won

    page = page_text(admin_client.get(TASKS))
    assert "succeeded · incomplete" in page

    def listed(**params: str) -> set[str]:
        return {task.id for task in admin_client.get(TASKS, params).context["cl"].result_list}

    assert listed(status="incomplete") == {cut.id}
    assert listed(status="succeeded") == {complete.id, cut.id}


def test_the_error_code_created_and_heartbeat_filters_pick_their_tasks(admin_client, new_task, settings):
    failed, queued, running = new_task(S.FAILED), new_task(S.QUEUED), new_task(S.RUNNING)
    stale = new_task(S.RUNNING, worker="gone@host/1")
    Task.objects.filter(pk=stale.id).update(heartbeat_at=timezone.now() - timedelta(seconds=300))
    settings.LMSP_HEARTBEAT_SILENT_SECONDS = 20

    def listed(**params: str) -> set[str]:
        return {task.id for task in admin_client.get(TASKS, params).context["cl"].result_list}

    assert listed(error="server_restarted") == {failed.id}
    assert listed(error="backend_error") == set()
    assert listed(created="5m") == {failed.id, queued.id, running.id, stale.id}
    assert listed(created="older") == set()
    assert listed(heartbeat="silent") == {stale.id}
    assert listed(worker="gone@host") == {stale.id}
    assert listed(worker="w@host") == {running.id}


# --------------------------------------------------------------------------- #
# The task page
# --------------------------------------------------------------------------- #


def test_a_running_task_page_shows_request_text_snapshot_events_and_opens_its_stream_after_them(admin_client, new_task):
    task = new_task(S.RUNNING, prompt="Tell me about rivers")
    page = page_text(admin_client.get(task_url(task.id)))

    assert "Tell me about rivers" in page
    assert re.search(r'<pre id="lmsp-live-text"[^>]*>Hello world</pre>', page)
    assert 'id="lmsp-live-status" data-status="running"' in page
    assert f"1 rows, 3 token ids stored, as of event {task.last_sequence}" in page
    # The stream starts after the last event the text already holds.
    assert f'data-events-url="/lmsp/v1/tasks/{task.id}/events?starting_after={task.last_sequence}"' in page
    assert f'data-cursor="{task.last_sequence}"' in page
    assert "tasks_app/task_live.js" in page
    assert '<script id="lmsp-initial-text" type="application/json">"Hello world"</script>' in page
    assert f"{EVENTS}?task={task.id}" in page
    # The lifecycle apart from the deltas (all of them one link away).
    lifecycle_table = re.search(r'<table class="lmsp-events">.*?</table>', page, re.S).group(0)
    for event_type in ("response.created", "response.in_progress", "response.output_item.added"):
        assert event_type in lifecycle_table
    assert "response.output_text.delta" not in lifecycle_table
    assert 'id="lmsp-cancel"' in page
    assert "w@host" in page
    # View-only: no save button.
    assert 'name="_save"' not in page


def test_a_task_page_names_the_constraint_its_output_runs_under(admin_client, new_task):
    schema = {"type": "object", "properties": {"city": {"type": "string"}}}
    shaped = new_task(
        S.RUNNING, text={"format": {"type": "json_schema", "name": "weather", "schema": schema, "strict": True}}
    )
    free = new_task(S.RUNNING)
    assert "json_schema &#x27;weather&#x27; (strict): JSON its schema accepts" in page_text(
        admin_client.get(task_url(shaped.id))
    )
    assert "none: free text" in page_text(admin_client.get(task_url(free.id)))


def live_text(page: str) -> str:
    """The output pane's text as the page's HTML has it."""
    found = re.search(r'<pre id="lmsp-live-text"[^>]*>(.*?)</pre>', page, re.S)
    assert found, "no output pane"
    return found.group(1)


def test_a_task_page_shows_its_calls_and_the_tools_it_runs_under(admin_client, make_client, demo_model):
    owner, _ = make_client("caller")
    tools = [{"type": "function", "name": "get_weather", "parameters": {"type": "object"}}]
    request = {"model": "demo", "input": "Weather?", "tools": tools, "tool_choice": "required"}
    task = lifecycle.task_insert(client=owner, request=request, generation=spec_json(request), model="demo")
    assert lifecycle.task_claim(task_id=task.id, worker=WORKER).won
    assert lifecycle.task_start(task_id=task.id, worker=WORKER, item_id=None).won
    # As a worker writes them: text, then a call whose arguments are still being written.
    items = OutputItems()
    written = [*items.text("Checking."), *items.call_start("get_weather"), *items.call_arguments('{"city": "Pa')]
    progress = lifecycle.task_progress(
        task_id=task.id, worker=WORKER, item_id="", deltas=[], output_tokens=9, item_events=written
    )
    assert progress.won
    page = page_text(admin_client.get(task_url(task.id)))
    assert "tool_choice required over get_weather: calls enforced by a grammar" in page
    assert live_text(page) == "Checking.\n\u2192 get_weather({&quot;city&quot;: &quot;Pa"
    # Finished, the page shows the response's items the same way.
    done = [*items.call_end('{"city": "Paris"}')]
    assert lifecycle.task_succeed(
        task_id=task.id, worker=WORKER, item_id="", text="", usage=None, output_tokens=12, items=items, item_events=done
    ).won
    finished = page_text(admin_client.get(task_url(task.id)))
    assert live_text(finished) == "Checking.\n\u2192 get_weather({&quot;city&quot;: &quot;Paris&quot;})"


def test_the_pages_text_stops_at_its_cursor_so_the_stream_adds_nothing_twice(new_task):
    task = new_task(S.RUNNING)
    cursor = task.last_sequence
    append(task.id, ["!", "?"])
    assert selectors.task_output_text_until(task_id=task.id, last_sequence=cursor) == "Hello world"
    assert selectors.task_output_text_until(task_id=task.id, last_sequence=cursor + 2) == "Hello world!?"


def test_a_finished_task_page_shows_its_response_text_and_no_live_stream(admin_client, new_task):
    task = new_task(S.SUCCEEDED)
    page = page_text(admin_client.get(task_url(task.id)))
    assert re.search(r'<pre id="lmsp-live-text"[^>]*>Hello world</pre>', page)
    assert "data-events-url" not in page
    assert 'id="lmsp-cancel"' not in page
    assert "response.completed" in page
    assert "none (only a running resumable task keeps one)" in page


def test_a_task_page_says_how_many_prompt_tokens_came_from_the_prefix_cache(admin_client, new_task):
    queued = new_task(S.QUEUED)
    assert "- (counted once a worker runs it)" in page_text(admin_client.get(task_url(queued.id)))
    task = new_task(S.RUNNING)
    assert "- (reported with the usage when the generation ends)" in page_text(admin_client.get(task_url(task.id)))
    failed = new_task(S.FAILED)
    assert "- (not reported: the task ended before its generation did)" in page_text(
        admin_client.get(task_url(failed.id))
    )
    usage = usage_object(120, 3, cached_tokens=100)
    assert lifecycle.task_succeed(
        task_id=task.id, worker=WORKER, item_id=ITEM_ID, text="Hello world", usage=usage, output_tokens=3
    ).won
    page = page_text(admin_client.get(task_url(task.id)))
    assert re.search(r"Prompt tokens:</label>\s*<div[^>]*>120 \(100 from the prefix cache\)</div>", page)


def test_a_failed_task_page_shows_the_problem(admin_client, new_task):
    task = new_task(S.FAILED)
    page = page_text(admin_client.get(task_url(task.id)))
    assert "urn:lmsp:problem:server_restarted" in page
    assert "the server restarted while the task ran" in page
    assert "response.failed" in page


def test_the_events_link_lists_one_tasks_whole_log_in_order_read_only(admin_client, new_task):
    task = new_task(S.RUNNING)
    other = new_task(S.RUNNING)
    append(task.id, [f"{n} " for n in range(150)])
    last = Task.objects.get(pk=task.id).last_sequence

    first = admin_client.get(EVENTS, {"task": task.id})
    second = admin_client.get(EVENTS, {"task": task.id, "p": 2})
    seen = [event.sequence_number for page in (first, second) for event in page.context["cl"].result_list]
    assert seen == list(range(last + 1))
    assert other.id not in page_text(first)
    assert f"{last + 1} task events" in page_text(first)


# --------------------------------------------------------------------------- #
# Batches: tasks one worker process's engine steps together
# --------------------------------------------------------------------------- #

PROCESS_A, PROCESS_B = "gpu0@host/101", "gpu0@host/102"


@pytest.fixture
def batches(new_task) -> dict[str, list[Task]]:
    """Two batches of process A (one per model), one of process B, and tasks that share nothing."""
    return {
        "a_demo": [new_task(status, worker=PROCESS_A) for status in (S.RUNNING, S.LOADING, S.CANCELLING)],
        "a_base": [new_task(S.RUNNING, worker=PROCESS_A, model="demo:base")],
        "b_demo": [new_task(S.RUNNING, worker=PROCESS_B), new_task(S.RUNNING, worker=PROCESS_B)],
        # Finished tasks keep their worker but hold nothing.
        "done": [new_task(S.SUCCEEDED, worker=PROCESS_A), new_task(S.QUEUED)],
    }


def test_batch_peers_are_the_tasks_held_by_the_same_process_for_the_same_model(batches, django_assert_num_queries):
    running, loading, cancelling = batches["a_demo"]
    with statements() as captured, django_assert_num_queries(1):
        peers = selectors.task_batch_peers(task=running)
    assert [peer.id for peer in peers] == [loading.id, cancelling.id]
    assert_read_through("task_active", tasks_selects(captured))
    assert selectors.task_batch_peers(task=batches["a_base"][0]) == []
    first, second = batches["b_demo"]
    assert [peer.id for peer in selectors.task_batch_peers(task=second)] == [first.id]
    with django_assert_num_queries(0):
        for task in batches["done"]:
            assert selectors.task_batch_peers(task=task) == []


def test_a_task_page_links_the_tasks_that_share_its_batch(admin_client, batches):
    running, loading, cancelling = batches["a_demo"]
    page = page_text(admin_client.get(task_url(loading.id)))
    shares = re.search(r"shares a batch with.*?<div class=\"readonly\">(.*?)</div>", page, re.S | re.I).group(1)
    assert re.findall(r'<a href="([^"]+)">(task_\w+)</a> \((\w+)\)', shares) == [
        (task_url(running.id), running.id, "running"),
        (task_url(cancelling.id), cancelling.id, "cancelling"),
    ]
    alone = page_text(admin_client.get(task_url(batches["a_base"][0].id)))
    assert "no other task: it runs alone in its worker process&#x27;s engine" in alone
    for task in batches["done"]:
        shown = page_text(admin_client.get(task_url(task.id)))
        assert re.search(r"shares a batch with.*?<div class=\"readonly\">-</div>", shown, re.S | re.I)


def test_the_task_list_costs_the_same_queries_however_many_held_tasks_attempts_and_events(
    admin_client, batches, new_task, django_assert_num_queries
):
    with django_assert_num_queries(LIST_QUERIES[TASKS]):
        assert admin_client.get(TASKS).status_code == 200
    # More held tasks in more processes, tasks with several attempts and long logs: the same queries.
    for n in range(6):
        task = new_task(S.RUNNING, worker=f"gpu1@host/{n % 3}")
        for _ in range(5):
            append(task.id, ["x"] * 10)
    requeued = new_task(S.RUNNING)
    recovery_reap(requeued)
    with django_assert_num_queries(LIST_QUERIES[TASKS]):
        assert admin_client.get(TASKS).status_code == 200


def test_the_batch_link_lists_that_task_and_its_peers(admin_client, batches):
    running, loading, cancelling = batches["a_demo"]

    page = admin_client.get(TASKS, {"batch": loading.id})

    assert {task.id for task in page.context["cl"].result_list} == {running.id, loading.id, cancelling.id}
    assert f"with {loading.id}" in page_text(page)
    alone = batches["a_base"][0]
    assert [t.id for t in admin_client.get(TASKS, {"batch": alone.id}).context["cl"].result_list] == [alone.id]
    finished = batches["done"][0]
    assert [t.id for t in admin_client.get(TASKS, {"batch": finished.id}).context["cl"].result_list] == [finished.id]
    unknown = admin_client.get(TASKS, {"batch": "task_01ARZ3NDEKTSV4RRFFQ69G5FAV"})
    assert unknown.status_code == 200 and list(unknown.context["cl"].result_list) == []


# --------------------------------------------------------------------------- #
# Cancel
# --------------------------------------------------------------------------- #


def test_the_cancel_action_follows_the_lifecycle(admin_client, new_task):
    queued, running, loading = new_task(S.QUEUED), new_task(S.RUNNING), new_task(S.LOADING)
    cancelling, succeeded = new_task(S.CANCELLING), new_task(S.SUCCEEDED)
    chosen = [queued, running, loading, cancelling, succeeded]

    selection = {"action": "cancel_tasks", "_selected_action": [t.id for t in chosen]}
    # Asked first: how many, by status, and which; nothing is cancelled yet.
    asked = admin_client.post(TASKS, selection)
    assert asked.status_code == 200
    question = page_text(asked)
    assert "This cancels <strong>5</strong> tasks" in question
    assert "1 already finished (succeeded or failed): they are left as they are." in question
    assert all(task.id in question for task in chosen)
    assert Task.objects.get(pk=queued.id).status == S.QUEUED

    page = admin_client.post(TASKS, {**selection, "confirmed": "yes"}, follow=True)

    assert page.status_code == 200
    status = dict(Task.objects.filter(pk__in=[t.id for t in chosen]).values_list("id", "status"))
    assert status == {
        queued.id: S.CANCELLED,
        running.id: S.CANCELLING,
        loading.id: S.CANCELLING,
        cancelling.id: S.CANCELLING,
        succeeded.id: S.SUCCEEDED,
    }
    assert events_of(queued.id)[-1] == "response.cancelled"
    # Cancelling writes no event: the worker ends the task with response.cancelled.
    assert events_of(running.id)[-1] == "response.output_text.delta"
    assert Task.objects.get(pk=running.id).cancel_requested_at is not None
    assert events_of(succeeded.id)[-1] == "response.completed"
    text = " ".join(messages_of(page))
    assert "1 cancelled, 2 cancelling (the worker stops them), 1 already cancelling or cancelled" in text
    assert f"Not cancelled, already finished (succeeded or failed): {succeeded.id} (succeeded)" in text


def test_the_cancel_button_cancels_a_queued_task_at_once(admin_client, new_task):
    task = new_task(S.QUEUED)
    page = admin_client.post(task_url(task.id, "cancel"), follow=True)
    assert page.redirect_chain[-1][0] == task_url(task.id)
    assert Task.objects.get(pk=task.id).status == S.CANCELLED
    assert events_of(task.id) == ["response.created", "response.cancelled"]
    assert f"Task {task.id} was cancelled." in messages_of(page)
    assert 'data-status="cancelled"' in page_text(page)
    # Who cancelled is in the task's admin history.
    entry = LogEntry.objects.get(object_id=task.id)
    assert (entry.user.username, entry.change_message) == ("admin", "Cancel: queued -> cancelled")


def test_the_cancel_button_asks_a_running_tasks_worker_to_stop(admin_client, new_task):
    task = new_task(S.RUNNING)
    page = admin_client.post(task_url(task.id, "cancel"), follow=True)
    assert Task.objects.get(pk=task.id).status == S.CANCELLING
    assert any("is cancelling" in message for message in messages_of(page))
    # The page keeps following the stream: the worker's response.cancelled ends it.
    assert "data-events-url" in page_text(page)

    again = admin_client.post(task_url(task.id, "cancel"), follow=True)
    assert Task.objects.get(pk=task.id).status == S.CANCELLING
    assert f"Task {task.id} was already cancelling." in messages_of(again)


@pytest.mark.parametrize("status", [S.SUCCEEDED, S.FAILED])
def test_the_cancel_button_refuses_a_finished_task_with_a_message(admin_client, new_task, status):
    task = new_task(status)
    before = events_of(task.id)
    page = admin_client.post(task_url(task.id, "cancel"), follow=True)
    assert page.status_code == 200
    assert f"Task {task.id} was not cancelled: it has already finished ({status})." in messages_of(page)
    assert Task.objects.get(pk=task.id).status == status
    assert events_of(task.id) == before


def test_cancel_asks_first_on_a_get_and_an_unknown_task_is_no_error(admin_client, new_task):
    task = new_task(S.RUNNING)
    asked = admin_client.get(task_url(task.id, "cancel"))
    assert asked.status_code == 200
    assert f"Cancel task {task.id}?" in page_text(asked)
    assert "it becomes cancelling, its worker stops generating" in page_text(asked)
    assert 'id="lmsp-confirm-yes"' in page_text(asked)
    assert Task.objects.get(pk=task.id).status == S.RUNNING
    unknown = "task_01ARZ3NDEKTSV4RRFFQ69G5FAV"
    missing = admin_client.post(task_url(unknown, "cancel"), follow=True)
    assert missing.status_code == 200
    assert any(unknown in message and "exist" in message for message in messages_of(missing))


def test_a_staff_user_who_may_only_view_tasks_cannot_cancel_run_again_or_hand_back(new_task):
    task = new_task(S.QUEUED)
    failed, running = new_task(S.FAILED), new_task(S.RUNNING)
    viewer = User.objects.create_user("viewer", password="pw", is_staff=True)
    viewer.user_permissions.add(Permission.objects.get(codename="view_task"))
    browser = Browser()
    browser.force_login(viewer)

    listing = browser.get(TASKS)
    assert listing.status_code == 200
    assert "cancel_tasks" not in page_text(listing)
    assert 'id="lmsp-cancel"' not in page_text(browser.get(task_url(task.id)))
    assert browser.post(task_url(task.id, "cancel")).status_code == 403
    browser.post(TASKS, {"action": "cancel_tasks", "_selected_action": [task.id], "confirmed": "yes"})
    assert Task.objects.get(pk=task.id).status == S.QUEUED
    # Seen, with no button, and refused if asked for anyway.
    assert 'id="lmsp-rerun"' not in page_text(browser.get(task_url(failed.id)))
    assert 'id="lmsp-hand-back"' not in page_text(browser.get(task_url(running.id)))
    for url in (task_url(failed.id, "rerun"), task_url(running.id, "hand-back"), task_url(running.id, "cancel")):
        assert browser.get(url).status_code == 403
        assert browser.post(url).status_code == 403
    assert not Task.objects.filter(rerun_of_id=failed.id).exists()
    assert Task.objects.get(pk=running.id).status == S.RUNNING


def test_logged_out_and_non_staff_users_get_nothing(new_task):
    task = new_task(S.QUEUED)
    User.objects.create_user("visitor", password="pw")
    retired = User.objects.create_user("retired", password="pw", is_staff=True, is_active=False)
    retired.user_permissions.add(Permission.objects.get(codename="change_task"))
    anonymous, visitor, inactive = Browser(), Browser(), Browser()
    visitor.login(username="visitor", password="pw")
    inactive.force_login(retired)

    for browser in (anonymous, visitor, inactive):
        for url in (TASKS, task_url(task.id), EVENTS, CLIENTS, f"{CLIENTS}add/"):
            page = browser.get(url)
            assert page.status_code == 302 and page["Location"].startswith("/admin/login/"), url
        cancel = browser.post(task_url(task.id, "cancel"))
        assert cancel.status_code == 302 and cancel["Location"].startswith("/admin/login/")
    assert Task.objects.get(pk=task.id).status == S.QUEUED


# --------------------------------------------------------------------------- #
# Read-only tables
# --------------------------------------------------------------------------- #


@pytest.fixture
def one_of_each(new_task, make_client):
    task = new_task(S.SUCCEEDED)
    with transaction.atomic():
        claim = idempotency_claim(client=task.client, endpoint="tasks", key="k-1", request_hash="1" * 64)
    from tasks_app.services.clients import pairing_code_create

    pairing, _ = pairing_code_create(scopes="read")
    return {
        "taskevent": TaskEvent.objects.filter(task=task).first().pk,
        "idempotencykey": claim.record.pk,
        "task": task.id,
        "response": task.response_id,
        "modelrecord": ModelRecord.objects.get(name="demo").pk,
        "pairingcode": pairing.pk,
        "client": task.client_id,
    }


@pytest.mark.parametrize(
    "model", ["taskevent", "idempotencykey", "task", "response", "modelrecord", "pairingcode", "client"]
)
def test_nothing_can_be_edited_or_deleted(admin_client, one_of_each, model):
    pk = one_of_each[model]
    base = f"/admin/tasks_app/{model}/"
    view = admin_client.get(f"{base}{pk}/change/")
    assert view.status_code == 200
    assert 'name="_save"' not in page_text(view)
    assert "deletelink" not in page_text(view)
    assert admin_client.post(f"{base}{pk}/change/", {"type": "x", "name": "x"}).status_code == 403
    assert admin_client.get(f"{base}{pk}/delete/").status_code == 403
    assert admin_client.post(f"{base}{pk}/delete/", {"post": "yes"}).status_code == 403
    listing = admin_client.get(base)
    assert "delete_selected" not in page_text(listing)
    bulk = admin_client.post(base, {"action": "delete_selected", "_selected_action": [pk], "post": "yes"})
    assert bulk.status_code in (200, 302)
    if model != "client":
        assert admin_client.get(f"{base}add/").status_code == 403
    manager = {
        "taskevent": TaskEvent,
        "idempotencykey": IdempotencyKey,
        "task": Task,
        "response": Task.response.field.related_model,
        "modelrecord": ModelRecord,
        "client": Client,
    }.get(model)
    if manager is not None:
        assert manager.objects.filter(pk=pk).exists()


def test_event_and_key_pages_show_their_json_and_never_a_pairing_code_hash(admin_client, one_of_each):
    event = admin_client.get(f"{EVENTS}{one_of_each['taskevent']}/change/")
    assert "response.created" in page_text(event)
    key = admin_client.get(f"{KEYS}{one_of_each['idempotencykey']}/change/")
    assert "k-1" in page_text(key)
    code = admin_client.get(f"/admin/tasks_app/pairingcode/{one_of_each['pairingcode']}/change/")
    from tasks_app.models import PairingCode

    assert PairingCode.objects.get(pk=one_of_each["pairingcode"]).code_hash not in page_text(code)


# --------------------------------------------------------------------------- #
# Clients
# --------------------------------------------------------------------------- #


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def test_a_client_created_in_the_admin_gets_a_token_shown_once_that_works_until_revoked(admin_client, demo_model):
    created = admin_client.post(f"{CLIENTS}add/", {"name": "laptop", "scopes": ["responses", "read"]})

    assert created.status_code == 200
    assert "no-store" in created["Cache-Control"]
    token = re.search(r'<code id="lmsp-client-token"[^>]*>([^<]+)</code>', page_text(created)).group(1)
    client = Client.objects.get(name="laptop")
    assert client.scopes == ["responses", "read"]
    assert client.token_hash == hashlib.sha256(token.encode()).hexdigest()

    api = Browser()
    models = api.get("/lmsp/v1/models", headers=bearer(token))
    assert models.status_code == 200
    assert [m["id"] for m in models.json()["data"]] == ["demo"]

    # Never shown again, and the hash never at all.
    for url in (CLIENTS, f"{CLIENTS}{client.pk}/change/"):
        page = page_text(admin_client.get(url))
        assert token not in page
        assert client.token_hash not in page
    detail = page_text(admin_client.get(f"{CLIENTS}{client.pk}/change/"))
    assert 'id="lmsp-revoke"' in detail

    revoked = admin_client.post(f"{CLIENTS}{client.pk}/revoke/", follow=True)
    assert "Client laptop is revoked: its token no longer works." in messages_of(revoked)
    assert Client.objects.get(pk=client.pk).revoked_at is not None
    assert 'id="lmsp-revoke"' not in page_text(revoked)
    refused = api.get("/lmsp/v1/models", headers=bearer(token))
    assert refused.status_code == 401
    assert refused.json()["code"] == "unauthorized"


def test_the_revoke_action_revokes_and_keeps_the_rows(admin_client, make_client, new_task):
    alice, alice_token = make_client("alice")
    bob, bob_token = make_client("bob")
    task = new_task(S.SUCCEEDED, client=alice)

    page = admin_client.post(CLIENTS, {"action": "revoke_clients", "_selected_action": [alice.pk, bob.pk]}, follow=True)

    assert any("Revoked: " in message and "alice" in message and "bob" in message for message in messages_of(page))
    for token in (alice_token, bob_token):
        assert Browser().get("/lmsp/v1/models", headers=bearer(token)).status_code == 401
    # Revoked, not deleted: the task still points at its client.
    assert Task.objects.get(pk=task.id).client_id == alice.pk
    again = admin_client.post(CLIENTS, {"action": "revoke_clients", "_selected_action": [alice.pk]}, follow=True)
    assert any("already revoked" in message for message in messages_of(again))


def test_a_clashing_or_empty_client_form_is_refused_with_its_reason(admin_client, make_client):
    make_client("taken")
    clash = admin_client.post(f"{CLIENTS}add/", {"name": "taken", "scopes": ["read"]})
    assert clash.status_code == 200
    assert "a client named &#x27;taken&#x27; already exists" in page_text(clash)
    assert "lmsp-client-token" not in page_text(clash)
    empty = admin_client.post(f"{CLIENTS}add/", {"name": "", "scopes": []})
    assert empty.status_code == 200
    assert "This field is required." in page_text(empty)
    assert Client.objects.filter(name="taken").count() == 1


# --------------------------------------------------------------------------- #
# Models
# --------------------------------------------------------------------------- #


def test_rescan_picks_up_a_new_model_folder_and_digests_are_shown(
    admin_client, demo_models_root: Path, tmp_path: Path, settings
):
    root = tmp_path / "models"
    shutil.copytree(demo_models_root / "demo", root / "demo")
    settings.LMSP_MODELS_DIR = root
    model_scan(models_dir=root)

    shutil.copytree(demo_models_root / "demo", root / "demo-copy")
    assert admin_client.get(f"{MODELS}rescan/").status_code == 405
    page = admin_client.post(f"{MODELS}rescan/", follow=True)

    assert page.status_code == 200
    assert "Rescanned models. added: demo-copy; updated: none; removed: none; unchanged: 1." in messages_of(page)
    record = ModelRecord.objects.get(name="demo-copy")
    assert record.digest == ModelRecord.objects.get(name="demo").digest
    listing = page_text(page)
    assert "demo-copy" in listing and record.digest[:19] in listing and 'id="lmsp-rescan"' in listing
    detail = page_text(admin_client.get(f"{MODELS}{record.pk}/change/"))
    assert record.digest in detail
    assert "model.onnx" in detail

    shutil.rmtree(root / "demo-copy")
    gone = admin_client.post(f"{MODELS}rescan/", follow=True)
    assert "Rescanned models. added: none; updated: none; removed: demo-copy; unchanged: 1." in messages_of(gone)


def test_rescan_needs_the_change_permission(demo_model):
    viewer = User.objects.create_user("viewer", password="pw", is_staff=True)
    viewer.user_permissions.add(Permission.objects.get(codename="view_modelrecord"))
    browser = Browser()
    browser.force_login(viewer)
    assert 'id="lmsp-rescan"' not in page_text(browser.get(MODELS))
    assert browser.post(f"{MODELS}rescan/").status_code == 403


# --------------------------------------------------------------------------- #
# Staff accounts
# --------------------------------------------------------------------------- #


def test_a_superuser_made_with_createsuperuser_logs_into_the_admin(db, monkeypatch):
    monkeypatch.setenv("DJANGO_SUPERUSER_PASSWORD", "a long operator password")
    call_command("createsuperuser", interactive=False, username="operator", email="ops@example.org", verbosity=0)
    browser = Browser()
    assert browser.login(username="operator", password="a long operator password")
    index = browser.get("/admin/")
    assert index.status_code == 200
    for name in ("Tasks", "Task events", "Idempotency keys", "Clients", "Models"):
        assert name in page_text(index), name


# --------------------------------------------------------------------------- #
# Attempts, timings, the safe actions (issue 47)
# --------------------------------------------------------------------------- #


def attempt_cells(page) -> list[list[str]]:
    rows = re.findall(r'<tr class="lmsp-attempt">(.*?)</tr>', page_text(page), re.S)
    return [
        [re.sub(r"<[^>]+>", "", cell).strip() for cell in re.findall(r"<td[^>]*>(.*?)</td>", row, re.S)] for row in rows
    ]


def test_every_attempt_is_kept_with_its_worker_times_and_why_it_ended(admin_client, new_task):
    task = new_task(S.RUNNING)
    recovery_reap(task)
    # The log says the attempt's output was dropped, between the attempts.
    assert events_of(task.id)[-1] == "response.queued"
    start_running(task.id, worker="w2@host/7")
    append(task.id, ["Again"], worker="w2@host/7", output_tokens=1)
    assert lifecycle.task_succeed(
        task_id=task.id, worker="w2@host/7", item_id=ITEM_ID, text="Again", usage=None, output_tokens=1
    ).won

    first, second = TaskAttempt.objects.filter(task_id=task.id).order_by("number")
    assert (first.number, first.worker, first.end, first.output_tokens) == (1, WORKER, AttemptEnd.REAPED, 3)
    assert first.reason == "its worker w@host/1 stopped reporting"
    assert first.started_at <= first.first_token_at <= first.ended_at
    assert (second.number, second.worker, second.end) == (2, "w2@host/7", AttemptEnd.SUCCEEDED)
    stored = Task.objects.get(pk=task.id)
    assert stored.finished_at is not None and stored.first_token_at == second.first_token_at

    page = admin_client.get(task_url(task.id))
    rows = attempt_cells(page)
    assert [(row[0], row[1], row[8], row[9]) for row in rows] == [
        ("1", WORKER, "reaped", "its worker w@host/1 stopped reporting"),
        ("2", "w2@host/7", "succeeded", ""),
    ]
    text = page_text(page)
    assert "response.queued" in re.search(r'<table class="lmsp-events">.*?</table>', text, re.S).group(0)
    # Times to the millisecond: queue wait, first token, generation, duration.
    for cell in ("lmsp-queue-wait", "lmsp-first-token", "lmsp-generation", "lmsp-duration"):
        assert re.search(rf'id="{cell}">\d+(\.\d)? (ms|s)<', text), cell


def test_a_running_attempt_shows_on_the_task_row_and_the_page_leads_with_status_worker_and_heartbeat(
    admin_client, new_task
):
    task = new_task(S.RUNNING)
    page = admin_client.get(task_url(task.id))
    [row] = attempt_cells(page)
    assert (row[0], row[1], row[4], row[8]) == ("1", WORKER, "-", "running")
    text = page_text(page)
    assert re.search(r'id="lmsp-heartbeat" class="">\d+\.\d s ago<', text)
    assert 'id="lmsp-silent-note" class="lmsp-warning" hidden' in text
    assert "(holds it now)" in text
    live = admin_client.get(task_url(task.id, "liveness")).json()
    assert (live["status"], live["worker"], live["held"], live["silent"]) == ("running", WORKER, True, False)


def test_a_silent_workers_task_page_says_so(admin_client, new_task, settings):
    settings.LMSP_HEARTBEAT_SILENT_SECONDS = 20
    task = new_task(S.RUNNING)
    Task.objects.filter(pk=task.id).update(heartbeat_at=timezone.now() - timedelta(seconds=45))
    text = page_text(admin_client.get(task_url(task.id)))
    assert 'id="lmsp-heartbeat" class="lmsp-status lmsp-status-silent">45.' in text
    assert 'id="lmsp-silent-note" class="lmsp-warning" hidden' not in text
    assert admin_client.get(task_url(task.id, "liveness")).json()["silent"] is True


def test_a_finished_tasks_worker_is_its_last_attempts(admin_client, new_task):
    task = new_task(S.SUCCEEDED)
    text = page_text(admin_client.get(task_url(task.id)))
    assert "(its last attempt's; it holds nothing now)" in text
    assert "Worker holding the task" not in text


def test_a_task_page_costs_the_same_queries_however_many_attempts_and_events(
    admin_client, new_task, django_assert_num_queries
):
    short = new_task(S.RUNNING)
    long = new_task(S.RUNNING)
    for _ in range(2):
        recovery_reap(long)
        start_running(long.id)
        for _ in range(20):
            append(long.id, ["x"] * 5)
    # Django's content types are read once per process: not a query of the page's.
    admin_client.get(task_url(short.id))
    queries = []
    for task in (short, long):
        with django_assert_num_queries(TASK_PAGE_QUERIES) as captured:
            assert admin_client.get(task_url(task.id)).status_code == 200
        queries.append(len(captured.captured_queries))
    assert queries[0] == queries[1]


# Session, user, the task (with client and response), the text (its numbers, its deltas), its lifecycle
# events, its snapshot, its attempts, its batch peers, its reruns.
TASK_PAGE_QUERIES = 10


def test_run_again_asks_first_then_makes_a_linked_task_from_the_same_request(admin_client, new_task):
    failed = new_task(S.FAILED, prompt="Tell me about lakes")
    asked = admin_client.get(task_url(failed.id, "rerun"))
    assert f"Run task {failed.id} again?" in page_text(asked)
    assert not Task.objects.filter(rerun_of_id=failed.id).exists()

    page = admin_client.post(task_url(failed.id, "rerun"), follow=True)
    rerun = Task.objects.select_related("response").get(rerun_of_id=failed.id)
    assert page.redirect_chain[-1][0] == task_url(rerun.id)
    assert (rerun.status, rerun.client_id, rerun.on_restart) == (S.QUEUED, failed.client_id, failed.on_restart)
    assert rerun.response.request == failed.response.request
    assert rerun.response.generation == failed.response.generation
    assert Task.objects.get(pk=failed.id).status == S.FAILED
    assert re.search(rf"run again from <a [^>]*>{failed.id}</a>", page_text(page))
    assert re.search(rf"run again as <a [^>]*>{rerun.id}</a>", page_text(admin_client.get(task_url(failed.id))))
    entries = {(e.object_id, e.change_message) for e in LogEntry.objects.all()}
    assert {(failed.id, f"Run again as {rerun.id}"), (rerun.id, f"Run again from {failed.id}")} <= entries


@pytest.mark.parametrize("status", [S.SUCCEEDED, S.RUNNING])
def test_run_again_refuses_a_task_that_did_not_fail_or_was_not_cancelled(admin_client, new_task, status):
    task = new_task(status)
    page = admin_client.post(task_url(task.id, "rerun"), follow=True)
    assert any("was not run again" in message for message in messages_of(page))
    assert not Task.objects.filter(rerun_of_id=task.id).exists()


def test_hand_back_now_refuses_a_live_workers_task_and_hands_back_a_silent_ones(admin_client, new_task, settings):
    settings.LMSP_HEARTBEAT_SILENT_SECONDS = 20
    live, silent = new_task(S.RUNNING), new_task(S.RUNNING, worker="gone@nowhere/1")
    asked = admin_client.get(task_url(live.id, "hand-back"))
    assert f"Hand task {live.id} back now?" in page_text(asked)

    refused = admin_client.post(task_url(live.id, "hand-back"), follow=True)
    assert any("it is alive, and keeps the task" in message for message in messages_of(refused))
    assert Task.objects.get(pk=live.id).status == S.RUNNING
    assert not TaskAttempt.objects.filter(task_id=live.id).exists()

    Task.objects.filter(pk=silent.id).update(heartbeat_at=timezone.now() - timedelta(seconds=30))
    page = admin_client.post(task_url(silent.id, "hand-back"), follow=True)
    assert any("was handed back: failed" in message for message in messages_of(page))
    stored = Task.objects.get(pk=silent.id)
    assert stored.status == S.FAILED and stored.error["code"] == "server_restarted"
    attempt = TaskAttempt.objects.get(task_id=silent.id)
    assert attempt.end == AttemptEnd.OPERATOR and "an operator (admin) handed it back" in attempt.reason
    assert LogEntry.objects.get(object_id=silent.id).change_message == "Hand back: running -> failed"


def test_the_workers_page_shows_each_nodes_liveness_tasks_models_and_rate(
    admin_client, new_task, settings, django_assert_num_queries
):
    settings.LMSP_WORKER_SILENT_SECONDS = 15
    settings.LMSP_HEARTBEAT_SILENT_SECONDS = 20
    engines = [{"model": "demo", "device": "CPUExecutionProvider", "rows": 2, "waiting": 1, "tokens_per_s": 812.5}]
    for name in ("live@host", "frozen@host"):
        worker_node_report(
            name=name,
            hostname="host",
            pid=41,
            pool="threads",
            state=WorkerNodeState.ONLINE,
            started_at=timezone.now(),
            max_rows=8,
            engines=engines,
        )
    WorkerNode.objects.filter(pk="frozen@host").update(reported_at=timezone.now() - timedelta(seconds=40))
    stuck = new_task(S.RUNNING, worker="frozen@host/41")
    Task.objects.filter(pk=stuck.id).update(heartbeat_at=timezone.now() - timedelta(seconds=40))
    new_task(S.RUNNING, worker="live@host/41")

    with django_assert_num_queries(WORKERS_PAGE_QUERIES):
        page = admin_client.get(WORKERS)
    text = page_text(page)
    rows = dict(re.findall(r'<th class="field-name"><a [^>]*>([^<]+)</a></th>(.*?)</tr>', text, re.S))
    frozen, live = rows["frozen@host"], rows["live@host"]
    assert "silent for 40 s" in frozen and "lmsp-status-silent" in frozen
    assert 'href="/admin/tasks_app/task/?worker=frozen%40host&amp;heartbeat=silent">1 stuck</a>' in frozen
    assert "online" in live and "stuck" not in live
    assert "demo (CPUExecutionProvider)" in live and "2 / 8, 1 waiting" in live and "812.5" in live
    # The stuck link lists that node's silent task.
    listed = admin_client.get(TASKS, {"worker": "frozen@host", "heartbeat": "silent"}).context["cl"].result_list
    assert [task.id for task in listed] == [stuck.id]


# Session, user, two counts of the (small) nodes table, the held tasks grouped by worker, the page of nodes.
WORKERS_PAGE_QUERIES = 6
WORKERS = "/admin/tasks_app/workernode/"


def test_an_idempotency_key_of_post_tasks_links_its_task(admin_client, api):
    reply = api.post(
        "/lmsp/v1/tasks",
        {"type": "response", "input": {"model": "demo", "input": "Hi"}},
        headers={"Idempotency-Key": "k-47"},
    )
    assert reply.status_code == 202
    key = IdempotencyKey.objects.get(key="k-47")
    assert key.task_id == reply.json()["id"]
    assert reply.json()["id"] in page_text(admin_client.get(KEYS))
