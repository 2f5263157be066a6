"""The API behind a real HTTP server (uvicorn), where the test client cannot reach."""

from __future__ import annotations

import http.client
import json
from urllib.parse import urlsplit

import pytest

from tasks_app.models import Task, TaskEvent
from tests.support.db import database_url
from tests.support.server import uvicorn_server

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]


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
