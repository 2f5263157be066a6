"""Creating, reading, listing and cancelling tasks over HTTP (chapter 7.1-7.3)."""

from __future__ import annotations

import json

import pytest
from django.db import transaction
from rest_framework.views import APIView

from tasks_app.api.task_views import TaskCollectionView
from tasks_app.core import lifecycle
from tasks_app.exceptions import BackendError
from tasks_app.ids import is_prefixed_ulid
from tasks_app.models import Client, Task, TaskEvent
from tasks_app.services.responses import response_start
from tasks_app.services.tasks import task_create
from tasks_app.states import RestartPolicy, TaskStatus
from tests.support import moves
from tests.support.db import count_rows
from tests.support.specs import spec_of

S = TaskStatus
TASK_FIELDS = [
    "id",
    "object",
    "type",
    "status",
    "created_at",
    "updated_at",
    "response_id",
    "events_url",
    "on_restart",
    "response",
    "error",
    # Extension (PROFILE.md section 9): the place in the line while queued.
    "queue_position",
]


def advance(task_id: str, *steps: TaskStatus) -> None:
    for step in steps:
        kwargs = {"error": BackendError("boom").to_problem()} if step == S.FAILED else {}
        assert moves.move(task_id, step, **kwargs).won


def test_create_answers_202_with_the_task_object(api):
    reply = api.create_task("Write a long report.", on_restart="fail")
    assert reply.status_code == 202
    body = reply.json()
    assert list(body) == TASK_FIELDS
    assert is_prefixed_ulid(body["id"], "task_")
    assert is_prefixed_ulid(body["response_id"], "resp_")
    assert body["object"] == "task"
    assert body["type"] == "response"
    assert body["status"] == "queued"
    assert body["created_at"] == body["updated_at"]
    assert body["on_restart"] == "fail"
    assert body["response"] is None and body["error"] is None
    assert body["queue_position"] == 1
    assert reply["Location"] == f"/lmsp/v1/tasks/{body['id']}"

    task = Task.objects.select_related("response").get(pk=body["id"])
    assert task.response_id == body["response_id"]
    assert task.client == api.client
    assert task.response.request["input"] == "Write a long report."
    [event] = TaskEvent.objects.filter(task=task)
    payload = json.loads(event.payload)
    assert (payload["type"], payload["sequence_number"]) == ("response.created", 0)
    assert payload["response"]["status"] == "queued"
    assert payload["response"]["id"] == body["response_id"]


def test_every_task_names_its_event_stream_and_event_resume_is_advertised(api):
    body = api.create_task().json()
    assert body["events_url"] == f"/lmsp/v1/tasks/{body['id']}/events"
    assert api.get(f"/lmsp/v1/tasks/{body['id']}").json()["events_url"] == body["events_url"]
    assert api.get("/lmsp/v1/capabilities").json()["event_resume"] is True


def test_on_restart_defaults_to_fail_and_resume_is_accepted_for_demo(api):
    assert api.create_task().json()["on_restart"] == "fail"
    assert api.create_task(on_restart="resume").json()["on_restart"] == "resume"


def test_resume_refused_for_a_model_without_snapshots(api, demo_model):
    demo_model.capabilities = {**demo_model.capabilities, "resumable_snapshots": False}
    demo_model.save(update_fields=["capabilities"])
    reply = api.create_task(on_restart="resume")
    assert reply.status_code == 400
    assert reply.json()["code"] == "unsupported_capability"
    assert not Task.objects.exists()


def test_model_name_latest_alias(api):
    body = {"type": "response", "input": {"model": "demo:latest", "input": "hi"}}
    reply = api.post("/lmsp/v1/tasks", body)
    assert reply.status_code == 202
    assert Task.objects.get(pk=reply.json()["id"]).response.model == "demo"


@pytest.mark.django_db(transaction=True)
def test_task_is_committed_before_the_202_is_written(api, monkeypatch):
    """A second connection sees the task while the response is still being built."""
    seen: list[int] = []
    original = APIView.finalize_response

    def finalize(self, request, response, *args, **kwargs):
        if isinstance(self, TaskCollectionView) and response.status_code == 202:
            task_id = response.data["id"]
            seen.append(count_rows("SELECT COUNT(*) FROM tasks WHERE id = ?", (task_id,)))
            seen.append(count_rows("SELECT COUNT(*) FROM task_events WHERE task_id = ?", (task_id,)))
        return original(self, request, response, *args, **kwargs)

    monkeypatch.setattr(APIView, "finalize_response", finalize)
    assert api.create_task().status_code == 202
    assert seen == [1, 1]


