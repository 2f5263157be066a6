"""Tokens and scopes on Anthropic's Messages routes (PROFILE.md 1 and 11.1), through the live server.

The same client tokens as everywhere, sent as a bearer or as ``x-api-key``
(what ``ANTHROPIC_API_KEY`` sends); every refusal in Anthropic's error shape
(``{"type": "error", "error": {"type", "message"}}`` as ``application/json``),
the status saying which (401 ``authentication_error``, 403
``permission_error``), and nothing queued.
"""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from tasks_app.models import Task
from tasks_app.services.clients import client_revoke

# A client's protocol over the engine, whose writes the lifecycle's, recovery's and the adapters' own tests
# test on both databases: the SQLite pass only (pyproject.toml, the sqlite_pass marker).
pytestmark = pytest.mark.sqlite_pass

MESSAGES = "/lmsp/v1/messages"
COUNT_TOKENS = "/lmsp/v1/messages/count_tokens"
HELLO = [{"role": "user", "content": "Hello"}]
BODIES: dict[str, dict[str, Any]] = {
    MESSAGES: {"model": "demo", "max_tokens": 2, "messages": HELLO},
    COUNT_TOKENS: {"model": "demo", "messages": HELLO},
}
ROUTES = list(BODIES)
# Where a token may come from: the two headers Anthropic's clients send.
SENDERS = {
    "bearer": lambda token: {"Authorization": f"Bearer {token}"},
    "x-api-key": lambda token: {"x-api-key": token},
}


@pytest.fixture
def post(transactional_db, demo_model, web_server):
    def send(path: str, headers: dict[str, str] | None = None, body: Any = None, query: str = "") -> httpx.Response:
        sent = BODIES[path] if body is None else body
        return httpx.post(f"{web_server.base}{path}{query}", json=sent, headers=headers or {}, timeout=60)

    return send


def assert_anthropic_error(reply: httpx.Response, status: int, error_type: str) -> str:
    """Anthropic's shape exactly (not a problem+json): the status, the type, a message; the message."""
    assert reply.status_code == status, reply.text
    assert reply.headers["Content-Type"] == "application/json", reply.headers
    body = reply.json()
    assert set(body) == {"type", "error"} and body["type"] == "error", body
    assert set(body["error"]) == {"type", "message"}, body
    assert body["error"]["type"] == error_type, body
    assert isinstance(body["error"]["message"], str) and body["error"]["message"], body
    return body["error"]["message"]


def assert_unauthorized(reply: httpx.Response) -> None:
    assert_anthropic_error(reply, 401, "authentication_error")
    assert reply.headers["WWW-Authenticate"].startswith("Bearer"), reply.headers


@pytest.fixture
def nothing_queued(transactional_db):
    before = Task.objects.count()
    yield
    assert Task.objects.count() == before


@pytest.mark.parametrize("path", ROUTES)
def test_no_token_is_401(post, nothing_queued, path):
    assert_unauthorized(post(path))


@pytest.mark.parametrize("path", ROUTES)
@pytest.mark.parametrize("header", ["Basic abc", "Bearer", "Token abc", "Bearer a b", "x-api-key abc"])
def test_a_malformed_authorization_header_is_401(post, nothing_queued, path, header):
    assert_unauthorized(post(path, {"Authorization": header}))


@pytest.mark.parametrize("path", ROUTES)
@pytest.mark.parametrize("sender", SENDERS)
def test_a_wrong_token_is_401(post, make_client, nothing_queued, path, sender):
    _, token = make_client("alice")
    for wrong in (token + "x", "not-a-token", "lmsp_" + "B" * 43):
        assert_unauthorized(post(path, SENDERS[sender](wrong)))


@pytest.mark.parametrize("path", ROUTES)
@pytest.mark.parametrize("sender", SENDERS)
def test_a_revoked_token_is_401(post, make_client, path, sender):
    _, token = make_client("alice")
    assert post(COUNT_TOKENS, SENDERS[sender](token)).status_code == 200
    assert client_revoke(name="alice") is not None
    before = Task.objects.count()

    assert_unauthorized(post(path, SENDERS[sender](token)))
    assert Task.objects.count() == before


@pytest.mark.parametrize("path", ROUTES)
@pytest.mark.parametrize("sender", SENDERS)
def test_the_read_scope_is_403_permission_error(post, make_client, nothing_queued, path, sender):
    _, token = make_client("reader", scopes="read")
    assert_anthropic_error(post(path, SENDERS[sender](token)), 403, "permission_error")


@pytest.mark.parametrize("sender", SENDERS)
def test_a_valid_token_passes(post, make_client, nothing_queued, sender):
    """The positive control of the refusals above (nothing queued: the message names no model)."""
    _, token = make_client("alice", scopes="responses")
    counted = post(COUNT_TOKENS, SENDERS[sender](token))
    assert counted.status_code == 200, counted.text
    assert counted.json()["input_tokens"] > 0
    # Past authentication and scopes, the request itself is read: an unknown model, named.
    message = assert_anthropic_error(
        post(MESSAGES, SENDERS[sender](token), body={**BODIES[MESSAGES], "model": "nope"}),
        400,
        "invalid_request_error",
    )
    assert "nope" in message


@pytest.mark.parametrize("path", ROUTES)
@pytest.mark.parametrize("param", ["token", "access_token", "api_key", "key", "x-api-key"])
def test_a_token_in_the_query_string_is_not_accepted(post, make_client, nothing_queued, path, param):
    _, token = make_client("alice")
    assert_unauthorized(post(path, query=f"?{param}={token}"))


@pytest.mark.parametrize("path", ROUTES)
def test_a_wrong_bearer_is_not_overruled_by_a_good_api_key(post, make_client, nothing_queued, path):
    _, token = make_client("alice")
    assert_unauthorized(post(path, {"Authorization": f"Bearer {token}x", "x-api-key": token}))
