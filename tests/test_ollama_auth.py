"""Tokens and scopes on Ollama's native API (PROFILE.md 1 and 11.2, docs/ollama.md).

The same client tokens as everywhere, as a bearer; every refusal in Ollama's
error shape (``{"error": "..."}`` as ``application/json``), with the status
saying which (401, 403), and nothing queued. Through the live server with
``LMSP_OLLAMA_ANONYMOUS`` empty (the default); the anonymous rule (a
header-less request from a loopback address acts as the named client) is
driven in-process, where a request's address can be set.
"""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
from django.test import Client as HttpClient
from django.test import override_settings

from tasks_app.models import Task
from tasks_app.services.clients import client_revoke

# A client's protocol over the engine, whose writes the lifecycle's, recovery's and the adapters' own tests
# test on both databases: the SQLite pass only (pyproject.toml, the sqlite_pass marker).
pytestmark = pytest.mark.sqlite_pass

HELLO = [{"role": "user", "content": "Hello"}]
# Each route with a body that would pass (an unknown model: past authentication and scopes, nothing is queued).
ROUTES: dict[tuple[str, str], dict[str, Any] | None] = {
    ("GET", "/api/tags"): None,
    ("GET", "/api/ps"): None,
    ("POST", "/api/show"): {"model": "demo"},
    ("POST", "/api/chat"): {"model": "nope", "messages": HELLO, "stream": False},
    ("POST", "/api/generate"): {"model": "nope", "prompt": "Hello", "stream": False},
    ("POST", "/api/pull"): {"model": "llama3.2", "stream": False},
}
GENERATIONS = [("POST", "/api/chat"), ("POST", "/api/generate")]
PULL = ("POST", "/api/pull")
# What each route answers once the token passes: the catalog's 200, an unknown model's 404, a library name's 400.
PASSED = {
    ("GET", "/api/tags"): 200,
    ("GET", "/api/ps"): 200,
    ("POST", "/api/show"): 200,
    ("POST", "/api/chat"): 404,
    ("POST", "/api/generate"): 404,
    ("POST", "/api/pull"): 400,
}
ids = [f"{method} {path}" for method, path in ROUTES]


@pytest.fixture
def call(transactional_db, demo_model, web_server):
    def send(route: tuple[str, str], headers: dict[str, str] | None = None, query: str = "") -> httpx.Response:
        method, path = route
        url = f"{web_server.base}{path}{query}"
        return httpx.request(method, url, json=ROUTES.get(route), headers=headers or {}, timeout=60)

    return send


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def assert_ollama_error(reply: Any, status: int) -> str:
    """Ollama's shape exactly (not a problem+json): the status, one ``error`` string; the string."""
    assert reply.status_code == status, reply.content
    assert reply.headers["Content-Type"] == "application/json", reply.headers
    body = reply.json()
    assert set(body) == {"error"} and isinstance(body["error"], str) and body["error"], body
    return body["error"]


def assert_unauthorized(reply: Any) -> None:
    assert assert_ollama_error(reply, 401).startswith("unauthorized: ")
    assert reply.headers["WWW-Authenticate"].startswith("Bearer"), reply.headers


@pytest.fixture
def nothing_queued(transactional_db):
    before = Task.objects.count()
    yield
    assert Task.objects.count() == before


def test_the_version_is_public(call, nothing_queued):
    for headers in ({}, bearer("not-a-token")):
        # Public, as Ollama's: a version says nothing about the models or tasks; a bad header is not read.
        reply = call(("GET", "/api/version"), headers)
        assert reply.status_code == 200 and set(reply.json()) == {"version"}, reply.text


@pytest.mark.parametrize("route", ROUTES, ids=ids)
def test_no_token_is_401(call, nothing_queued, route):
    assert_unauthorized(call(route))


@pytest.mark.parametrize("route", ROUTES, ids=ids)
@pytest.mark.parametrize("header", ["Basic abc", "Bearer", "Token abc", "Bearer a b", "bearer"])
def test_a_malformed_authorization_header_is_401(call, nothing_queued, route, header):
    assert_unauthorized(call(route, {"Authorization": header}))


@pytest.mark.parametrize("route", ROUTES, ids=ids)
def test_a_wrong_token_is_401(call, make_client, nothing_queued, route):
    _, token = make_client("alice", scopes="admin")
    for wrong in (token + "x", "not-a-token", "lmsp_" + "B" * 43):
        assert_unauthorized(call(route, bearer(wrong)))


@pytest.mark.parametrize("route", ROUTES, ids=ids)
def test_a_revoked_token_is_401(call, make_client, nothing_queued, route):
    _, token = make_client("alice", scopes="admin")
    assert call(("GET", "/api/tags"), bearer(token)).status_code == 200
    assert client_revoke(name="alice") is not None

    assert_unauthorized(call(route, bearer(token)))


