"""Webhooks (docs/webhooks.md): endpoints through the openai package, the outbox, the deliverer.

Real parts throughout: the database of the run, a live web server and worker
where a task must run, a real HTTP receiver on 127.0.0.1, the openai
package as the client (``webhooks.create``... and ``webhooks.unwrap``), and
``manage.py lmsp_webhooks`` as a process that outlives killed ones. Backoffs
are shortened by settings; rounds are ``--once`` (in this process) or a
deliverer polling every 0.1 s; nothing sleeps a fixed time.
"""

from __future__ import annotations

import base64
import itertools
import json
import multiprocessing
import os
import signal
import socket
import threading
import urllib.request
from datetime import timedelta

import openai
import pytest
from django.db import transaction
from django.db.models import F
from django.utils import timezone

from tasks_app.core import lifecycle
from tasks_app.models import Task, WebhookDelivery, WebhookDeliveryStatus, WebhookEndpoint
from tasks_app.plumbing.webhook_http import AttemptOutcome, webhook_post
from tasks_app.services.recovery import abandoned_tasks_reap
from tasks_app.services.webhook_delivery import (
    webhook_backoff_seconds,
    webhook_deliveries_claim,
    webhook_deliveries_retry_now,
    webhook_deliveries_run,
    webhook_delivery_record,
)
from tasks_app.services.webhooks import webhook_endpoint_create, webhook_endpoint_rotate_secret
from tasks_app.states import RestartPolicy, TaskStatus
from tests.support.db import database_url
from tests.support.namespace import REDIS_PREFIX
from tests.support.server import free_port, uvicorn_process
from tests.support.specs import spec_json
from tests.support.waiting import wait_until
from tests.support.webhooks import Receiver, deliverer_process, finish_as_worker, receiving, sdk
from tests.test_query_plans import assert_read_through, statements

D = WebhookDeliveryStatus
S = TaskStatus
RESPONSE_TYPES = ["response.completed", "response.incomplete", "response.failed", "response.cancelled"]
# A batch's ends (docs/batches.md) after a response's.
ALL_TYPES = [*RESPONSE_TYPES, "batch.completed", "batch.failed", "batch.cancelled", "batch.expired"]
GHOST = "ghost@nowhere/1"
API = "/lmsp/v1/webhook_endpoints"


@pytest.fixture
def fast_webhooks(settings):
    """Loopback receivers allowed, and retries due at once (a few milliseconds of backoff)."""
    settings.LMSP_WEBHOOK_ALLOW_PRIVATE_TARGETS = True
    settings.LMSP_WEBHOOK_BACKOFF_BASE_SECONDS = 0.001
    settings.LMSP_WEBHOOK_BACKOFF_MAX_SECONDS = 0.01
    settings.LMSP_WEBHOOK_TIMEOUT_SECONDS = 5
    return settings


def endpoint_for(client, url: str, event_types=None) -> WebhookEndpoint:
    return webhook_endpoint_create(client=client, name="test", url=url, event_types=event_types or ALL_TYPES)


def ended_task(client, end: str = "cancelled", notify: bool = True) -> Task:
    """A task of ``client`` ended by the lifecycle: cancelled while queued, or failed."""
    task = lifecycle.task_insert(
        client=client,
        request={"model": "demo", "input": "hi"},
        generation=spec_json({"model": "demo", "input": "hi"}),
        model="demo",
        notify_webhooks=notify,
    )
    if end == "cancelled":
        assert lifecycle.task_cancel_queued(task_id=task.id).won
    else:
        assert lifecycle.task_fail(task_id=task.id, error={"code": "x", "detail": "y"}).won
    return task


def round_until(probe, what: str):
    """``--once`` rounds until ``probe()`` holds (a retry becomes due within milliseconds)."""

    def step():
        webhook_deliveries_run(once=True)
        return probe()

    return wait_until(step, what=what, timeout=20)


def unwrap(client: openai.OpenAI, received, secret: str):
    return client.webhooks.unwrap(received.body, received.headers, secret=secret)


# --------------------------------------------------------------------------- #
# Endpoints through the openai package
# --------------------------------------------------------------------------- #


