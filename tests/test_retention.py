"""Retention cleanup (PROFILE.md section 8, persistence 11.2): what goes, what stays, in bounded batches."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import datetime, timedelta
from io import StringIO
from typing import Any

import pytest
from django.core.management import CommandError, call_command
from django.db import connection
from django.utils import timezone

from tasks_app.core import lifecycle
from tasks_app.core.webhook_outbox import TaskEnd, webhook_deliveries_enqueue
from tasks_app.exceptions import ServerRestarted
from tasks_app.generation.spec import Turn
from tasks_app.models import (
    Batch,
    BatchStatus,
    Client,
    Conversation,
    ConversationItem,
    File,
    FilePurpose,
    IdempotencyKey,
    PairingCode,
    Response,
    Task,
    TaskEvent,
    TaskSnapshot,
    WebhookDelivery,
    WebhookDeliveryStatus,
)
from tasks_app.services.clients import pairing_code_create, pairing_code_redeem
from tasks_app.services.conversations import ConversationEntry, conversation_create
from tasks_app.services.files import file_create, file_path, file_staging_path
from tasks_app.services.idempotency import idempotency_claim, request_digest
from tasks_app.services.retention import CleanupSummary, retention_cleanup
from tasks_app.services.webhooks import webhook_endpoint_create
from tasks_app.states import TaskStatus
from tests.support import moves
from tests.support.api import ApiClient
from tests.support.specs import spec_json
from tests.support.sse import call, open_stream
from tests.support.states import PATHS

S = TaskStatus
FAILURE = ServerRestarted("test failure").to_problem()
EVENT_RETENTION = timedelta(days=7)
TASK_RETENTION = timedelta(days=30)
# Old enough to lose its events, young enough to keep the task.
EVENTS_EXPIRED = EVENT_RETENTION + timedelta(hours=1)
TASK_EXPIRED = TASK_RETENTION + timedelta(hours=1)


@pytest.fixture(autouse=True)
def _retention(settings) -> None:
    settings.LMSP_EVENT_RETENTION_SECONDS = int(EVENT_RETENTION.total_seconds())
    settings.LMSP_TASK_RETENTION_SECONDS = int(TASK_RETENTION.total_seconds())
    settings.LMSP_CLEANUP_BATCH_SIZE = 500


@pytest.fixture
def owner(make_client) -> tuple[Client, str]:
    return make_client("owner")


def make_task(
    client: Client, status: TaskStatus, *, deltas: int = 0, snapshot: bool = False, cancel_from_running: bool = False
) -> Task:
    """A task moved to ``status`` by the lifecycle, with ``deltas`` extra events appended while it ran."""
    task = lifecycle.task_insert(
        client=client,
        request={"model": "demo", "input": "x"},
        generation=spec_json({"model": "demo", "input": "x"}),
        model="demo",
    )
    path = PATHS[status]
    if status == S.CANCELLED and cancel_from_running:
        path = [S.LOADING, S.RUNNING, S.CANCELLING, S.CANCELLED]
    for step in path:
        if step in (S.SUCCEEDED, S.FAILED, S.CANCELLING) and (deltas or snapshot):
            texts = [f"d{i}" for i in range(deltas)]
            appended = moves.progress(
                task.id, texts, snapshot={"token_ids": [1, 2, 3], "state": {}} if snapshot else None
            )
            assert appended.won
            deltas, snapshot = 0, False
        result = moves.move(task.id, step, error=FAILURE) if step == S.FAILED else moves.move(task.id, step)
        assert result.won, (task.id, step)
    return Task.objects.get(pk=task.id)


def age(task: Task, by: timedelta) -> None:
    """Test setup: pretend the task was created, touched and (if terminal) finished ``by`` ago."""
    then = timezone.now() - by
    Task.objects.filter(pk=task.pk).update(created_at=then, updated_at=then, heartbeat_at=then)
    TaskEvent.objects.filter(task_id=task.pk).update(created_at=then)


def event_count(task: Task) -> int:
    return TaskEvent.objects.filter(task_id=task.pk).count()


def events_path(task_id: str) -> str:
    return f"/lmsp/v1/tasks/{task_id}/events"


def test_events_of_an_old_finished_task_go_and_the_task_answers_410_for_them(
    owner, transactional_db, demo_model, web_server
):
    client, token = owner
    old = make_task(client, S.SUCCEEDED, deltas=3)
    age(old, EVENTS_EXPIRED)
    recent = make_task(client, S.CANCELLED)
    age(recent, EVENT_RETENTION - timedelta(hours=1))
    old_events, recent_events = event_count(old), event_count(recent)
    # created, in_progress, item and part added, 3 deltas, the three done events, completed
    assert old_events == 11

    summary = retention_cleanup()

    assert summary == CleanupSummary(events=old_events)
    assert event_count(old) == 0
    assert event_count(recent) == recent_events
    assert Task.objects.filter(pk=old.pk).exists()
    assert Response.objects.filter(pk=old.response_id).exists()

    status, body = call(web_server.base, "GET", f"/lmsp/v1/tasks/{old.pk}", token=token)
    assert status == 200
    assert (body["id"], body["status"]) == (old.pk, "succeeded")
    assert body["response"]["id"] == old.response_id
    for headers in ({}, {"Last-Event-ID": "0"}):
        expired = open_stream(web_server.base, events_path(old.pk), token=token, headers=headers)
        assert expired.status == 410, headers
        assert expired.headers["content-type"] == "application/problem+json"
        assert json.loads(expired.body)["code"] == "event_history_expired"
    with open_stream(web_server.base, events_path(recent.pk), token=token) as stream:
        assert stream.status == 200
        assert [event.event for event in stream.all()] == ["response.created", "response.cancelled"]


def test_old_finished_tasks_go_with_their_response_and_events(owner):
    client, token = owner
    succeeded = make_task(client, S.SUCCEEDED, deltas=2, snapshot=True)
    failed = make_task(client, S.FAILED)
    cancelled = make_task(client, S.CANCELLED, cancel_from_running=True)
    old = [succeeded, failed, cancelled]
    for task in old:
        age(task, TASK_EXPIRED)
    young = make_task(client, S.SUCCEEDED, snapshot=True)
    age(young, TASK_RETENTION - timedelta(hours=1))  # events expired, task kept
    # A live key that remembers a deleted task keeps its stored reply.
    key = IdempotencyKey.objects.create(
        client=client,
        endpoint="responses",
        key="k",
        request_hash="0" * 64,
        state="completed",
        response_status=200,
        response_body={},
        task=failed,
        created_at=timezone.now(),
        expires_at=timezone.now() + timedelta(hours=1),
    )
    # Finishing removed the snapshot rows already; cleanup has none to delete.
    assert not TaskSnapshot.objects.filter(task_id__in=[succeeded.pk, young.pk]).exists()
    old_events = sum(event_count(task) for task in old)
    young_events = event_count(young)

    summary = retention_cleanup()

    assert summary == CleanupSummary(events=old_events + young_events, tasks=3, responses=3, snapshots=0)
    old_ids = [task.pk for task in old]
    assert not Task.objects.filter(pk__in=old_ids).exists()
    assert not Response.objects.filter(pk__in=[task.response_id for task in old]).exists()
    assert not TaskEvent.objects.filter(task_id__in=old_ids).exists()
    key.refresh_from_db()
    assert key.task_id is None
    # The younger task lost only its events.
    assert Task.objects.filter(pk=young.pk, status=S.SUCCEEDED).exists()
    assert Response.objects.filter(pk=young.response_id).exists()
    assert event_count(young) == 0

    api = ApiClient(token, client)
    assert api.get(f"/lmsp/v1/tasks/{succeeded.pk}").status_code == 404
    assert api.get(f"/lmsp/v1/responses/{succeeded.response_id}").status_code == 404
    assert api.get(f"/lmsp/v1/tasks/{young.pk}").json()["status"] == "succeeded"


def test_unfinished_tasks_and_their_events_survive_however_old(owner):
    client, _ = owner
    unfinished = {
        S.QUEUED: make_task(client, S.QUEUED),
        S.LOADING: make_task(client, S.LOADING),
        S.RUNNING: make_task(client, S.RUNNING),
        S.CANCELLING: make_task(client, S.CANCELLING, deltas=4, snapshot=True),
    }
    moves.progress(unfinished[S.RUNNING].pk, ["x"], snapshot={"token_ids": [1], "state": {}})
    finished = make_task(client, S.FAILED)
    for task in [*unfinished.values(), finished]:
        age(task, timedelta(days=3650))
    before = {status: event_count(task) for status, task in unfinished.items()}
    # created; a start adds in_progress, the opened item and part; then the deltas.
    assert before == {S.QUEUED: 1, S.LOADING: 1, S.RUNNING: 5, S.CANCELLING: 8}
    rows_before = {
        task.pk: (task.status, task.response_id, task.last_sequence)
        for task in Task.objects.filter(pk__in=[t.pk for t in unfinished.values()])
    }

    # Even a clock a century ahead makes no unfinished task old enough.
    summary = retention_cleanup(now=timezone.now() + timedelta(days=36500), batch_size=2)

    assert summary.tasks == 1 and summary.responses == 1  # the failed one: cleanup did run
    assert not Task.objects.filter(pk=finished.pk).exists()
    assert {status: event_count(task) for status, task in unfinished.items()} == before
    rows_after = {
        task.pk: (task.status, task.response_id, task.last_sequence)
        for task in Task.objects.filter(pk__in=[t.pk for t in unfinished.values()])
    }
    assert rows_after == rows_before
    assert Response.objects.filter(pk__in=[t.response_id for t in unfinished.values()]).count() == 4
    assert set(TaskSnapshot.objects.values_list("task_id", flat=True)) == {
        unfinished[S.RUNNING].pk,
        unfinished[S.CANCELLING].pk,
    }


def test_expired_idempotency_keys_and_pairing_codes_go_fresh_ones_stay(owner):
    client, _ = owner
    digest = request_digest({"a": 1})
    for name in ("expired-1", "expired-2", "fresh"):
        assert idempotency_claim(client=client, endpoint="tasks", key=name, request_hash=digest).record
    IdempotencyKey.objects.filter(key__startswith="expired").update(expires_at=timezone.now() - timedelta(seconds=1))

    expired_unused, _ = pairing_code_create(scopes="read")
    expired_used, used_code = pairing_code_create(scopes="read")
    pairing_code_redeem(code=used_code, client_name="paired-then-expired")
    fresh_used, fresh_code = pairing_code_create(scopes="read")
    pairing_code_redeem(code=fresh_code, client_name="paired-recently")
    fresh_unused, _ = pairing_code_create(scopes="read")
    PairingCode.objects.filter(pk__in=[expired_unused.pk, expired_used.pk]).update(
        expires_at=timezone.now() - timedelta(seconds=1)
    )

    summary = retention_cleanup()

    assert summary == CleanupSummary(idempotency_keys=2, pairing_codes=2)
    assert list(IdempotencyKey.objects.values_list("key", flat=True)) == ["fresh"]
    assert set(PairingCode.objects.values_list("pk", flat=True)) == {fresh_used.pk, fresh_unused.pk}
    # The client a code created outlives the code.
    assert Client.objects.filter(name="paired-then-expired").exists()


@contextmanager
def deletes_on(table: str) -> Iterator[list[tuple[str, Any]]]:
    """Every DELETE statement that names ``table``, with its parameters."""
    seen: list[tuple[str, Any]] = []

    def record(execute: Callable[..., Any], sql: str, params: Any, many: bool, context: Any) -> Any:
        if sql.lstrip().upper().startswith("DELETE") and f'"{table}"' in sql:
            seen.append((sql, params))
        return execute(sql, params, many, context)

    with connection.execute_wrapper(record):
        yield seen


def test_delivered_and_given_up_webhook_deliveries_go_after_their_retention_pending_ones_stay(owner, settings):
    client, _ = owner
    settings.LMSP_WEBHOOK_ALLOW_PRIVATE_TARGETS = True
    settings.LMSP_WEBHOOK_RETENTION_SECONDS = 3600
    webhook_endpoint_create(client=client, name="hook", url="http://127.0.0.1:9/hook", event_types=["response.failed"])
    tasks = [make_task(client, S.FAILED) for _ in range(5)]
    ends = [TaskEnd(task.id, task.response_id, client.pk, "response.failed") for task in tasks]
    assert webhook_deliveries_enqueue(ends=ends, now=timezone.now()) == 5
    by_task = {row.task_id: row.pk for row in WebhookDelivery.objects.all()}
    old, recent = timezone.now() - timedelta(hours=2), timezone.now() - timedelta(minutes=5)
    D = WebhookDeliveryStatus
    # Test setup: each row as the deliverer would have left it.
    states = [(D.DELIVERED, old), (D.FAILED, old), (D.DELIVERED, recent), (D.PENDING, old), (D.PENDING, None)]
    for task, (status, last) in zip(tasks, states, strict=True):
        delivered = last if status == D.DELIVERED else None
        WebhookDelivery.objects.filter(pk=by_task[task.id]).update(
            status=status, last_attempt_at=last, delivered_at=delivered, attempts=1 if last else 0
        )

    summary = retention_cleanup()

    assert summary.webhook_deliveries == 2
    kept = set(WebhookDelivery.objects.values_list("task_id", flat=True))
    assert kept == {tasks[2].id, tasks[3].id, tasks[4].id}


def test_cleanup_deletes_in_batches_of_at_most_batch_size_rows(owner):
    client, _ = owner
    task = make_task(client, S.CANCELLED, cancel_from_running=True)
    age(task, EVENTS_EXPIRED)
    event_ids = set(TaskEvent.objects.filter(task_id=task.pk).values_list("pk", flat=True))
    assert len(event_ids) == 5  # created, in_progress, item and part added, cancelled

    with deletes_on("task_events") as statements:
        summary = retention_cleanup(batch_size=2)

    assert summary == CleanupSummary(events=5)
    assert event_count(task) == 0
    assert Task.objects.filter(pk=task.pk).exists()
    assert len(statements) == 3, statements  # 2 + 2 + 1, then a short batch ends the loop
    named = [[p for p in params if isinstance(p, int) and not isinstance(p, bool)] for _, params in statements]
    assert all(1 <= len(ids) <= 2 for ids in named), named
    assert {event_id for ids in named for event_id in ids} == event_ids

    with deletes_on("task_events") as again:
        second = retention_cleanup(batch_size=2)
    assert second == CleanupSummary()
    assert again == []


def test_a_batch_size_below_one_is_refused(db):
    with pytest.raises(ValueError):
        retention_cleanup(batch_size=0)
    with pytest.raises(ValueError):
        retention_cleanup(now=datetime(2020, 1, 1))  # naive


def test_idle_conversations_go_with_their_items_only_when_asked_and_never_one_a_response_runs_on(owner, settings):
    client, _ = owner
    entry = ConversationEntry(item={"id": "msg_1", "type": "message"}, turn=Turn("user", text="Hi"))
    idle, busy, fresh = (conversation_create(client=client, metadata=None, entries=[entry]) for _ in range(3))
    lifecycle.task_insert(
        client=client,
        request={"model": "demo", "input": "x"},
        generation=spec_json({"model": "demo", "input": "x"}),
        model="demo",
        conversation_id=busy.pk,
    )
    long_ago = timezone.now() - timedelta(days=40)
    Conversation.objects.filter(pk__in=[idle.pk, busy.pk]).update(updated_at=long_ago)

    # Kept until deleted by default, as OpenAI keeps them.
    assert retention_cleanup().conversations == 0
    settings.LMSP_CONVERSATION_RETENTION_SECONDS = 30 * 24 * 3600
    assert retention_cleanup(batch_size=1).conversations == 1
    assert set(Conversation.objects.values_list("pk", flat=True)) == {busy.pk, fresh.pk}
    assert not ConversationItem.objects.filter(conversation_id=idle.pk).exists()


def _stored_file(client: Client, data: bytes) -> File:
    staged = file_staging_path()
    staged.write_bytes(data)
    return file_create(
        client=client, filename="lines.jsonl", purpose=FilePurpose.BATCH, staged=staged, size=len(data), sha256="0"
    )


def test_old_files_go_with_their_bytes_only_when_asked_never_a_running_batchs_input(owner, settings, tmp_path):
    client, _ = owner
    settings.LMSP_FILES_DIR = tmp_path / "files"
    old, reading, fresh = (_stored_file(client, b"{}\n") for _ in range(3))
    assert old.expires_at is None  # kept until deleted: no expiry to show
    now = timezone.now()
    Batch.objects.create(
        id="batch_01J0000000000000000000000A",
        client=client,
        endpoint="/v1/responses",
        input_file_id=reading.id,
        status=BatchStatus.IN_PROGRESS,
        created_at=now,
        expires_at=now + timedelta(hours=24),
    )
    File.objects.filter(pk__in=[old.pk, reading.pk]).update(created_at=now - timedelta(days=40))

    assert retention_cleanup().files == 0
    settings.LMSP_FILE_RETENTION_SECONDS = 30 * 24 * 3600
    assert retention_cleanup(batch_size=1).files == 1
    assert set(File.objects.values_list("pk", flat=True)) == {reading.pk, fresh.pk}
    assert not file_path(old).exists() and file_path(reading).exists()
    # With a retention, a new file says when it goes.
    assert _stored_file(client, b"{}\n").expires_at is not None


def test_the_command_prints_its_summary(owner):
    client, _ = owner
    task = make_task(client, S.CANCELLED)
    age(task, TASK_EXPIRED)
    code, _ = pairing_code_create(scopes="read")
    PairingCode.objects.filter(pk=code.pk).update(expires_at=timezone.now() - timedelta(minutes=1))

    out = StringIO()
    call_command("lmsp_cleanup", "--batch-size", "1", stdout=out)
    assert out.getvalue() == (
        "deleted 2 events, 1 task (1 response, 0 snapshots), 0 idempotency keys, 1 pairing code, 0 webhook deliveries, "
        "0 conversations, 0 files\n"
    )
    assert not Task.objects.filter(pk=task.pk).exists()

    again = StringIO()
    call_command("lmsp_cleanup", stdout=again)
    assert again.getvalue() == (
        "deleted 0 events, 0 tasks (0 responses, 0 snapshots), 0 idempotency keys, 0 pairing codes, "
        "0 webhook deliveries, 0 conversations, 0 files\n"
    )
    with pytest.raises(CommandError):
        call_command("lmsp_cleanup", "--batch-size", "0", stdout=StringIO())