@pytest.mark.parametrize("route", ROUTES, ids=ids)
@pytest.mark.parametrize("param", ["token", "access_token", "api_key", "key"])
def test_a_token_in_the_query_string_is_not_accepted(call, make_client, nothing_queued, route, param):
    _, token = make_client("alice", scopes="admin")
    assert_unauthorized(call(route, query=f"?{param}={token}"))


@pytest.mark.parametrize("route", [*GENERATIONS, PULL], ids=lambda route: " ".join(route))
def test_the_read_scope_is_403_on_generations_and_pull(call, make_client, nothing_queued, route):
    _, token = make_client("reader", scopes="read")
    assert assert_ollama_error(call(route, bearer(token)), 403).startswith("insufficient_scope: ")


@pytest.mark.parametrize("scopes", ["responses", "read,responses"])
def test_pull_needs_admin(call, make_client, nothing_queued, scopes):
    _, token = make_client("writer", scopes=scopes)
    assert assert_ollama_error(call(PULL, bearer(token)), 403).startswith("insufficient_scope: ")


@pytest.mark.parametrize("route", ROUTES, ids=ids)
def test_a_valid_token_passes(call, make_client, nothing_queued, route):
    """The positive control of the refusals above: each route reads the request once the token passes."""
    _, token = make_client("alice", scopes="read,responses" if route != PULL else "admin")
    reply = call(route, bearer(token))
    assert reply.status_code == PASSED[route], reply.text
    if PASSED[route] == 404:
        assert reply.json() == {"error": "model 'nope' not found"}


# --------------------------------------------------------------------------- LMSP_OLLAMA_ANONYMOUS


def local(route: tuple[str, str], *, address: str = "127.0.0.1", headers: dict[str, str] | None = None) -> Any:
    """``route`` through the app in-process, as a request from ``address``."""
    method, path = route
    body = ROUTES.get(route)
    return HttpClient(REMOTE_ADDR=address).generic(
        method, path, "" if body is None else json.dumps(body), content_type="application/json", headers=headers
    )


@pytest.fixture
def anonymous(transactional_db, demo_model, make_client):
    """Header-less local requests act as ``anon`` (read only)."""
    make_client("anon", scopes="read")
    with override_settings(LMSP_OLLAMA_ANONYMOUS="anon"):
        yield


@pytest.mark.parametrize("address", ["127.0.0.1", "127.8.9.10", "::1", "::ffff:127.0.0.1"])
def test_a_header_less_local_request_acts_as_the_named_client(anonymous, nothing_queued, address):
    assert local(("GET", "/api/tags"), address=address).status_code == 200
    assert local(("POST", "/api/show"), address=address).status_code == 200
    # Its scopes, no more: anon reads, it does not generate or pull.
    for route in [*GENERATIONS, PULL]:
        assert assert_ollama_error(local(route, address=address), 403).startswith("insufficient_scope: ")


def test_the_named_clients_scopes_are_what_it_may_do(transactional_db, demo_model, make_client, nothing_queued):
    make_client("anon", scopes="read,responses")
    with override_settings(LMSP_OLLAMA_ANONYMOUS="anon"):
        for route in GENERATIONS:
            assert local(route).json() == {"error": "model 'nope' not found"}  # past the scopes
        assert assert_ollama_error(local(PULL), 403).startswith("insufficient_scope: ")


@pytest.mark.parametrize("address", ["192.0.2.7", "10.0.0.1", "2001:db8::1", "::ffff:192.0.2.7"])
@pytest.mark.parametrize("route", ROUTES, ids=ids)
def test_a_header_less_request_from_elsewhere_needs_a_token(anonymous, nothing_queued, address, route):
    assert_unauthorized(local(route, address=address))


@pytest.mark.parametrize("route", ROUTES, ids=ids)
@pytest.mark.parametrize("header", ["Bearer wrong", "Basic abc", "Bearer"])
def test_a_bad_header_is_401_whatever_the_setting_says(anonymous, nothing_queued, route, header):
    assert_unauthorized(local(route, headers={"Authorization": header}))


def test_a_revoked_token_is_401_from_loopback_too(anonymous, make_client, nothing_queued):
    _, token = make_client("alice", scopes="read")
    assert local(("GET", "/api/tags"), headers=bearer(token)).status_code == 200
    assert client_revoke(name="alice") is not None
    assert_unauthorized(local(("GET", "/api/tags"), headers=bearer(token)))


def test_a_named_client_that_is_not_there_is_said(transactional_db, nothing_queued):
    with override_settings(LMSP_OLLAMA_ANONYMOUS="ghost"):
        reply = local(("GET", "/api/tags"))
    assert_unauthorized(reply)
    assert "ghost" in reply.json()["error"]