def test_accepting_inside_another_transaction_is_refused_before_anything_is_written(api):
    """The promise "durable when it returns" cannot be broken by a caller's open transaction."""
    client = Client.objects.get(name="alice")
    request = {"model": "demo", "input": "x"}
    with pytest.raises(RuntimeError, match="durable"), transaction.atomic():
        task_create(
            client=client,
            request=request,
            spec=spec_of(request),
            on_restart=RestartPolicy.FAIL,
            idempotency_key=None,
            request_hash=None,
        )
    with pytest.raises(RuntimeError, match="durable"), transaction.atomic():
        response_start(client=client, request=request, spec=spec_of(request), idempotency_key=None, request_hash=None)
    assert not Task.objects.exists()


def test_get_task(api):
    created = api.create_task().json()
    reply = api.get(f"/lmsp/v1/tasks/{created['id']}")
    assert reply.status_code == 200
    assert reply.json() == created


def test_get_unknown_task(api):
    reply = api.get("/lmsp/v1/tasks/task_01ARZ3NDEKTSV4RRFFQ69G5FAV")
    assert reply.status_code == 404
    assert reply.json()["code"] == "task_not_found"


def test_succeeded_task_carries_its_response(api):
    task_id = api.create_task().json()["id"]
    advance(task_id, S.LOADING, S.RUNNING)
    lifecycle.task_succeed(
        task_id=task_id,
        worker=moves.WORKER,
        item_id="msg_x",
        text="",
        usage={"input_tokens": 3, "output_tokens": 4, "total_tokens": 7},
        output_tokens=4,
    )
    body = api.get(f"/lmsp/v1/tasks/{task_id}").json()
    assert body["status"] == "succeeded"
    assert body["response"]["status"] == "completed"
    assert body["response"]["usage"]["total_tokens"] == 7
    assert body["error"] is None
    reply = api.get(f"/lmsp/v1/responses/{body['response_id']}")
    assert reply.status_code == 200
    assert reply.json() == body["response"]


def test_failed_task_carries_its_problem(api):
    task_id = api.create_task().json()["id"]
    advance(task_id, S.FAILED)
    body = api.get(f"/lmsp/v1/tasks/{task_id}").json()
    assert body["status"] == "failed"
    assert body["response"] is None
    assert body["error"]["code"] == "backend_error"
    assert body["error"]["status"] == 500
    # Key order survives the database (PostgreSQL's jsonb would sort keys); OpenAI's `message` comes last.
    assert list(body["error"]) == ["type", "title", "status", "detail", "code", "message"]
    assert body["error"]["message"] == f"backend_error: {body['error']['detail']}"


# --- cancel (7.3) -------------------------------------------------------------


def cancel(api, task_id: str):
    return api.post(f"/lmsp/v1/tasks/{task_id}/cancel")


def terminal_events(task_id: str) -> list[str]:
    return [
        t
        for t in TaskEvent.objects.filter(task_id=task_id).values_list("type", flat=True)
        if t in ("response.completed", "response.incomplete", "response.failed", "response.cancelled")
    ]


def test_cancel_queued_is_immediate_and_idempotent(api):
    task_id = api.create_task().json()["id"]
    first = cancel(api, task_id)
    assert first.status_code == 200
    assert first.json()["status"] == "cancelled"
    again = cancel(api, task_id)
    assert again.status_code == 200
    assert again.json() == first.json()
    assert terminal_events(task_id) == ["response.cancelled"]
    assert Task.objects.get(pk=task_id).response.status == "cancelled"


@pytest.mark.parametrize("steps", [(S.LOADING,), (S.LOADING, S.RUNNING)])
def test_cancel_loading_or_running_waits_for_the_backend(api, steps):
    task_id = api.create_task().json()["id"]
    advance(task_id, *steps)
    reply = cancel(api, task_id)
    assert reply.status_code == 200
    assert reply.json()["status"] == "cancelling"
    assert cancel(api, task_id).json()["status"] == "cancelling"
    assert terminal_events(task_id) == []
    # The worker acknowledges; further cancels stay quiet.
    advance(task_id, S.CANCELLED)
    assert cancel(api, task_id).json()["status"] == "cancelled"
    assert terminal_events(task_id) == ["response.cancelled"]


