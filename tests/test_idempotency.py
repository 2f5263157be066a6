"""Idempotency-Key on POST /tasks (PROFILE.md section 5)."""

from __future__ import annotations

import threading
from datetime import timedelta

import pytest
from django.db import connection, transaction
from django.utils import timezone

from tasks_app.exceptions import IdempotencyKeyInUse
from tasks_app.models import IdempotencyKey, IdempotencyState, Task, TaskEvent
from tasks_app.services.idempotency import idempotency_claim, request_digest
from tests.support.api import ApiClient

BODY = {"type": "response", "input": {"model": "demo", "input": "Write a long report."}, "on_restart": "retry"}


def post(api: ApiClient, body: dict, key: str):
    return api.post("/lmsp/v1/tasks", body, headers={"Idempotency-Key": key})


def test_replay_returns_the_first_reply(api):
    first = post(api, BODY, "key-1")
    assert first.status_code == 202
    assert "Idempotent-Replayed" not in first
    again = post(api, BODY, "key-1")
    assert again.status_code == 202
    assert again["Idempotent-Replayed"] == "true"
    assert again.content == first.content  # byte for byte, on every database
    assert again["Location"] == first["Location"]
    assert Task.objects.count() == 1
    assert TaskEvent.objects.count() == 1


def test_replay_ignores_key_order_and_whitespace(api):
    first = post(api, BODY, "key-2").json()
    reordered = (
        '{"on_restart": "retry",  "input": {"input": "Write a long report.", "model": "demo"},\n "type": "response"}'
    )
    reply = api.post("/lmsp/v1/tasks", raw=reordered, headers={"Idempotency-Key": "key-2"})
    assert reply.status_code == 202
    assert reply.json()["id"] == first["id"]


def test_replay_after_the_task_moved_on_shows_the_first_reply(api):
    first = post(api, BODY, "key-3").json()
    api.post(f"/lmsp/v1/tasks/{first['id']}/cancel")
    replay = post(api, BODY, "key-3").json()
    assert replay == first  # the stored reply, not the current state
    assert api.get(f"/lmsp/v1/tasks/{first['id']}").json()["status"] == "cancelled"


def test_same_key_other_body_is_422(api):
    post(api, BODY, "key-4")
    other = {**BODY, "input": {"model": "demo", "input": "Something else"}}
    reply = post(api, other, "key-4")
    assert reply.status_code == 422
    assert reply.json()["code"] == "idempotency_key_reused"
    assert Task.objects.count() == 1


def test_keys_are_scoped_per_client(api, other_api):
    mine = post(api, BODY, "shared-key").json()
    theirs = post(other_api, BODY, "shared-key").json()
    assert mine["id"] != theirs["id"]
    assert Task.objects.count() == 2


def test_expired_key_can_be_used_again(api):
    first = post(api, BODY, "key-5").json()
    IdempotencyKey.objects.update(expires_at=timezone.now() - timedelta(seconds=1))
    second = post(api, BODY, "key-5")
    assert second.status_code == 202
    assert "Idempotent-Replayed" not in second
    assert second.json()["id"] != first["id"]


def test_failed_request_leaves_no_key(api):
    bad = {**BODY, "input": {"model": "no-such-model", "input": "x"}}
    assert post(api, bad, "key-6").status_code == 400
    assert not IdempotencyKey.objects.exists()
    assert post(api, BODY, "key-6").status_code == 202


def test_key_still_in_progress_is_409(api):
    """A key whose first request has not finished (a waiting POST /responses)."""
    digest = request_digest(BODY)
    with transaction.atomic():
        claim = idempotency_claim(client=api.client, endpoint="tasks", key="key-7", request_hash=digest)
    assert claim.record.state == IdempotencyState.IN_PROGRESS
    reply = post(api, BODY, "key-7")
    assert reply.status_code == 409
    assert reply.json()["code"] == "idempotency_key_in_use"
    with pytest.raises(IdempotencyKeyInUse), transaction.atomic():
        idempotency_claim(client=api.client, endpoint="tasks", key="key-7", request_hash=digest)


@pytest.mark.django_db(transaction=True)
def test_concurrent_first_use_creates_one_task(api):
    threads = 8
    barrier = threading.Barrier(threads)
    replies: list = [None] * threads

    def worker(index: int) -> None:
        try:
            client = ApiClient(api.token)
            barrier.wait()
            replies[index] = post(client, BODY, "race-key")
        finally:
            connection.close()

    pool = [threading.Thread(target=worker, args=(i,)) for i in range(threads)]
    for thread in pool:
        thread.start()
    for thread in pool:
        thread.join(timeout=60)

    assert all(r is not None and r.status_code == 202 for r in replies), [r and r.content for r in replies]
    assert len({r.json()["id"] for r in replies}) == 1
    assert sum("Idempotent-Replayed" not in r for r in replies) == 1
    assert Task.objects.count() == 1
    assert IdempotencyKey.objects.count() == 1