def test_endpoints_are_created_listed_read_updated_rotated_and_deleted_with_the_openai_sdk(
    transactional_db, web_server, make_client
):
    _, token = make_client("alice")
    _, other_token = make_client("bob")
    _, reader_token = make_client("reader", scopes="read")
    alice, bob, reader = (
        sdk(web_server.base, token),
        sdk(web_server.base, other_token),
        sdk(web_server.base, reader_token),
    )

    created = alice.webhooks.create(name="first", url="https://hooks.example.invalid/a", event_types=ALL_TYPES[:1])
    assert created.id.startswith("whep_") and created.object == "webhook_endpoint"
    assert created.signing_secret.startswith("whsec_")
    assert len(base64.b64decode(created.signing_secret.removeprefix("whsec_"))) == 32
    assert created.signing_secret_hint == f"whsec_...{created.signing_secret[-4:]}"
    more = [
        alice.webhooks.create(name=f"n{n}", url=f"https://hooks.example.invalid/{n}", event_types=ALL_TYPES)
        for n in range(2)
    ]

    # The secret is shown on create and rotate only.
    read = alice.webhooks.retrieve(created.id)
    assert read.url == "https://hooks.example.invalid/a" and read.event_types == ["response.completed"]
    assert "signing_secret" not in read.to_dict()
    page = alice.webhooks.list(limit=2)
    assert [e.id for e in page.data] == [more[1].id, more[0].id] and page.has_more
    assert [e.id for e in alice.webhooks.list(limit=2)] == [more[1].id, more[0].id, created.id]
    assert all("signing_secret" not in e.to_dict() for e in page.data)

    updated = alice.webhooks.update(created.id, name="renamed", event_types=["response.failed", "response.cancelled"])
    assert (updated.name, updated.event_types, updated.url) == (
        "renamed",
        ["response.failed", "response.cancelled"],
        "https://hooks.example.invalid/a",
    )
    assert updated.updated_at >= created.updated_at
    rotated = alice.webhooks.rotate_secret(created.id)
    assert rotated.signing_secret.startswith("whsec_") and rotated.signing_secret != created.signing_secret
    assert WebhookEndpoint.objects.get(pk=created.id).secret == rotated.signing_secret

    # Another client's endpoint does not exist for it; a read-only client reads but does not write.
    for call in (
        lambda: bob.webhooks.retrieve(created.id),
        lambda: bob.webhooks.update(created.id, name="x"),
        lambda: bob.webhooks.delete(created.id),
        lambda: bob.webhooks.rotate_secret(created.id),
    ):
        with pytest.raises(openai.NotFoundError) as refused:
            call()
        assert refused.value.response.json()["code"] == "webhook_endpoint_not_found"
    assert list(bob.webhooks.list()) == []
    assert list(reader.webhooks.list()) == []
    with pytest.raises(openai.PermissionDeniedError):
        reader.webhooks.create(name="r", url="https://hooks.example.invalid/r", event_types=ALL_TYPES)

    # A private target and an unknown event type, refused by name.
    with pytest.raises(openai.BadRequestError) as refused:
        alice.webhooks.create(name="p", url="http://10.0.0.1/x", event_types=ALL_TYPES)
    assert [e["field"] for e in refused.value.response.json()["errors"]] == ["url"]
    with pytest.raises(openai.BadRequestError) as refused:
        alice.webhooks.create(name="p", url="https://hooks.example.invalid/x", event_types=["batch.unknown"])
    assert "event_types" in refused.value.response.json()["errors"][0]["field"]
    assert "batch.unknown" in refused.value.response.json()["errors"][0]["message"]

    deleted = alice.webhooks.delete(created.id)
    assert (deleted.id, deleted.object, deleted.deleted) == (created.id, "webhook_endpoint.deleted", True)
    with pytest.raises(openai.NotFoundError):
        alice.webhooks.retrieve(created.id)
    assert WebhookEndpoint.objects.filter(client__name="alice").count() == 2


