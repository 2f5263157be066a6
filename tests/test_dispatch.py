"""Dispatch after commit, and the sweeper that repairs lost messages (no worker here)."""

from __future__ import annotations

import base64
import json
from collections.abc import Iterator
from datetime import timedelta

import pytest
from django.conf import settings
from django.utils import timezone

from tasks_app.models import Task
from tasks_app.plumbing.dispatch_sender import dispatch_sender_start, dispatch_sender_stop, dispatch_sender_submit
from tasks_app.plumbing.notify import key, redis_client
from tasks_app.services.dispatch import queued_tasks_sweep
from tasks_app.states import TaskStatus
from tests.support.queues import drop_messages, queued_ids
from tests.support.waiting import wait_until


def marked(task_id: str) -> bool:
    return bool(redis_client().exists(key("dispatched", task_id)))


def test_an_accepted_task_is_sent_after_commit_with_only_its_id(api, queue):
    task = api.create_task("Hi").json()

    assert queued_ids(queue) == [task["id"]]
    message = json.loads(redis_client().lrange(queue, 0, -1)[0])
    assert message["headers"]["task"] == "lmsp.run_task"
    assert json.loads(base64.b64decode(message["body"])) == [
        [task["id"]],
        {},
        {"callbacks": None, "errbacks": None, "chain": None, "chord": None},
    ]
    assert marked(task["id"])


def test_a_refused_task_sends_nothing(api, queue):
    response = api.post("/lmsp/v1/tasks", {"type": "response", "input": {"model": "nope", "input": "x"}})

    assert response.status_code == 400
    assert queued_ids(queue) == []


def _age(task_id: str, seconds: int) -> None:
    Task.objects.filter(pk=task_id).update(updated_at=timezone.now() - timedelta(seconds=seconds))


def test_the_sweeper_resends_queued_tasks_whose_message_is_unaccounted_for(api, queue):
    lost = api.create_task("lost").json()["id"]
    kept = api.create_task("kept").json()["id"]
    young = api.create_task("young").json()["id"]
    finished = api.create_task("finished").json()["id"]
    api.post(f"/lmsp/v1/tasks/{finished}/cancel")
    # Their messages and markers are gone (a Redis restarted without persistence); kept's message came back.
    kept_message = next(raw for raw in redis_client().lrange(queue, 0, -1) if kept in message_ids(raw))
    redis_client().delete(queue, key("dispatched", lost), key("dispatched", young), key("dispatched", finished))
    redis_client().lpush(queue, kept_message)
    for task_id in (lost, kept, finished):
        _age(task_id, 60)

    sent = queued_tasks_sweep(grace_seconds=30)

    assert sent == [lost]
    assert queued_ids(queue) == [kept, lost]
    assert marked(lost)
    assert queued_tasks_sweep(grace_seconds=30) == []
    assert Task.objects.get(pk=finished).status == TaskStatus.CANCELLED


def message_ids(raw: bytes) -> list[str]:
    return json.loads(base64.b64decode(json.loads(raw)["body"]))[0]


def test_the_sweeper_resends_a_marked_task_whose_message_is_gone(api, queue):
    # The marker outlived its message: a worker killed holding it, or a sender killed between marker and send.
    gone = api.create_task("gone").json()["id"]
    waiting = api.create_task("waiting").json()["id"]
    drop_messages(queue, [gone])
    for task_id in (gone, waiting):
        _age(task_id, 60)
    assert marked(gone) and marked(waiting)

    assert queued_tasks_sweep(grace_seconds=30) == [gone]

    assert sorted(queued_ids(queue)) == sorted([gone, waiting])
    assert queued_tasks_sweep(grace_seconds=30) == []


def test_a_marked_task_whose_message_a_killed_worker_holds_is_sent_again(api, queue):
    task_id = api.create_task("taken").json()["id"]
    _age(task_id, 60)
    # A worker took the message (kombu keeps it unacknowledged for the visibility timeout, 12 h) and was
    # killed before it cleared the marker: only the queue vouches for a task, so it goes out again.
    raw = redis_client().rpop(queue)
    tag = f"test-{task_id}"
    redis_client().hset("unacked", tag, json.dumps([json.loads(raw), "", queue]))
    try:
        assert marked(task_id)
        assert queued_tasks_sweep(grace_seconds=30) == [task_id]
    finally:
        redis_client().hdel("unacked", tag)
    assert queued_ids(queue) == [task_id]


def test_the_sweeper_uses_the_configured_grace(api, queue):
    task_id = api.create_task("x").json()["id"]
    redis_client().delete(key("dispatched", task_id))
    _age(task_id, settings.LMSP_SWEEP_GRACE_SECONDS - 2)

    assert queued_tasks_sweep() == []
    _age(task_id, settings.LMSP_SWEEP_GRACE_SECONDS + 1)
    assert queued_tasks_sweep() == [task_id]


@pytest.fixture
def sender() -> Iterator[None]:
    """This process sends through a background sender, as a web process does."""
    dispatch_sender_start()
    yield
    dispatch_sender_stop()


def test_with_a_sender_the_message_and_its_marker_follow_the_commit_from_its_thread(api, queue, sender):
    task = api.create_task("Hi").json()

    wait_until(lambda: queued_ids(queue) == [task["id"]], what=lambda: f"not sent: {queued_ids(queue)}")
    wait_until(lambda: marked(task["id"]), what="no dispatch marker")


def test_a_task_refused_by_its_transaction_is_never_handed_to_the_sender(api, queue, sender):
    response = api.post("/lmsp/v1/tasks", {"type": "response", "input": {"model": "nope", "input": "x"}})
    ok = api.create_task("after").json()

    assert response.status_code == 400
    wait_until(lambda: queued_ids(queue) == [ok["id"]], what=lambda: f"sent: {queued_ids(queue)}")


def test_stopping_the_sender_sends_what_is_still_waiting(queue, sender):
    ids = [f"task_drain_{n}" for n in range(250)]
    for task_id in ids:
        assert dispatch_sender_submit(task_id=task_id)

    # The drain's own bound (2 s) is not what this test is about: 250 Redis round trips on a loaded
    # machine may take longer, and the sender would rightly leave the rest to the sweeper.
    dispatch_sender_stop(timeout=60)

    assert sorted(queued_ids(queue)) == sorted(ids)
    assert all(marked(task_id) for task_id in ids)
    assert not dispatch_sender_submit(task_id="task_after_stop")  # back to sending inline
