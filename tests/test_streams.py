"""Event streams over a real uvicorn server, with a real worker and model (chapter 7.4, PROFILE.md section 4)."""

from __future__ import annotations

import json
import os
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import openai
import pytest

from tasks_app.models import Task, TaskEvent
from tasks_app.states import TaskStatus
from tests.support.demo import ENDLESS_MODEL
from tests.support.logs import as_rows, assert_well_formed_log, delta_text, events_path, stored
from tests.support.sse import TERMINAL_TYPES, SseEvent, call, open_stream
from tests.support.tasks import create, wait_for_status

TERMINAL = {"succeeded", "failed", "cancelled"}


def final_text(api, task_id: str) -> str:
    body = api.get(f"/lmsp/v1/tasks/{task_id}").json()
    return "".join(part["text"] for item in body["response"]["output"] for part in item["content"])


def test_a_full_stream_is_the_task_log_and_closes_after_the_terminal_event(api, running_worker, web_server):
    task = create(api, "Tell me about rivers", max_output_tokens=300, seed=3)

    with open_stream(web_server.base, events_path(task["id"]), token=api.token) as stream:
        assert stream.status == 200
        assert stream.headers["content-type"].startswith("text/event-stream")
        assert stream.headers["cache-control"] == "no-cache"
        events = stream.all()

    assert stream.ended, "the server did not close the stream after the terminal event"
    assert as_rows(events) == stored(task["id"])
    payloads = [event.payload for event in events]
    assert_well_formed_log(payloads)
    assert [p["type"] for p in payloads] == [event.event for event in events]
    assert [p["sequence_number"] for p in payloads] == [event.id for event in events]
    assert delta_text(payloads) == final_text(api, task["id"])


def test_resume_from_every_cursor_gives_exactly_the_rest(api, running_worker, web_server):
    task = create(api, "Count to ten", max_output_tokens=12, seed=1)
    wait_for_status(api, task["id"], TERMINAL)
    log = stored(task["id"])
    last = log[-1][0]

    with open_stream(web_server.base, events_path(task["id"]), token=api.token) as late:
        assert as_rows(late.all()) == log
        assert late.ended
    for cursor in range(last):
        by_header = open_stream(
            web_server.base, events_path(task["id"]), token=api.token, headers={"Last-Event-ID": str(cursor)}
        )
        by_query = open_stream(web_server.base, f"{events_path(task['id'])}?starting_after={cursor}", token=api.token)
        with by_header, by_query:
            assert as_rows(by_header.all()) == log[cursor + 1 :], cursor
            assert as_rows(by_query.all()) == log[cursor + 1 :], cursor
    # The client holds the terminal event: 204, so an EventSource stops reconnecting.
    assert (
        open_stream(
            web_server.base, events_path(task["id"]), token=api.token, headers={"Last-Event-ID": str(last)}
        ).status
        == 204
    )
    after_last = f"{events_path(task['id'])}?starting_after={last}"
    assert open_stream(web_server.base, after_last, token=api.token).status == 204


def test_the_header_cursor_wins_over_the_query(api, running_worker, web_server):
    # A browser reconnects to the same URL and sends its newest id as the header.
    task = create(api, "Hi", max_output_tokens=6, seed=1)
    wait_for_status(api, task["id"], TERMINAL)
    log = stored(task["id"])

    with open_stream(
        web_server.base, f"{events_path(task['id'])}?starting_after=1", token=api.token, headers={"Last-Event-ID": "4"}
    ) as stream:
        assert as_rows(stream.all()) == log[5:]


def test_a_client_that_drops_mid_stream_gets_the_rest_without_gap_or_duplicate(api, running_worker, web_server):
    task = create(api, "A long story", model=ENDLESS_MODEL, max_output_tokens=4000, seed=5)
    with open_stream(web_server.base, events_path(task["id"]), token=api.token) as first:
        before = first.take(40)
    assert Task.objects.get(pk=task["id"]).status == TaskStatus.RUNNING

    with open_stream(
        web_server.base, events_path(task["id"]), token=api.token, headers={"Last-Event-ID": str(before[-1].id)}
    ) as second:
        middle = second.take(60)
        assert Task.objects.get(pk=task["id"]).status == TaskStatus.RUNNING
        api.post(f"/lmsp/v1/tasks/{task['id']}/cancel")
        rest = second.all()

    seen = before + middle + rest
    assert [event.id for event in seen] == list(range(len(seen)))
    assert as_rows(seen) == stored(task["id"])
    assert seen[-1].event == "response.cancelled"