def test_a_sample_event_is_sent_signed_and_answered_with_the_status_the_endpoint_gave(
    transactional_db, make_client, fast_webhooks
):
    _, token = make_client("alice")
    _, other_token = make_client("bob")
    env = {
        "LMSP_WEBHOOK_ALLOW_PRIVATE_TARGETS": "true",
        "LMSP_REDIS_PREFIX": fast_webhooks.LMSP_REDIS_PREFIX,
        "REDIS_URL": fast_webhooks.REDIS_URL,
    }
    with receiving(statuses=[204, 500]) as receiver, uvicorn_process(database_url(), env) as web:
        alice, bob = sdk(web.base, token), sdk(web.base, other_token)
        assert alice.webhooks.event_types.list().data == ALL_TYPES
        endpoint = alice.webhooks.create(name="t", url=receiver.url, event_types=ALL_TYPES[:1])

        ok = alice.webhooks.test(endpoint.id, event_type="response.completed")
        failing = alice.webhooks.test(endpoint.id, event_type="response.cancelled")
        assert (ok.object, ok.webhook_endpoint_id, ok.event_type, ok.success) == (
            "webhook_endpoint.test",
            endpoint.id,
            "response.completed",
            True,
        )
        # Any answer is a result, a failing one too; and any event type, subscribed or not.
        assert (ok.status_code, failing.status_code, failing.event_type) == (204, 500, "response.cancelled")
        first, second = receiver.received
        event = alice.webhooks.unwrap(first.body, first.headers, secret=endpoint.signing_secret)
        assert event.type == "response.completed" and type(event).__name__ == "ResponseCompletedWebhookEvent"
        # A sample: it names a response that does not exist, and nothing of it is stored or retried.
        with pytest.raises(openai.NotFoundError):
            alice.responses.retrieve(event.data.id)
        assert first.headers["webhook-id"] != second.headers["webhook-id"]
        assert not WebhookDelivery.objects.exists()

        with pytest.raises(openai.BadRequestError) as unknown:
            alice.webhooks.test(endpoint.id, event_type="batch.unknown")
        assert (unknown.value.code, unknown.value.param) == ("invalid_request", "event_type")
        with pytest.raises(openai.NotFoundError) as foreign:
            bob.webhooks.test(endpoint.id, event_type="response.completed")
        assert foreign.value.code == "webhook_endpoint_not_found"
        # No answer at all: the endpoint's port is closed.
        alice.webhooks.update(endpoint.id, url=f"http://127.0.0.1:{free_port()}/hooks")
        with pytest.raises(openai.APIStatusError) as unanswered:
            alice.webhooks.test(endpoint.id, event_type="response.completed")
        assert (unanswered.value.status_code, unanswered.value.code) == (502, "webhook_test_failed")
        assert "refused" in str(unanswered.value)
    assert len(receiver.received) == 2


@pytest.mark.parametrize(
    "url",
    [
        "http://127.0.0.1/x",
        "http://10.0.0.1/x",
        "http://[::1]/",
        "http://[::ffff:127.0.0.1]/",
        "http://169.254.169.254/latest/meta-data",
        "http://0.0.0.0/",
        "http://224.0.0.1/",
        "http://240.0.0.1/",
        "http://2130706433/",
        "http://localhost:8000/",
        "ftp://hooks.example.invalid/",
        "http://user:pw@hooks.example.invalid/",
        "https:///no-host",
        "http://hooks.example.invalid:99999/",
        "hooks.example.invalid/x",
    ],
)
def test_a_target_that_is_not_allowed_is_refused_naming_url(api, url):
    reply = api.post(API, {"name": "x", "url": url, "event_types": ALL_TYPES})
    assert reply.status_code == 400, reply.content
    assert [e["field"] for e in reply.json()["errors"]] == ["url"], reply.json()
    assert not WebhookEndpoint.objects.exists()


def test_bad_bodies_are_refused_by_field_and_private_targets_need_the_setting(api, settings):
    for body, field in [
        ({"name": "x", "url": "https://h.example.invalid/", "event_types": ["response.done"]}, "event_types"),
        ({"name": "x", "url": "https://h.example.invalid/", "event_types": ALL_TYPES[:1] * 2}, "event_types"),
        ({"name": "x", "url": "https://h.example.invalid/", "event_types": []}, "event_types"),
        ({"name": "x", "url": "https://h.example.invalid/", "event_types": ALL_TYPES, "secret": "s"}, "secret"),
        ({"url": "https://h.example.invalid/", "event_types": ALL_TYPES}, "name"),
    ]:
        reply = api.post(API, body)
        assert reply.status_code == 400, reply.content
        assert any(e["field"].startswith(field) for e in reply.json()["errors"]), reply.json()
    assert api.get(API, after="nope").status_code == 400
    assert api.get(API, limit="101").status_code == 400

    settings.LMSP_WEBHOOK_ALLOW_PRIVATE_TARGETS = True
    reply = api.post(API, {"name": "local", "url": "http://127.0.0.1:9/x", "event_types": ALL_TYPES})
    assert reply.status_code == 201, reply.content


# --------------------------------------------------------------------------- #
# The outbox is written in the terminal transaction
# --------------------------------------------------------------------------- #


