"""The API behind a real HTTP server (uvicorn), where the test client cannot reach."""

from __future__ import annotations

import http.client
import json
import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager
from urllib.parse import urlsplit

import pytest

from tasks_app.models import Task, TaskEvent
from tests.support.db import database_url
from tests.support.logs import events_path
from tests.support.server import uvicorn_server
from tests.support.sse import open_stream
from tests.support.waiting import wait_until

# The HTTP server's own behaviour (sockets, keep-alive, limits), which no database changes: the SQLite
# pass only (pyproject.toml, the sqlite_pass marker).
pytestmark = [pytest.mark.sqlite_pass, pytest.mark.slow, pytest.mark.django_db(transaction=True)]


@pytest.fixture
def server(demo_model, models_dir):
    with uvicorn_server(database_url(), {"LMSP_MODELS_DIR": str(models_dir), "LMSP_MAX_REQUEST_BYTES": "4096"}) as base:
        yield urlsplit(base)


def request(
    server, method: str, path: str, body: bytes | None = None, headers: dict | None = None, chunked: bool = False
):
    conn = http.client.HTTPConnection(server.hostname, server.port, timeout=30)
    try:
        if chunked:
            conn.putrequest(method, path)
            for name, value in (headers or {}).items():
                conn.putheader(name, value)
            conn.putheader("Transfer-Encoding", "chunked")
            conn.endheaders()
            for start in range(0, len(body), 1000):
                chunk = body[start : start + 1000]
                conn.send(f"{len(chunk):x}\r\n".encode() + chunk + b"\r\n")
            conn.send(b"0\r\n\r\n")
        else:
            conn.request(method, path, body=body, headers=headers or {})
        reply = conn.getresponse()
        return reply.status, dict(reply.getheaders()), reply.read()
    finally:
        conn.close()


def test_create_and_read_over_http(server, api):
    headers = {"Authorization": f"Bearer {api.token}", "Content-Type": "application/json"}
    body = json.dumps({"type": "response", "input": {"model": "demo", "input": "hi"}}).encode()
    status, reply_headers, raw = request(server, "POST", "/lmsp/v1/tasks", body, headers)
    assert status == 202
    task = json.loads(raw)
    assert reply_headers["location"] == f"/lmsp/v1/tasks/{task['id']}"
    assert Task.objects.filter(pk=task["id"]).exists()
    status, _, raw = request(server, "GET", f"/lmsp/v1/tasks/{task['id']}", headers=headers)
    assert status == 200 and json.loads(raw)["id"] == task["id"]


@pytest.mark.parametrize("chunked", [False, True])
def test_oversized_body_is_413_and_writes_nothing(server, api, chunked):
    headers = {"Authorization": f"Bearer {api.token}", "Content-Type": "application/json"}
    prompt = "x" * 10_000
    body = json.dumps({"type": "response", "input": {"model": "demo", "input": prompt}}).encode()
    status, reply_headers, raw = request(server, "POST", "/lmsp/v1/tasks", body, headers, chunked=chunked)
    assert status == 413
    assert reply_headers["content-type"] == "application/problem+json"
    assert json.loads(raw)["code"] == "payload_too_large"
    assert not Task.objects.exists()
    assert not TaskEvent.objects.exists()


def test_unknown_route_and_server_errors_are_problems(server):
    status, headers, raw = request(server, "GET", "/lmsp/v1/does-not-exist")
    assert status == 404
    assert headers["content-type"] == "application/problem+json"
    assert json.loads(raw)["code"] == "not_found"


def test_chunked_body_within_the_limit_is_read(server, api):
    headers = {"Authorization": f"Bearer {api.token}", "Content-Type": "application/json"}
    body = json.dumps({"type": "response", "input": {"model": "demo", "input": "y" * 2500}}).encode()
    status, _, raw = request(server, "POST", "/lmsp/v1/tasks", body, headers, chunked=True)
    assert status == 202, raw
    assert Task.objects.get(pk=json.loads(raw)["id"]).response.request["input"] == "y" * 2500


# --- the HTTP server's own limits (lmsp_project/http_server.py, docs/http.md) -----------------------

MAX_HEADER_BYTES, MAX_CONNECTIONS = 16 * 1024, 3


@pytest.fixture(scope="module")
def edge(django_db_setup, django_db_blocker, demo_models_root):
    """A server with short deadlines and few connections, run as the Procfile runs it."""
    with django_db_blocker.unblock():
        url = database_url()
    env = {
        "LMSP_MODELS_DIR": str(demo_models_root),
        "LMSP_HTTP_MAX_HEADER_BYTES": str(MAX_HEADER_BYTES),
        "LMSP_HTTP_HEAD_TIMEOUT_SECONDS": "1",
        "LMSP_HTTP_BODY_TIMEOUT_SECONDS": "1",
        "LMSP_HTTP_KEEPALIVE_SECONDS": "1",
        "LMSP_HTTP_MAX_CONNECTIONS": str(MAX_CONNECTIONS),
        "LMSP_STREAM_KEEPALIVE_SECONDS": "1",
    }
    with uvicorn_server(url, env) as base:
        yield urlsplit(base)


@contextmanager
def connection(edge) -> Iterator[socket.socket]:
    sock = socket.create_connection((edge.hostname, edge.port), timeout=10)
    try:
        yield sock
    finally:
        sock.close()


def head(edge, method: str, path: str, *lines: str) -> bytes:
    return "\r\n".join([f"{method} {path} HTTP/1.1", f"Host: {edge.hostname}:{edge.port}", *lines, "", ""]).encode()


