"""Bearer tokens, scopes and visibility (PROFILE.md section 1), through HTTP."""

from __future__ import annotations

import hashlib
import json

import pytest
from django.db import connection

from tasks_app.models import Client, Response, Task
from tasks_app.services.clients import client_revoke
from tasks_app.states import TaskStatus
from tests.support.api import ApiClient
from tests.support.problems import assert_problem
from tests.support.specs import spec_json


def assert_unauthorized(response) -> dict:
    body = assert_problem(response, 401, "unauthorized")
    assert response.has_header("WWW-Authenticate")
    assert response["WWW-Authenticate"].startswith("Bearer")
    return body


def send(api: ApiClient, method: str, path: str):
    if method == "GET":
        return api.get(path)
    return api.post(
        path, {"type": "response", "input": {"model": "demo", "input": "hi"}} if path.endswith("tasks") else None
    )


@pytest.fixture
def alice_task(api) -> dict:
    reply = api.create_task("alice's secret prompt")
    assert reply.status_code == 202, reply.content
    return reply.json()


# (method, path template, needs) -- "needs" is the scope the route asks for.
ENDPOINTS = [
    ("POST", "/lmsp/v1/tasks", "responses"),
    ("GET", "/lmsp/v1/tasks", "read"),
    ("GET", "/lmsp/v1/tasks/{task_id}", "read"),
    ("POST", "/lmsp/v1/tasks/{task_id}/cancel", "responses"),
    ("GET", "/lmsp/v1/models", "read"),
    ("GET", "/lmsp/v1/responses/{response_id}", "read"),
    # OpenAI's Files and Batch API (docs/batches.md): the ids need not exist, a token is asked first.
    ("POST", "/lmsp/v1/files", "responses"),
    ("GET", "/lmsp/v1/files", "read"),
    ("GET", "/lmsp/v1/files/file-x", "read"),
    ("GET", "/lmsp/v1/files/file-x/content", "read"),
    ("POST", "/lmsp/v1/batches", "responses"),
    ("GET", "/lmsp/v1/batches", "read"),
    ("GET", "/lmsp/v1/batches/batch_x", "read"),
    ("POST", "/lmsp/v1/batches/batch_x/cancel", "responses"),
    # OpenAI's Conversations API (docs/conversations.md).
    ("POST", "/lmsp/v1/conversations", "responses"),
    ("GET", "/lmsp/v1/conversations/conv_x", "read"),
    ("POST", "/lmsp/v1/conversations/conv_x", "responses"),
    ("GET", "/lmsp/v1/conversations/conv_x/items", "read"),
    ("POST", "/lmsp/v1/conversations/conv_x/items", "responses"),
    ("GET", "/lmsp/v1/conversations/conv_x/items/msg_x", "read"),
]
ENDPOINT_IDS = [f"{m} {p}" for m, p, _ in ENDPOINTS]


def fill(path: str, task: dict) -> str:
    return path.format(task_id=task["id"], response_id=task["response_id"])


def task_row(task_id: str) -> dict:
    return Task.objects.filter(pk=task_id).values("status", "updated_at", "last_sequence", "error").get()


# --- missing, malformed, wrong and revoked tokens ---------------------------------------------------


@pytest.mark.parametrize(("method", "path", "needs"), ENDPOINTS, ids=ENDPOINT_IDS)
def test_no_authorization_header_is_401(alice_task, method, path, needs):
    tasks_before = Task.objects.count()
    reply = send(ApiClient(None), method, fill(path, alice_task))
    assert_unauthorized(reply)
    assert Task.objects.count() == tasks_before
    assert Task.objects.get(pk=alice_task["id"]).status == TaskStatus.QUEUED


@pytest.mark.parametrize(("method", "path", "needs"), ENDPOINTS, ids=ENDPOINT_IDS)
@pytest.mark.parametrize("header", ["Basic abc", "Bearer", "Bearer ", "Token abc", "Bearer a b"])
def test_malformed_authorization_header_is_401(api, alice_task, method, path, needs, header):
    tasks_before = Task.objects.count()
    anonymous = ApiClient(None)
    reply = send_with_header(anonymous, method, fill(path, alice_task), header)
    assert_unauthorized(reply)
    assert Task.objects.count() == tasks_before
    assert Task.objects.get(pk=alice_task["id"]).status == TaskStatus.QUEUED