def _read_all(base: str, token: str, task_id: str) -> list[SseEvent]:
    with open_stream(base, events_path(task_id), token=token) as stream:
        return stream.all()


def test_many_concurrent_streams_on_one_task_and_on_many(api, running_worker, web_server):
    tasks = [create(api, f"Story {n}", max_output_tokens=150, seed=n) for n in range(3)]
    plan = [tasks[0]["id"]] * 16 + [t["id"] for t in tasks[1:] for _ in range(6)]

    with ThreadPoolExecutor(max_workers=len(plan)) as pool:
        results = list(pool.map(lambda task_id: _read_all(web_server.base, api.token, task_id), plan))

    logs = {t["id"]: stored(t["id"]) for t in tasks}
    for task_id, events in zip(plan, results, strict=True):
        assert as_rows(events) == logs[task_id]
        assert events[-1].event in TERMINAL_TYPES


def test_cancelling_a_task_ends_its_streams_with_response_cancelled(api, running_worker, web_server):
    task = create(api, "Go on and on", model=ENDLESS_MODEL, max_output_tokens=4000)
    streams = [open_stream(web_server.base, events_path(task["id"]), token=api.token) for _ in range(3)]
    try:
        for stream in streams:
            assert stream.take(10)[-1].id == 9
        assert api.post(f"/lmsp/v1/tasks/{task['id']}/cancel").status_code == 200
        for stream in streams:
            rest = stream.all()
            assert stream.ended
            assert rest[-1].event == "response.cancelled"
            assert [e.event for e in rest].count("response.cancelled") == 1
    finally:
        for stream in streams:
            stream.close()


def test_the_openai_sdk_reads_on_past_keepalives(api, queue, web_server):
    # The SDK turns a blank line after a comment into an empty event once it saw an id, and fails to parse
    # it: a keepalive must be a comment line alone. On a queue no worker reads, the task stays queued and
    # only keepalives flow.
    sdk = openai.OpenAI(base_url=f"{web_server.base}/lmsp/v1", api_key=api.token, max_retries=0, timeout=30)
    queued = sdk.responses.retrieve(
        api.post("/lmsp/v1/responses", {"model": "demo", "input": "Hi", "background": True}).json()["id"]
    )
    assert queued.status == "queued"
    kinds = []
    with ThreadPoolExecutor(1) as pool:
        for event in sdk.responses.retrieve(queued.id, stream=True):
            kinds.append(event.type)
            if event.type == "response.created":
                # Cancelled after three keepalives (one a second here).
                pool.submit(lambda: (time.sleep(3.2), sdk.responses.cancel(queued.id)))
    assert kinds == ["response.created", "response.cancelled"]


def test_an_idle_stream_gets_keepalive_comments(api, transactional_db, web_server):
    # No worker: the task stays queued, so nothing but keepalives arrives
    # after response.created (the server under test sends one per second).
    task = api.create_task("wait").json()
    with open_stream(web_server.base, events_path(task["id"]), token=api.token) as stream:
        assert [e.event for e in stream.take(1)] == ["response.created"]
        stream.read_comments("keepalive", 2)
        api.post(f"/lmsp/v1/tasks/{task['id']}/cancel")
        rest = stream.all()
    assert [e.event for e in rest] == ["response.cancelled"]


def test_expired_history_is_410_and_the_task_stays_readable(api, transactional_db, web_server):
    task = api.create_task("short").json()
    api.post(f"/lmsp/v1/tasks/{task['id']}/cancel")  # queued -> cancelled: events 0 and 1
    TaskEvent.objects.filter(task_id=task["id"], sequence_number=0).delete()

    expired = open_stream(web_server.base, events_path(task["id"]), token=api.token)
    assert expired.status == 410
    assert expired.headers["content-type"] == "application/problem+json"
    assert json.loads(expired.body)["code"] == "event_history_expired"
    with open_stream(web_server.base, f"{events_path(task['id'])}?starting_after=0", token=api.token) as rest:
        assert [e.event for e in rest.all()] == ["response.cancelled"]

    TaskEvent.objects.filter(task_id=task["id"]).delete()

    assert open_stream(web_server.base, f"{events_path(task['id'])}?starting_after=0", token=api.token).status == 410
    assert open_stream(web_server.base, f"{events_path(task['id'])}?starting_after=1", token=api.token).status == 204
    status, body = call(web_server.base, "GET", f"/lmsp/v1/tasks/{task['id']}", token=api.token)
    assert (status, body["status"]) == (200, "cancelled")