def read_answer(sock: socket.socket) -> tuple[int, dict[str, str], bytes]:
    """One HTTP/1.1 answer with a Content-Length, read off a raw socket."""
    raw = b""
    while b"\r\n\r\n" not in raw:
        chunk = sock.recv(65536)
        assert chunk, f"the server closed without an answer (got {raw!r})"
        raw += chunk
    top, _, body = raw.partition(b"\r\n\r\n")
    status_line, *header_lines = top.decode("latin-1").split("\r\n")
    headers = {name.lower(): value.strip() for name, _, value in (line.partition(":") for line in header_lines)}
    while len(body) < int(headers["content-length"]):
        chunk = sock.recv(65536)
        assert chunk, "the server closed in the middle of its answer"
        body += chunk
    return int(status_line.split()[1]), headers, body


def closed_by_server(sock: socket.socket, *, trickle: bytes = b"", deadline: float = 10) -> bool:
    """Whether the server closes ``sock`` before ``deadline``, while the client sends ``trickle`` a byte at a time.

    The deadline only guards against a hang: the server's own timeouts here are 1 s.
    """
    sock.settimeout(0.2)
    end = time.monotonic() + deadline
    sent = 0
    while time.monotonic() < end:
        try:
            if sock.recv(65536) == b"":
                return True
        except TimeoutError:
            pass
        except ConnectionResetError:
            return True
        if sent < len(trickle):
            try:
                sock.sendall(trickle[sent : sent + 1])
            except (BrokenPipeError, ConnectionResetError):
                return True
            sent += 1
    return False


@pytest.mark.parametrize("padding", [MAX_HEADER_BYTES + 100, 1_000_000, 20_000_000])
def test_a_request_head_over_the_limit_is_431(edge, padding):
    with connection(edge) as sock:
        sock.sendall(head(edge, "GET", "/lmsp/v1/capabilities", f"X-Padding: {'a' * padding}"))
        status, headers, body = read_answer(sock)

    assert status == 431
    assert headers["content-type"] == "application/problem+json"
    assert headers["connection"] == "close"
    problem = json.loads(body)
    assert (problem["status"], problem["code"]) == (431, "request_header_too_large")


def test_a_request_head_within_the_limit_is_served_in_pieces(edge):
    request = head(edge, "GET", "/lmsp/v1/capabilities", f"X-Padding: {'a' * (MAX_HEADER_BYTES - 200)}")
    with connection(edge) as sock:
        for start in range(0, len(request), 1000):
            sock.sendall(request[start : start + 1000])
        status, _, body = read_answer(sock)
    assert status == 200
    assert json.loads(body)["object"] == "capabilities"


def test_a_connection_that_never_sends_its_head_is_closed(edge):
    with connection(edge) as sock:
        assert closed_by_server(sock), "an idle new connection stayed open"


def test_a_head_sent_slowly_is_cut_off_after_the_head_timeout(edge):
    with connection(edge) as sock:
        sock.sendall(b"GET /lmsp/v1/capabilities HTTP/1.1\r\n")
        assert closed_by_server(sock, trickle=b"X-Slow: " + b"a" * 500), "a slowloris head stayed open"


def test_a_body_sent_slowly_is_cut_off_after_the_body_timeout(edge, api):
    with connection(edge) as sock:
        lines = (f"Authorization: Bearer {api.token}", "Content-Type: application/json", "Content-Length: 1000")
        sock.sendall(head(edge, "POST", "/lmsp/v1/tasks", *lines) + b"{")
        assert closed_by_server(sock, trickle=b" " * 999), "a slow body stayed open"
    assert not Task.objects.exists()


def test_an_idle_kept_alive_connection_is_closed_after_the_keepalive_timeout(edge):
    with connection(edge) as sock:
        for _ in range(2):  # kept alive between the two
            sock.sendall(head(edge, "GET", "/lmsp/v1/capabilities"))
            assert read_answer(sock)[0] == 200
        # 1 s configured; uvicorn's own default would be 5 s.
        assert closed_by_server(sock, deadline=4), "an idle kept-alive connection stayed open"


def test_connections_beyond_the_limit_get_503(edge, api):
    task = api.create_task("held open").json()
    base = f"http://{edge.hostname}:{edge.port}"
    held = []
    try:
        for _ in range(MAX_CONNECTIONS):
            # A connection of an earlier test may still be closing: retry until it is gone.
            held.append(
                wait_until(
                    lambda: (s := open_stream(base, events_path(task["id"]), token=api.token)).status == 200 and s,
                    what="a stream within the connection limit was refused",
                )
            )
        with connection(edge) as sock:
            sock.sendall(head(edge, "GET", "/lmsp/v1/capabilities"))
            status, headers, body = read_answer(sock)
        assert status == 503
        assert headers["content-type"] == "application/problem+json"
        assert int(headers["retry-after"]) >= 1
        assert json.loads(body)["code"] == "service_unavailable"

        held.pop().close()
        wait_until(
            lambda: request(edge, "GET", "/lmsp/v1/capabilities")[0] == 200,
            what="closing a connection did not make room for another",
        )
    finally:
        for stream in held:
            stream.close()


@pytest.mark.parametrize("method", ["GET", "POST"])
def test_a_stream_outlives_every_request_timeout(edge, api, method):
    base = f"http://{edge.hostname}:{edge.port}"
    if method == "GET":
        task = api.create_task("quiet").json()
        stream = open_stream(base, events_path(task["id"]), token=api.token)
    else:  # a request with a body: its body deadline must end with the body
        body = {"model": "demo", "input": "quiet", "stream": True}
        stream = open_stream(base, "/lmsp/v1/responses", token=api.token, method="POST", body=body)
    with stream:
        assert stream.status == 200
        assert stream.take(1)[0].event == "response.created"
        # Keepalives every second: 3 of them outlast the 1 s head, body and keep-alive timeouts.
        stream.read_comments("keepalive", 3)
        assert not stream.ended