def send_with_header(api: ApiClient, method: str, path: str, header: str):
    headers = {"Authorization": header}
    if method == "GET":
        return api.get(path, headers=headers)
    body = {"type": "response", "input": {"model": "demo", "input": "hi"}} if path.endswith("tasks") else None
    return api.post(path, body, headers=headers)


@pytest.mark.parametrize(("method", "path", "needs"), ENDPOINTS, ids=ENDPOINT_IDS)
def test_wrong_token_is_401(api, alice_task, method, path, needs):
    tasks_before = Task.objects.count()
    reply = send(ApiClient(api.token + "x"), method, fill(path, alice_task))
    assert_unauthorized(reply)
    assert Task.objects.count() == tasks_before
    assert Task.objects.get(pk=alice_task["id"]).status == TaskStatus.QUEUED


@pytest.mark.parametrize(("method", "path", "needs"), ENDPOINTS, ids=ENDPOINT_IDS)
def test_revoked_token_is_401(api, alice_task, method, path, needs):
    assert send(api, "GET", "/lmsp/v1/tasks").status_code == 200
    assert client_revoke(name="alice") is not None
    assert Client.objects.get(pk=api.client.pk).revoked_at is not None
    tasks_before = Task.objects.count()

    reply = send(api, method, fill(path, alice_task))

    assert_unauthorized(reply)
    assert Task.objects.count() == tasks_before
    assert Task.objects.get(pk=alice_task["id"]).status == TaskStatus.QUEUED


def test_valid_token_passes_on_every_endpoint(api, alice_task):
    """The positive control for the 401 tests above: the same calls with the right token."""
    assert api.get("/lmsp/v1/tasks").status_code == 200
    assert api.get(f"/lmsp/v1/tasks/{alice_task['id']}").status_code == 200
    assert api.get("/lmsp/v1/models").status_code == 200
    assert api.get(f"/lmsp/v1/responses/{alice_task['response_id']}").status_code == 200
    assert api.create_task().status_code == 202
    reply = api.post(f"/lmsp/v1/tasks/{alice_task['id']}/cancel")
    assert reply.status_code == 200, reply.content
    assert reply.json()["status"] == "cancelled"


@pytest.mark.parametrize("param", ["token", "access_token"])
def test_token_in_the_query_string_is_not_accepted(api, param):
    """A bearer token never travels in a URL."""
    reply = ApiClient(None).get("/lmsp/v1/tasks", **{param: api.token})
    assert_unauthorized(reply)


def test_scheme_is_case_insensitive(api):
    reply = ApiClient(None).get("/lmsp/v1/tasks", headers={"Authorization": f"bearer {api.token}"})
    assert reply.status_code == 200, reply.content


@pytest.mark.parametrize(
    "fake",
    [
        "lmsp_" + "A" * 43,  # the shape of one of our tokens
        "lmsp_0123456789abcdefghijklmnopqrstuvwxyzABCDEFG",
        "not-a-token",
        "x",
        "eyJhbGciOiJIUzI1NiJ9.e30.ZRrHA1JJJW8opsbCGfG_HACGpVUMN_a9IV7pAx_Zmeo",
    ],
)
def test_invalid_token_reply_gives_no_oracle(api, fake):
    """An unknown token is refused the same way whatever it looks like."""
    reference = ApiClient("lmsp_" + "B" * 43).get("/lmsp/v1/tasks")
    reply = ApiClient(fake).get("/lmsp/v1/tasks")
    assert_unauthorized(reply)
    assert reply.status_code == reference.status_code
    assert reply.json() == reference.json()
    assert reply["WWW-Authenticate"] == reference["WWW-Authenticate"]
    assert reply["Content-Type"] == reference["Content-Type"]


# --- scopes -----------------------------------------------------------------------------------------