@pytest.mark.parametrize("steps", [(S.LOADING, S.RUNNING, S.SUCCEEDED), (S.FAILED,)])
def test_cancel_finished_task_is_409(api, steps):
    task_id = api.create_task().json()["id"]
    advance(task_id, *steps)
    before = Task.objects.get(pk=task_id).last_sequence
    reply = cancel(api, task_id)
    assert reply.status_code == 409
    assert reply.json()["code"] == "task_not_cancelable"
    assert reply["Content-Type"] == "application/problem+json"
    assert Task.objects.get(pk=task_id).last_sequence == before


def test_cancel_unknown_task_is_404(api):
    reply = cancel(api, "task_01ARZ3NDEKTSV4RRFFQ69G5FAV")
    assert reply.status_code == 404
    assert reply.json()["code"] == "task_not_found"


# --- list ---------------------------------------------------------------------


def test_list_newest_first_with_cursor(api, other_api):
    ids = [api.create_task(f"p{i}").json()["id"] for i in range(7)]
    other_api.create_task()
    seen, after = [], None
    while True:
        params = {"limit": 3, **({"after": after} if after else {})}
        page = api.get("/lmsp/v1/tasks", **params).json()
        assert page["object"] == "list"
        seen.extend(item["id"] for item in page["data"])
        if page["data"]:
            assert page["first_id"] == page["data"][0]["id"]
            assert page["last_id"] == page["data"][-1]["id"]
        if not page["has_more"]:
            break
        after = page["last_id"]
    assert seen == list(reversed(ids))


def test_list_filters_by_status(api):
    queued = api.create_task().json()["id"]
    cancelled = api.create_task().json()["id"]
    cancel(api, cancelled)
    assert [t["id"] for t in api.get("/lmsp/v1/tasks", status="queued").json()["data"]] == [queued]
    assert [t["id"] for t in api.get("/lmsp/v1/tasks", status="cancelled").json()["data"]] == [cancelled]
    both = api.get("/lmsp/v1/tasks", status="queued,cancelled").json()["data"]
    assert {t["id"] for t in both} == {queued, cancelled}


def test_list_default_limit_is_20(api):
    for _ in range(21):
        api.create_task()
    page = api.get("/lmsp/v1/tasks").json()
    assert len(page["data"]) == 20
    assert page["has_more"] is True


def test_list_query_count_does_not_grow_with_the_page(api, django_assert_max_num_queries):
    for _ in range(30):
        api.create_task()
    done = Task.objects.order_by("id")[:2]
    for task in done:
        advance(task.id, S.LOADING, S.RUNNING, S.SUCCEEDED)
    # auth lookup, the page, the succeeded tasks' responses in one query, the queued ones'
    # places in the line in one count; the last-used write is rate-limited.
    with django_assert_max_num_queries(4):
        page = api.get("/lmsp/v1/tasks", limit=30).json()["data"]
    assert len(page) == 30
    queued = sorted(t["id"] for t in page if t["status"] == "queued")
    assert [t["queue_position"] for t in sorted(page, key=lambda t: t["id"]) if t["id"] in queued] == list(range(1, 29))
    shown = {t["id"]: t["response"] for t in page if t["status"] == "succeeded"}
    assert set(shown) == {t.id for t in done}
    assert all(r is not None and r["status"] == "completed" for r in shown.values())
    assert all(t["response"] is None for t in page if t["status"] != "succeeded")


def test_create_query_count(api, django_assert_max_num_queries):
    api.create_task()
    # auth, model, queue depth, 3 inserts, and the savepoint pair the test transaction adds.
    with django_assert_max_num_queries(8):
        assert api.create_task().status_code == 202


# --- queue limit -----------------------------------------------------------------


def test_queue_full_is_429_with_retry_after(api, settings):
    settings.LMSP_MAX_QUEUED_TASKS = 2
    api.create_task()
    api.create_task()
    reply = api.create_task()
    assert reply.status_code == 429
    assert reply.json()["code"] == "queue_full"
    assert int(reply["Retry-After"]) > 0
    assert Task.objects.count() == 2


def test_restart_policy_values(api):
    for policy in RestartPolicy.values:
        headers = {"Idempotency-Key": f"k-{policy}"}
        assert api.create_task(on_restart=policy, headers=headers).json()["on_restart"] == policy


def test_unsupported_methods_are_405_even_without_a_token(db):
    from django.test import Client as HttpClient

    http = HttpClient()
    for method, path in (
        ("options", "/lmsp/v1/capabilities"),
        ("delete", "/lmsp/v1/tasks"),
        ("put", "/lmsp/v1/models"),
        ("get", "/lmsp/v1/pair"),
    ):
        reply = getattr(http, method)(path)
        assert reply.status_code == 405, (method, path, reply.content)
        assert reply.json()["code"] == "method_not_allowed"