def test_the_delivery_commits_with_the_tasks_end_and_rolls_back_with_it(make_client, django_assert_num_queries):
    client, _ = make_client()
    endpoint_for(client, "https://hooks.example.invalid/x", ["response.cancelled"])
    queued = lifecycle.task_insert(
        client=client,
        request={"model": "demo", "input": "hi"},
        generation=spec_json({"model": "demo", "input": "hi"}),
        model="demo",
        notify_webhooks=True,
    )

    with pytest.raises(RuntimeError), transaction.atomic():
        assert lifecycle.task_cancel_queued(task_id=queued.id).won
        assert WebhookDelivery.objects.filter(task_id=queued.id).count() == 1
        raise RuntimeError("the transaction rolls back")
    assert Task.objects.get(pk=queued.id).status == S.QUEUED
    assert not WebhookDelivery.objects.exists()

    assert lifecycle.task_cancel_queued(task_id=queued.id).won
    (delivery,) = WebhookDelivery.objects.all()
    payload = json.loads(delivery.payload)
    assert payload == {
        "id": delivery.event_id,
        "object": "event",
        "created_at": payload["created_at"],
        "type": "response.cancelled",
        "data": {"id": queued.response_id, "task_id": queued.id},
    }
    assert (delivery.status, delivery.attempts, delivery.event_type) == (D.PENDING, 0, "response.cancelled")


def test_the_outbox_costs_one_select_and_one_insert_and_nothing_when_the_task_does_not_notify(make_client):
    client, _ = make_client()
    other, _ = make_client()
    endpoint_for(other, "https://hooks.example.invalid/x")

    def cancel_cost(notify: bool) -> int:
        task = lifecycle.task_insert(
            client=client,
            request={"model": "demo", "input": "h"},
            generation=spec_json({"model": "demo", "input": "h"}),
            model="demo",
            notify_webhooks=notify,
        )
        with statements() as captured:
            assert lifecycle.task_cancel_queued(task_id=task.id).won
        return len(captured)

    silent = cancel_cost(False)
    # Notifying, but no endpoint of this client is subscribed: the one SELECT of its endpoints.
    assert cancel_cost(True) == silent + 1
    endpoint_for(client, "https://hooks.example.invalid/y", ["response.cancelled"])
    endpoint_for(client, "https://hooks.example.invalid/z", ["response.cancelled"])
    assert cancel_cost(True) == silent + 2
    assert WebhookDelivery.objects.count() == 2
    # A task whose caller waits on the connection writes nothing.
    assert cancel_cost(False) == silent and WebhookDelivery.objects.count() == 2


# --------------------------------------------------------------------------- #
# Delivery
# --------------------------------------------------------------------------- #


