"""Wake-ups go out after the commit they describe, and never for a rolled-back change."""

from __future__ import annotations

import json

import pytest
from django.db import transaction

from tasks_app.core import lifecycle
from tasks_app.plumbing.notify import redis_client, tasks_channel
from tasks_app.states import TaskStatus
from tests.support.specs import spec_json


@pytest.fixture
def subscription():
    pubsub = redis_client().pubsub(ignore_subscribe_messages=True)
    pubsub.subscribe(tasks_channel())
    pubsub.get_message(timeout=1)  # the subscribe confirmation
    yield pubsub
    pubsub.close()


def received(pubsub) -> list[dict]:
    out = []
    while (message := pubsub.get_message(timeout=0.5)) is not None:
        out.append(json.loads(message["data"]))
    return out


def test_a_committed_move_is_announced_with_its_status_and_sequence(
    transactional_db, make_client, demo_model, subscription
):
    client, _ = make_client()
    task = lifecycle.task_insert(
        client=client,
        request={"model": "demo", "input": "x"},
        generation=spec_json({"model": "demo", "input": "x"}),
        model="demo",
    )

    lifecycle.task_cancel_queued(task_id=task.id)

    assert received(subscription) == [{"task_id": task.id, "status": "cancelled", "last_sequence": 1}]


def test_a_rolled_back_move_is_not_announced(transactional_db, make_client, demo_model, subscription):
    client, _ = make_client()
    task = lifecycle.task_insert(
        client=client,
        request={"model": "demo", "input": "x"},
        generation=spec_json({"model": "demo", "input": "x"}),
        model="demo",
    )

    with pytest.raises(RuntimeError), transaction.atomic():
        lifecycle.task_cancel_queued(task_id=task.id)
        raise RuntimeError("roll back")

    assert received(subscription) == []
    task.refresh_from_db()
    assert task.status == TaskStatus.QUEUED


def test_a_lost_compare_and_set_is_not_announced(transactional_db, make_client, demo_model, subscription):
    client, _ = make_client()
    task = lifecycle.task_insert(
        client=client,
        request={"model": "demo", "input": "x"},
        generation=spec_json({"model": "demo", "input": "x"}),
        model="demo",
    )
    lifecycle.task_cancel_queued(task_id=task.id)
    received(subscription)

    lost = lifecycle.task_claim(task_id=task.id, worker="w@host/1")

    assert not lost.won
    assert received(subscription) == []