@pytest.fixture
def reader(make_client, demo_model) -> ApiClient:
    client, token = make_client("reader", scopes="read")
    return ApiClient(token, client)


@pytest.fixture
def writer(make_client, demo_model) -> ApiClient:
    client, token = make_client("writer", scopes="responses")
    return ApiClient(token, client)


def test_read_scope_cannot_post_a_task(reader):
    before = (Task.objects.count(), Response.objects.count())
    reply = reader.create_task()
    assert_problem(reply, 403, "insufficient_scope")
    assert (Task.objects.count(), Response.objects.count()) == before


def test_read_scope_cannot_cancel_even_its_own_task(reader, make_client):
    from tasks_app.core import lifecycle

    task = lifecycle.task_insert(
        client=reader.client,
        request={"model": "demo", "input": "x"},
        generation=spec_json({"model": "demo", "input": "x"}),
        model="demo",
    )
    before = task_row(task.id)
    # It may read it ...
    assert reader.get(f"/lmsp/v1/tasks/{task.id}").status_code == 200
    # ... but not cancel it.
    reply = reader.post(f"/lmsp/v1/tasks/{task.id}/cancel")
    assert_problem(reply, 403, "insufficient_scope")
    assert task_row(task.id) == before


def test_read_scope_cannot_cancel_another_clients_task(reader, alice_task):
    before = task_row(alice_task["id"])
    reply = reader.post(f"/lmsp/v1/tasks/{alice_task['id']}/cancel")
    assert_problem(reply, 403, "insufficient_scope")
    assert task_row(alice_task["id"]) == before


@pytest.mark.parametrize("method", ["GET", "HEAD"])
@pytest.mark.parametrize(
    "path",
    ["/lmsp/v1/tasks", "/lmsp/v1/tasks/{task_id}", "/lmsp/v1/models", "/lmsp/v1/responses/{response_id}"],
)
def test_responses_scope_cannot_read(writer, path, method):
    """HEAD is a read too: it needs the `read` scope just like GET."""
    created = writer.create_task()
    assert created.status_code == 202, created.content
    target = fill(path, created.json())
    if method == "GET":
        assert_problem(writer.get(target), 403, "insufficient_scope")
    else:
        reply = writer.http.head(target, headers=writer._headers(None))
        assert reply.status_code == 403, f"HEAD {target} with only the responses scope answered {reply.status_code}"


def test_responses_scope_can_cancel_its_own_task(writer):
    created = writer.create_task().json()
    reply = writer.post(f"/lmsp/v1/tasks/{created['id']}/cancel")
    assert reply.status_code == 200, reply.content
    assert Task.objects.get(pk=created["id"]).status == TaskStatus.CANCELLED


# --- other clients' tasks and responses --------------------------------------------------------------


def test_other_clients_task_is_not_found(other_api, alice_task):
    before = task_row(alice_task["id"])
    body = assert_problem(other_api.get(f"/lmsp/v1/tasks/{alice_task['id']}"), 404, "task_not_found")
    assert "alice" not in json.dumps(body)
    assert task_row(alice_task["id"]) == before


def test_other_clients_task_looks_like_a_missing_one(other_api, alice_task):
    """404 for a foreign task is indistinguishable from 404 for no task (apart from the id echoed)."""
    missing_id = "task_01ARZ3NDEKTSV4RRFFQ69G5FAV"
    foreign = other_api.get(f"/lmsp/v1/tasks/{alice_task['id']}").json()
    missing = assert_problem(other_api.get(f"/lmsp/v1/tasks/{missing_id}"), 404, "task_not_found")
    assert {k: v for k, v in foreign.items() if k not in ("detail", "instance", "error")} == {
        k: v for k, v in missing.items() if k not in ("detail", "instance", "error")
    }
    assert foreign["detail"].replace(alice_task["id"], missing_id) == missing["detail"]
    assert foreign["error"]["message"].replace(alice_task["id"], missing_id) == missing["error"]["message"]