def test_a_task_run_by_the_worker_is_delivered_signed_and_a_foreground_response_is_not(
    running_worker, web_server, api, fast_webhooks
):
    client = sdk(web_server.base, api.token)
    with receiving() as receiver:
        endpoint = endpoint_for(api.client, receiver.url, ["response.completed", "response.incomplete"])
        body = json.dumps({"type": "response", "input": {"model": "demo", "input": "Hi", "max_output_tokens": 3}})
        request = urllib.request.Request(
            f"{web_server.base}/lmsp/v1/tasks",
            data=body.encode(),
            headers={"Authorization": f"Bearer {api.token}", "Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=30) as reply:
            task = json.loads(reply.read())
        # A foreground response: its caller has the answer; no webhook.
        foreground = client.responses.create(model="demo", input="Hello", max_output_tokens=2)
        assert foreground.status in {"completed", "incomplete"}

        done = wait_until(
            lambda: Task.objects.filter(pk=task["id"], status__in=[S.SUCCEEDED]).first(), what="the task never ran"
        )
        assert not WebhookDelivery.objects.filter(response_id=foreground.id).exists()
        counts = webhook_deliveries_run(once=True)
        assert counts.delivered == 1, counts

    (got,) = receiver.received
    event = unwrap(client, got, endpoint.secret)
    assert event.type in {"response.completed", "response.incomplete"}
    assert type(event).__name__ in {"ResponseCompletedWebhookEvent", "ResponseIncompleteWebhookEvent"}
    assert event.data.id == done.response_id and event.object == "event"
    assert json.loads(got.body)["data"]["task_id"] == done.id
    assert got.headers["content-type"] == "application/json" and got.headers["user-agent"].startswith("lmsp-webhooks")
    delivery = WebhookDelivery.objects.get()
    assert got.headers["webhook-id"] == delivery.id and got.path == "/hooks"
    assert (delivery.status, delivery.attempts, delivery.last_status_code) == (D.DELIVERED, 1, 200)
    with pytest.raises(openai.InvalidWebhookSignatureError):
        client.webhooks.unwrap(got.body.replace(b"resp_", b"resp_X"), got.headers, secret=endpoint.secret)
    with pytest.raises(openai.InvalidWebhookSignatureError):
        client.webhooks.unwrap(got.body, got.headers, secret=webhook_endpoint_rotate_secret(endpoint=endpoint).secret)


def test_a_receiver_that_is_down_gets_the_same_webhook_id_once_it_is_back(make_client, fast_webhooks, admin_client):
    client, _ = make_client()
    receiver = Receiver(statuses=[500])
    endpoint = endpoint_for(client, receiver.url, ["response.cancelled"])
    task = ended_task(client, "cancelled")

    # The port is closed: the attempt fails without an answer and is retried later.
    assert webhook_deliveries_run(once=True).retrying == 1
    delivery = WebhookDelivery.objects.get()
    assert (delivery.status, delivery.attempts, delivery.last_status_code) == (D.PENDING, 1, None)
    assert "Connection" in delivery.last_error and delivery.next_attempt_at >= delivery.last_attempt_at

    receiver.start()
    try:
        # Up, but answering 500 first, then 200.
        round_until(lambda: WebhookDelivery.objects.get().attempts == 2, "no second attempt")
        delivery = WebhookDelivery.objects.get()
        assert (delivery.status, delivery.last_status_code) == (D.PENDING, 500)
        assert delivery.last_error.startswith("HTTP 500")
        page = admin_client.get(f"/admin/tasks_app/webhookdelivery/{delivery.pk}/change/")
        assert page.status_code == 200 and "HTTP 500" in page.content.decode()
        round_until(lambda: WebhookDelivery.objects.get().status == D.DELIVERED, "never delivered")
    finally:
        receiver.stop()

    delivery = WebhookDelivery.objects.get()
    assert (delivery.attempts, delivery.last_status_code, delivery.last_error) == (3, 200, "")
    assert [r.answered for r in receiver.received] == [500, 200]
    assert {r.headers["webhook-id"] for r in receiver.received} == {delivery.id}
    assert {r.body for r in receiver.received} == {delivery.payload.encode()}
    event = unwrap(sdk("http://unused", "x"), receiver.received[-1], endpoint.secret)
    assert event.type == "response.cancelled" and event.data.id == task.response_id
    listing = admin_client.get("/admin/tasks_app/webhookdelivery/?status__exact=delivered")
    assert listing.status_code == 200 and delivery.id in listing.content.decode()


def test_a_task_failed_by_recovery_is_delivered_as_response_failed(make_client, fast_webhooks):
    client, _ = make_client()
    quiet, _ = make_client()
    tasks = []
    for owner in (client, quiet):
        task = lifecycle.task_insert(
            client=owner,
            request={"model": "demo", "input": "hi"},
            generation=spec_json({"model": "demo", "input": "hi"}),
            model="demo",
            notify_webhooks=True,
        )
        assert lifecycle.task_claim(task_id=task.id, worker=GHOST).won
        assert lifecycle.task_start(task_id=task.id, worker=GHOST, item_id="msg_x").won
        Task.objects.filter(pk=task.id).update(
            heartbeat_at=timezone.now() - timedelta(seconds=600), on_restart=RestartPolicy.FAIL
        )
        tasks.append(task)
    with receiving() as receiver:
        endpoint = endpoint_for(client, receiver.url, ["response.failed"])
        abandoned_tasks_reap(timeout_seconds=60)
        assert set(Task.objects.values_list("status", flat=True)) == {S.FAILED}
        # Only the client with an endpoint gets a delivery.
        assert list(WebhookDelivery.objects.values_list("task_id", "endpoint_id")) == [(tasks[0].id, endpoint.id)]
        assert webhook_deliveries_run(once=True).delivered == 1
    event = unwrap(sdk("http://unused", "x"), receiver.received[0], endpoint.secret)
    assert type(event).__name__ == "ResponseFailedWebhookEvent" and event.data.id == tasks[0].response_id


def test_backoff_grows_and_a_delivery_is_given_up_after_its_maximum_age(make_client, fast_webhooks):
    fast_webhooks.LMSP_WEBHOOK_BACKOFF_BASE_SECONDS = 5
    fast_webhooks.LMSP_WEBHOOK_BACKOFF_MAX_SECONDS = 3600
    assert [webhook_backoff_seconds(attempts=n, rng=lambda: 0.0) for n in (1, 2, 3, 4)] == [5, 10, 20, 40]
    assert webhook_backoff_seconds(attempts=30, rng=lambda: 0.0) == 3600
    assert webhook_backoff_seconds(attempts=2, rng=lambda: 1.0) == 7.5
    # Below the cap each wait is longer than the one before, whatever the jitter.
    for n in range(1, 11):
        assert webhook_backoff_seconds(attempts=n + 1, rng=lambda: 1.0) >= webhook_backoff_seconds(
            attempts=n, rng=lambda: 0.0
        )

    fast_webhooks.LMSP_WEBHOOK_BACKOFF_BASE_SECONDS = 0.02
    fast_webhooks.LMSP_WEBHOOK_BACKOFF_MAX_SECONDS = 10
    client, _ = make_client()
    with receiving(default=503) as receiver:
        endpoint_for(client, receiver.url)
        ended_task(client, "failed")
        waits = []

        def attempt_recorded() -> bool:
            delivery = WebhookDelivery.objects.get()
            assert delivery.status == D.PENDING, "given up before its maximum age"
            if delivery.attempts > len(waits):
                waits.append((delivery.next_attempt_at - delivery.last_attempt_at).total_seconds())
            return len(waits) >= 3

        round_until(attempt_recorded, "fewer than three attempts")
        # The event is made as old as its maximum age (72 hours by default), rather than a test
        # racing a short one: the next failed attempt gives it up.
        max_age = timedelta(seconds=fast_webhooks.LMSP_WEBHOOK_MAX_AGE_SECONDS)
        WebhookDelivery.objects.update(created_at=F("created_at") - max_age)
        round_until(lambda: WebhookDelivery.objects.get().status == D.FAILED, "never given up")
    delivery = WebhookDelivery.objects.get()
    assert delivery.attempts == 4 and delivery.last_status_code == 503 and delivery.delivered_at is None
    # Each wait is counted from the attempt's start (``last_attempt_at``) and so also holds the attempt's own
    # round trip, which a loaded machine stretches by tens of milliseconds: the waits need not be in order,
    # but each is at least its attempt's backoff with the most jitter (0.75 x 0.02 x 2^(n-1) s), and those double.
    base = fast_webhooks.LMSP_WEBHOOK_BACKOFF_BASE_SECONDS
    assert all(wait >= 0.75 * base * 2**n for n, wait in enumerate(waits)), waits
    assert len(receiver.received) == delivery.attempts
    # Nothing more is sent once it is given up.
    assert webhook_deliveries_run(once=True).delivered == 0 and len(receiver.received) == delivery.attempts


def test_claims_are_leased_once_fenced_and_read_through_the_due_index(make_client, fast_webhooks):
    client, _ = make_client()
    endpoint_for(client, "http://127.0.0.1:9/x")
    for _ in range(3):
        ended_task(client)
    with statements() as captured:
        first = webhook_deliveries_claim(limit=2)
    assert len(first) == 2
    # Leased: another deliverer's claim gets only the one left, then nothing.
    assert [c.id for c in webhook_deliveries_claim(limit=5)] == [
        pk for pk in WebhookDelivery.objects.values_list("id", flat=True) if pk not in {c.id for c in first}
    ]
    assert webhook_deliveries_claim(limit=5) == []
    # An expired lease is claimable again; the old holder's late result is then not recorded.
    WebhookDelivery.objects.filter(pk=first[0].id).update(lease_expires_at=timezone.now() - timedelta(seconds=1))
    (again,) = webhook_deliveries_claim(limit=5)
    assert again.id == first[0].id and again.lease_token != first[0].lease_token
    late = AttemptOutcome(delivered=True, status_code=200, error="", elapsed_ms=1)
    assert webhook_delivery_record(claimed=first[0], outcome=late) is None
    assert webhook_delivery_record(claimed=again, outcome=late) == D.DELIVERED
    assert WebhookDelivery.objects.get(pk=again.id).attempts == 1

    selects = [(sql, params) for sql, params in captured if sql.startswith("SELECT") and "webhook_deliveries" in sql]
    assert_read_through("webhook_delivery_due", selects[:1])


def _post_to_a_dripping_receiver(head: bytes, drip: bytes) -> AttemptOutcome:
    """One attempt (0.4 s timeout) to a receiver that sends ``head`` at once, then ``drip`` a byte every 0.1 s."""
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    stop = threading.Event()

    def answer() -> None:
        connection, _ = listener.accept()
        with connection:
            connection.recv(65536)
            try:
                connection.sendall(head)
                # At most 20 s of it, so that an attempt that never gives up fails the test instead of hanging it.
                for byte in itertools.islice(itertools.cycle(drip), 200):
                    if stop.wait(0.1):
                        return
                    connection.sendall(bytes([byte]))
            except OSError:
                return  # the attempt gave up and closed its end

    answering = threading.Thread(target=answer, daemon=True)
    answering.start()
    try:
        return webhook_post(
            url=f"http://127.0.0.1:{port}/hooks",
            webhook_id="whmsg_slow",
            payload="{}",
            secrets=("whsec_" + base64.b64encode(b"k" * 32).decode(),),
            timeout=0.4,
            allow_private=True,
        )
    finally:
        stop.set()
        answering.join(timeout=10)
        listener.close()


def test_an_attempt_ends_after_three_timeouts_however_slowly_its_receiver_answers():
    """A receiver that sends its answer a byte at a time, each byte within the socket timeout."""
    outcome = _post_to_a_dripping_receiver(b"", b"HTTP/1.1 200 OK\r\nX-Slow: ")
    assert not outcome.delivered and outcome.status_code is None
    assert outcome.error == "no answer within 1.2 s (3 x LMSP_WEBHOOK_TIMEOUT_SECONDS)", outcome


def test_an_answer_the_deadline_cuts_after_its_status_code_is_no_delivery():
    """The cut ends the read as a close would: "HTTP/1.1 200 OKKK" and no headers must not pass for a 200."""
    outcome = _post_to_a_dripping_receiver(b"HTTP/1.1 200 OK", b"K")
    assert not outcome.delivered and outcome.status_code is None
    assert outcome.error == "no answer within 1.2 s (3 x LMSP_WEBHOOK_TIMEOUT_SECONDS)", outcome


def test_a_target_that_turned_private_is_not_sent_to(make_client, fast_webhooks):
    client, _ = make_client()
    with receiving() as receiver:
        endpoint = endpoint_for(client, receiver.url)
        ended_task(client)
        fast_webhooks.LMSP_WEBHOOK_ALLOW_PRIVATE_TARGETS = False
        assert webhook_deliveries_run(once=True).retrying == 1
        delivery = WebhookDelivery.objects.get()
        assert delivery.last_error.startswith("target refused") and "loopback" in delivery.last_error
        assert receiver.received == []

        # Allowed again, and rotated keeping the old secret: both secrets verify the delivery.
        fast_webhooks.LMSP_WEBHOOK_ALLOW_PRIVATE_TARGETS = True
        old = endpoint.secret
        new = webhook_endpoint_rotate_secret(endpoint=endpoint, keep_previous=True).secret
        round_until(lambda: receiver.received, "never delivered")
    (got,) = receiver.received
    assert len(got.headers["webhook-signature"].split()) == 2
    for secret in (old, new):
        assert unwrap(sdk("http://unused", "x"), got, secret).type == "response.cancelled"


def test_deleting_an_endpoint_deletes_its_waiting_deliveries(api, fast_webhooks):
    endpoint = endpoint_for(api.client, "http://127.0.0.1:9/x")
    ended_task(api.client)
    assert WebhookDelivery.objects.count() == 1
    reply = api.http.delete(f"{API}/{endpoint.id}", headers={"Authorization": f"Bearer {api.token}"})
    assert reply.status_code == 200 and reply.json()["deleted"] is True
    assert not WebhookDelivery.objects.exists() and not WebhookEndpoint.objects.exists()


# --------------------------------------------------------------------------- #
# The admin
# --------------------------------------------------------------------------- #


@pytest.mark.parametrize("rows", [3, 40])
def test_the_admin_lists_deliveries_in_fixed_queries_never_shows_a_secret_and_retries_now(
    admin_client, make_client, fast_webhooks, rows, django_assert_num_queries
):
    client, _ = make_client()
    endpoint = endpoint_for(client, "http://127.0.0.1:9/x")
    for _ in range(rows):
        ended_task(client)
    # Session, user, one bounded count, one page (its endpoints joined).
    with django_assert_num_queries(4):
        listing = admin_client.get("/admin/tasks_app/webhookdelivery/")
    assert listing.status_code == 200
    for url in ("/admin/tasks_app/webhookendpoint/", f"/admin/tasks_app/webhookendpoint/{endpoint.pk}/change/"):
        page = admin_client.get(url)
        assert page.status_code == 200 and endpoint.secret not in page.content.decode()
        assert f"whsec_...{endpoint.secret[-4:]}" in page.content.decode()

    given_up = WebhookDelivery.objects.order_by("id").first()
    WebhookDelivery.objects.filter(pk=given_up.pk).update(
        status=D.FAILED, next_attempt_at=timezone.now() + timedelta(days=1)
    )
    reply = admin_client.post(
        "/admin/tasks_app/webhookdelivery/", {"action": "retry_now", "_selected_action": [given_up.pk]}
    )
    assert reply.status_code == 302
    again = WebhookDelivery.objects.get(pk=given_up.pk)
    assert again.status == D.PENDING and again.next_attempt_at <= timezone.now()
    assert admin_client.post(f"/admin/tasks_app/webhookdelivery/{given_up.pk}/delete/").status_code == 403


# --------------------------------------------------------------------------- #
# The outbox survives the processes that wrote it
# --------------------------------------------------------------------------- #


def test_events_committed_by_killed_processes_are_delivered_by_a_deliverer_started_later(
    transactional_db, api, fast_webhooks, tmp_path
):
    url = database_url()
    queue = f"{REDIS_PREFIX}-webhooks-nobody"
    env = {"LMSP_TASK_QUEUE": queue, "LMSP_REDIS_PREFIX": REDIS_PREFIX, "REDIS_URL": fast_webhooks.REDIS_URL}
    headers = {"Authorization": f"Bearer {api.token}", "Content-Type": "application/json"}

    def post(base: str, path: str, body: dict | None = None) -> dict:
        data = json.dumps(body).encode() if body is not None else b"{}"
        with urllib.request.urlopen(urllib.request.Request(base + path, data, headers), timeout=30) as reply:
            return json.loads(reply.read())

    with receiving() as receiver:
        endpoint = endpoint_for(api.client, receiver.url)
        task_body = {"type": "response", "input": {"model": "demo", "input": "Hi"}}
        with uvicorn_process(url, env) as web:
            cancelled, completed, waiting = (post(web.base, "/lmsp/v1/tasks", task_body)["id"] for _ in range(3))
            post(web.base, f"/lmsp/v1/tasks/{cancelled}/cancel")
            os.kill(web.pid, signal.SIGKILL)
        # A worker process ends one, and is killed too.
        spawn = multiprocessing.get_context("spawn")
        done = spawn.Event()
        worker = spawn.Process(target=finish_as_worker, args=(url, completed, done))
        worker.start()
        assert done.wait(60), "the worker process never finished its task"
        os.kill(worker.pid, signal.SIGKILL)
        worker.join()
        assert WebhookDelivery.objects.filter(status=D.PENDING).count() == 2 and receiver.received == []

        with deliverer_process({"DATABASE_URL": url, "LMSP_WEBHOOK_POLL_SECONDS": "0.1"}, tmp_path / "log") as log:
            wait_until(
                lambda: WebhookDelivery.objects.filter(status=D.DELIVERED).count() == 2,
                what=lambda: f"not delivered:\n{log()}",
            )

    got = {
        (event := unwrap(sdk("http://unused", "x"), r, endpoint.secret)).data.task_id: event.type
        for r in receiver.received
    }
    assert got == {cancelled: "response.cancelled", completed: "response.completed"}
    assert len(receiver.received) == 2
    assert Task.objects.get(pk=waiting).status == S.QUEUED
    text = (tmp_path / "log").read_text()
    assert text.count(": delivered (HTTP 200)") == 2 and "Traceback" not in text, text
    from tasks_app.plumbing.notify import redis_client

    redis_client().delete(queue)


def test_a_deliverer_that_barely_polls_is_woken_by_each_commit_that_makes_a_delivery_due(
    transactional_db, make_client, fast_webhooks, tmp_path
):
    """With a poll of ten minutes, only the wake-up after each commit can bring the deliverer to send in time."""
    env = {
        "DATABASE_URL": database_url(),
        "REDIS_URL": fast_webhooks.REDIS_URL,
        "LMSP_REDIS_PREFIX": fast_webhooks.LMSP_REDIS_PREFIX,
        "LMSP_WEBHOOK_POLL_SECONDS": "600",
    }
    client, _ = make_client()
    with receiving() as receiver:
        endpoint_for(client, receiver.url)
        # One delivery waits out a backoff of a day, until the admin's "retry now".
        ended_task(client, "failed")
        backing_off = WebhookDelivery.objects.get()
        WebhookDelivery.objects.update(next_attempt_at=timezone.now() + timedelta(days=1))
        with deliverer_process(env, tmp_path / "log") as log:
            # The first end may be sent by the deliverer's first claim or the claim after it subscribed;
            # the second, committed once the first arrived, only by the wake-up its commit published.
            for count in (1, 2):
                ended_task(client, "cancelled")
                wait_until(lambda n=count: len(receiver.received) == n, what=log)
            assert webhook_deliveries_retry_now(delivery_ids=[backing_off.id]) == 1
            wait_until(lambda: len(receiver.received) == 3, what=log)
    assert [json.loads(r.body)["type"] for r in receiver.received] == ["response.cancelled"] * 2 + ["response.failed"]
    assert receiver.received[2].headers["webhook-id"] == backing_off.id
    assert "Traceback" not in (tmp_path / "log").read_text()