@pytest.mark.parametrize(
    ("query", "headers", "field"),
    [
        ("?starting_after=2", {}, "starting_after"),
        ("", {"Last-Event-ID": "7"}, "Last-Event-ID"),
        ("?starting_after=abc", {}, "starting_after"),
        ("?starting_after=-1", {}, "starting_after"),
        ("", {"Last-Event-ID": "1e3"}, "Last-Event-ID"),
        ("?starting_after=99999999999", {}, "starting_after"),
    ],
)
def test_a_bad_or_future_cursor_is_400_naming_it(api, transactional_db, web_server, query, headers, field):
    task = api.create_task("x").json()
    api.post(f"/lmsp/v1/tasks/{task['id']}/cancel")  # last event: 1

    reply = open_stream(web_server.base, events_path(task["id"]) + query, token=api.token, headers=headers)

    assert reply.status == 400
    problem = json.loads(reply.body)
    assert problem["code"] == "invalid_request"
    assert problem["errors"][0]["field"] == field


def test_unknown_foreign_and_unauthenticated_reads_are_refused(
    api, other_api, make_client, transactional_db, web_server
):
    task = api.create_task("mine").json()
    _, writer_only = make_client("writer", scopes="responses")

    unknown = open_stream(web_server.base, events_path("task_01J8M8R5X3V7B2N4Q9T1W6Y0ZC"), token=api.token)
    foreign = open_stream(web_server.base, events_path(task["id"]), token=other_api.token)
    anonymous = open_stream(web_server.base, events_path(task["id"]))
    bad_token = open_stream(web_server.base, events_path(task["id"]), token="lmsp_nope")
    no_scope = open_stream(web_server.base, events_path(task["id"]), token=writer_only)
    wrong_method = call(web_server.base, "POST", events_path(task["id"]), token=api.token, body={})

    assert (unknown.status, json.loads(unknown.body)["code"]) == (404, "task_not_found")
    assert (foreign.status, json.loads(foreign.body)["code"]) == (404, "task_not_found")
    assert (anonymous.status, json.loads(anonymous.body)["code"]) == (401, "unauthorized")
    assert anonymous.headers["www-authenticate"].startswith("Bearer")
    assert bad_token.status == 401
    assert (no_scope.status, json.loads(no_scope.body)["code"]) == (403, "insufficient_scope")
    assert wrong_method[0] == 405


def test_an_admin_client_streams_any_task(api, make_client, transactional_db, web_server):
    task = api.create_task("mine").json()
    api.post(f"/lmsp/v1/tasks/{task['id']}/cancel")
    _, admin = make_client("root", scopes="admin")

    with open_stream(web_server.base, events_path(task["id"]), token=admin) as stream:
        assert [e.event for e in stream.all()] == ["response.created", "response.cancelled"]


def _open_many(base: str, token: str, task_ids: list[str]) -> list[Any]:
    streams = []
    for task_id in task_ids:
        stream = open_stream(base, events_path(task_id), token=token)
        assert stream.take(1)[0].id == 0
        streams.append(stream)
    return streams


def test_streams_share_one_subscription_and_hold_no_connection_each(api, transactional_db, web_server):
    from tests.support.db import open_database_handles

    tasks = [api.create_task(f"t{n}").json() for n in range(5)]
    before, threads_before = open_database_handles(web_server.pid), thread_count(web_server.pid)
    subscribers_before = subscriber_count()
    streams = _open_many(web_server.base, api.token, [t["id"] for t in tasks for _ in range(6)])
    try:
        subscribers = subscriber_count()
        during, threads_during = open_database_handles(web_server.pid), thread_count(web_server.pid)
    finally:
        for stream in streams:
            stream.close()

    # 30 streams add at most the web process's one subscription (it may hold
    # it from an earlier test already), never one each.
    assert subscribers >= 1
    assert subscribers - subscribers_before <= 1, (subscribers_before, subscribers)
    # Reads go through a small pool of connections, not one per stream, and
    # an open stream keeps no thread of Django's request handling either.
    assert during - before <= 4, (before, during)
    assert threads_during - threads_before <= 6, (threads_before, threads_during)


def subscriber_count() -> int:
    from tasks_app.plumbing.notify import redis_client, tasks_channel

    return dict(redis_client().pubsub_numsub(tasks_channel()))[tasks_channel().encode()]


def thread_count(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/task"))
