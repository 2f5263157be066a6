"""Limits on open event streams, per client and per web process, over a real uvicorn server.

The server here allows 2 streams per client and 3 per process, so a handful
of real connections reach both limits. Tasks stay queued (no worker), so a
stream stays open until its client closes it.
"""

from __future__ import annotations

import json
import re
import socket
import struct
import urllib.request
from collections.abc import Iterator

import pytest

from tasks_app.models import Task
from tests.support.api import ApiClient
from tests.support.db import database_url
from tests.support.logs import events_path
from tests.support.server import Server, uvicorn_process
from tests.support.sse import SseStream, open_stream
from tests.support.waiting import wait_until

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]

PER_CLIENT, PER_PROCESS, RETRY_AFTER = 2, 3, 7


@pytest.fixture(scope="module")
def limited(django_db_setup, django_db_blocker, demo_models_root) -> Iterator[Server]:
    with django_db_blocker.unblock():
        url = database_url()
    env = {
        "LMSP_MODELS_DIR": str(demo_models_root),
        "LMSP_MAX_STREAMS_PER_CLIENT": str(PER_CLIENT),
        "LMSP_MAX_STREAMS_PER_PROCESS": str(PER_PROCESS),
        "LMSP_STREAM_LIMIT_RETRY_AFTER_SECONDS": str(RETRY_AFTER),
    }
    with uvicorn_process(url, env) as server:
        yield server


def open_streams(base: str) -> int:
    """The server's own count of open streams (``/metrics``)."""
    with urllib.request.urlopen(base + "/metrics", timeout=10) as reply:
        text = reply.read().decode()
    return int(float(re.search(r"^lmsp_open_streams (\S+)$", text, re.M).group(1)))


@pytest.fixture
def streams(limited: Server) -> Iterator[list[SseStream]]:
    """Streams the test opens; all closed afterwards, and the server has let go of them before the next test."""
    opened: list[SseStream] = []
    yield opened
    for stream in opened:
        stream.close()
    wait_until(lambda: open_streams(limited.base) == 0, what="the server kept streams of a closed connection")


def follow(base: str, path: str, streams: list[SseStream], **kwargs) -> SseStream:
    stream = open_stream(base, path, **kwargs)
    streams.append(stream)
    return stream


def assert_too_many_streams(reply: SseStream, detail: str) -> None:
    assert reply.status == 429, reply.body
    assert reply.headers["content-type"] == "application/problem+json"
    assert reply.headers["retry-after"] == str(RETRY_AFTER)
    problem = json.loads(reply.body)
    assert problem["code"] == "too_many_streams"
    assert problem["status"] == 429
    assert detail in problem["detail"]


def test_a_client_over_its_limit_gets_429_until_one_of_its_streams_ends(api, other_api, limited, streams):
    task = api.create_task("for streams").json()
    path = events_path(task["id"])
    held = [follow(limited.base, path, streams, token=api.token) for _ in range(PER_CLIENT)]
    assert [stream.status for stream in held] == [200] * PER_CLIENT

    assert_too_many_streams(follow(limited.base, path, streams, token=api.token), "this client")
    # A stream token is the same client's: it counts against the same limit.
    minted = api.post(f"/lmsp/v1/tasks/{task['id']}/stream_token").json()
    assert_too_many_streams(follow(limited.base, minted["events_url"], streams), "this client")
    # Another client is not affected.
    theirs = other_api.create_task("theirs").json()
    assert follow(limited.base, events_path(theirs["id"]), streams, token=other_api.token).status == 200

    held[0].close()
    again = wait_until(
        lambda: (reply := follow(limited.base, path, streams, token=api.token)).status == 200 and reply,
        what="closing a stream did not free its slot",
    )
    assert again.status == 200


def test_the_process_limit_counts_every_client(api, other_api, make_client, limited, streams):
    _, third = make_client("carol")
    mine = events_path(api.create_task("mine").json()["id"])
    theirs = events_path(other_api.create_task("theirs").json()["id"])
    held = [follow(limited.base, mine, streams, token=api.token) for _ in range(PER_CLIENT)]
    held.append(follow(limited.base, theirs, streams, token=other_api.token))
    assert [stream.status for stream in held] == [200] * PER_PROCESS

    carol = ApiClient(third)
    task = carol.create_task("carol's").json()
    assert_too_many_streams(follow(limited.base, events_path(task["id"]), streams, token=third), "this server")

    held[-1].close()
    wait_until(
        lambda: follow(limited.base, events_path(task["id"]), streams, token=third).status == 200,
        what="closing a stream did not free a slot of the process",
    )


def test_streamed_responses_count_and_a_refused_one_creates_no_task(api, limited, streams):
    task = api.create_task("held").json()
    held = [follow(limited.base, events_path(task["id"]), streams, token=api.token) for _ in range(PER_CLIENT)]
    assert [stream.status for stream in held] == [200] * PER_CLIENT
    before = Task.objects.count()

    body = {"model": "demo", "input": "hi", "stream": True}
    refused = follow(limited.base, "/lmsp/v1/responses", streams, token=api.token, method="POST", body=body)
    assert_too_many_streams(refused, "this client")
    assert Task.objects.count() == before, "a refused stream still created its task"
    by_response = follow(
        limited.base, f"/lmsp/v1/responses/{task['response_id']}?stream=true", streams, token=api.token
    )
    assert_too_many_streams(by_response, "this client")
    # Not streaming: no stream slot needed.
    assert api.get(f"/lmsp/v1/responses/{task['response_id']}").status_code == 200

    held[0].close()
    streamed = wait_until(
        lambda: (
            (
                reply := follow(limited.base, "/lmsp/v1/responses", streams, token=api.token, method="POST", body=body)
            ).status
            == 200
            and reply
        ),
        what="closing a stream did not free its slot",
    )
    assert streamed.take(1)[0].event == "response.created"
    assert_too_many_streams(
        follow(limited.base, "/lmsp/v1/responses", streams, token=api.token, method="POST", body=body), "this client"
    )


def test_a_connection_reset_by_its_client_frees_its_slot(api, limited, streams):
    task = api.create_task("reset").json()
    path = events_path(task["id"])
    held = [follow(limited.base, path, streams, token=api.token) for _ in range(PER_CLIENT)]
    assert [stream.status for stream in held] == [200] * PER_CLIENT
    assert follow(limited.base, path, streams, token=api.token).status == 429

    # An abortive close (RST), as a crashed client or a dropped network path leaves it.
    sock: socket.socket = held[0]._conn.sock
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    held[0].close()
    wait_until(
        lambda: follow(limited.base, path, streams, token=api.token).status == 200,
        what="a reset connection kept its slot",
    )


def test_a_limit_of_zero_refuses_every_stream_operation_before_anything_is_written(api, settings):
    # Through Django's test client (no ASGI middleware): the views decide alone.
    settings.LMSP_MAX_STREAMS_PER_CLIENT = 0
    task = api.create_task("no streams").json()
    before = Task.objects.count()

    answers = [
        api.get(events_path(task["id"])),
        api.get(f"/lmsp/v1/responses/{task['response_id']}", stream="true"),
        api.post("/lmsp/v1/responses", {"model": "demo", "input": "hi", "stream": True}),
    ]

    for answer in answers:
        assert (answer.status_code, answer.json()["code"]) == (429, "too_many_streams")
        assert answer["Retry-After"] == "5"
    assert Task.objects.count() == before