def test_other_clients_task_cannot_be_cancelled(other_api, alice_task):
    before = task_row(alice_task["id"])
    reply = other_api.post(f"/lmsp/v1/tasks/{alice_task['id']}/cancel")
    assert_problem(reply, 404, "task_not_found")
    assert task_row(alice_task["id"]) == before
    assert Task.objects.get(pk=alice_task["id"]).status == TaskStatus.QUEUED


def test_other_clients_response_is_not_found(api, other_api, alice_task):
    assert api.get(f"/lmsp/v1/responses/{alice_task['response_id']}").status_code == 200
    reply = other_api.get(f"/lmsp/v1/responses/{alice_task['response_id']}")
    assert_problem(reply, 404, "response_not_found")


def test_other_clients_task_is_not_listed(other_api, alice_task):
    own = other_api.create_task().json()
    reply = other_api.get("/lmsp/v1/tasks")
    assert reply.status_code == 200
    ids = [t["id"] for t in reply.json()["data"]]
    assert ids == [own["id"]]


# --- admin ------------------------------------------------------------------------------------------


@pytest.fixture
def admin(make_client, demo_model) -> ApiClient:
    client, token = make_client("root", scopes="admin")
    return ApiClient(token, client)


def test_admin_sees_other_clients_task(admin, alice_task):
    reply = admin.get(f"/lmsp/v1/tasks/{alice_task['id']}")
    assert reply.status_code == 200, reply.content
    assert reply.json()["id"] == alice_task["id"]
    assert admin.get(f"/lmsp/v1/responses/{alice_task['response_id']}").status_code == 200


def test_admin_lists_other_clients_tasks(admin, other_api, alice_task):
    bobs = other_api.create_task().json()
    reply = admin.get("/lmsp/v1/tasks")
    assert reply.status_code == 200
    ids = {t["id"] for t in reply.json()["data"]}
    assert {alice_task["id"], bobs["id"]} <= ids


def test_admin_cancels_other_clients_task(admin, alice_task):
    reply = admin.post(f"/lmsp/v1/tasks/{alice_task['id']}/cancel")
    assert reply.status_code == 200, reply.content
    assert reply.json()["status"] == "cancelled"
    task = Task.objects.get(pk=alice_task["id"])
    assert task.status == TaskStatus.CANCELLED
    # The task still belongs to alice.
    assert task.client.name == "alice"


# --- public endpoints -------------------------------------------------------------------------------


@pytest.mark.parametrize("header", [None, "Bearer not-a-token", "Basic abc"])
def test_capabilities_needs_no_token(db, header):
    http = ApiClient(None)
    reply = http.get("/lmsp/v1/capabilities", headers={"Authorization": header} if header else None)
    assert reply.status_code == 200, reply.content
    body = reply.json()
    assert body["lmsp_version"] == "1.0"
    assert body["object"] == "capabilities"


# --- what is stored -----------------------------------------------------------------------------------


def test_token_is_not_stored_in_clear(api):
    token = api.token
    assert token
    row = Client.objects.filter(pk=api.client.pk).values().get()
    for name, value in row.items():
        assert token not in json.dumps(value, default=str), name
    assert row["token_hash"] == hashlib.sha256(token.encode()).hexdigest()
    # The raw row too, whatever the ORM makes of it.
    with connection.cursor() as cursor:
        cursor.execute(f"SELECT * FROM {Client._meta.db_table} WHERE id = %s", [api.client.pk])
        raw = cursor.fetchone()
    assert raw is not None
    assert all(token not in str(value) for value in raw)
    # And no other table holds it either, as far as the ORM can see.
    assert not Client.objects.filter(name__contains=token).exists()


def test_last_used_at_is_set_after_use(api):
    assert Client.objects.get(pk=api.client.pk).last_used_at is None
    assert api.get("/lmsp/v1/models").status_code == 200
    assert Client.objects.get(pk=api.client.pk).last_used_at is not None


def test_failed_auth_does_not_touch_last_used_at(api):
    ApiClient(api.token + "x").get("/lmsp/v1/models")
    assert Client.objects.get(pk=api.client.pk).last_used_at is None
