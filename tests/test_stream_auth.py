"""Browsers' ways into an event stream: a stream token in the URL, or a staff session."""

from __future__ import annotations

import json
import time
from unittest import mock

import pytest
from django.contrib.auth import get_user_model
from django.core import signing
from django.test import Client as DjangoClient

from tasks_app.services.clients import client_revoke
from tasks_app.services.stream_tokens import stream_token_mint
from tests.support.sse import call, open_stream


def events_path(task_id: str) -> str:
    return f"/lmsp/v1/tasks/{task_id}/events"


@pytest.fixture
def finished_task(api, transactional_db) -> dict:
    # Queued then cancelled: a two-event log, no worker needed.
    task = api.create_task("for the browser").json()
    api.post(f"/lmsp/v1/tasks/{task['id']}/cancel")
    return task


def mint(base: str, token: str, task_id: str) -> tuple[int, dict]:
    return call(base, "POST", f"/lmsp/v1/tasks/{task_id}/stream_token", token=token)


def test_a_minted_stream_token_reads_that_tasks_events_without_a_header(api, finished_task, web_server):
    status, minted = mint(web_server.base, api.token, finished_task["id"])

    assert status == 201
    assert minted["object"] == "stream_token"
    assert minted["task_id"] == finished_task["id"]
    # The expiry is the token's own signing time plus the configured lifetime.
    signed_at = signing.b62_decode(minted["token"].split(":")[-2])
    assert minted["expires_at"] == signed_at + 300
    assert api.token not in minted["events_url"]
    with open_stream(web_server.base, minted["events_url"]) as stream:
        assert [e.event for e in stream.all()] == ["response.created", "response.cancelled"]
    response_path = f"/lmsp/v1/responses/{finished_task['response_id']}?stream=true&token={minted['token']}"
    with open_stream(web_server.base, response_path) as by_response:
        assert by_response.status == 200


def test_a_stream_token_grants_nothing_else(api, finished_task, web_server):
    other = api.create_task("another").json()
    _, minted = mint(web_server.base, api.token, finished_task["id"])
    token = minted["token"]

    other_task = open_stream(web_server.base, f"{events_path(other['id'])}?token={token}")
    as_bearer = call(web_server.base, "GET", f"/lmsp/v1/tasks/{finished_task['id']}", token=token)
    tampered = open_stream(web_server.base, f"{events_path(finished_task['id'])}?token={token[:-2]}xx")

    assert (other_task.status, json.loads(other_task.body)["code"]) == (404, "task_not_found")
    assert as_bearer[0] == 401
    assert (tampered.status, json.loads(tampered.body)["code"]) == (401, "unauthorized")


def test_an_expired_stream_token_is_refused(api, finished_task, web_server):
    with mock.patch("django.core.signing.time.time", return_value=time.time() - 301):
        old = stream_token_mint(client=api.client, task=_task(finished_task))

    reply = open_stream(web_server.base, f"{events_path(finished_task['id'])}?token={old.token}")

    assert reply.status == 401
    assert "expired" in json.loads(reply.body)["detail"]


def test_revoking_the_client_ends_its_stream_tokens(api, finished_task, web_server):
    _, minted = mint(web_server.base, api.token, finished_task["id"])
    client_revoke(name=api.client.name)

    assert open_stream(web_server.base, minted["events_url"]).status == 401


def test_minting_needs_read_scope_and_a_visible_task(api, other_api, make_client, finished_task, web_server):
    _, writer = make_client("writer", scopes="responses")

    assert mint(web_server.base, writer, finished_task["id"])[0] == 403
    assert mint(web_server.base, other_api.token, finished_task["id"])[0] == 404
    assert mint(web_server.base, "", finished_task["id"])[0] == 401


@pytest.mark.parametrize("param", ["access_token", "api_key", "bearer"])
def test_a_bearer_token_in_the_url_is_not_accepted(api, finished_task, web_server, param):
    reply = open_stream(web_server.base, f"{events_path(finished_task['id'])}?{param}={api.token}")

    assert reply.status == 401


def _session_cookie(user) -> str:
    browser = DjangoClient()
    browser.force_login(user)
    return browser.cookies["sessionid"].value


def test_a_staff_session_reads_any_tasks_events_and_other_sessions_do_not(api, finished_task, web_server):
    users = get_user_model().objects
    staff = users.create_user("operator", password="x", is_staff=True)
    plain = users.create_user("visitor", password="x")
    retired = users.create_user("retired", password="x", is_staff=True, is_active=False)

    with open_stream(
        web_server.base, events_path(finished_task["id"]), headers={"Cookie": f"sessionid={_session_cookie(staff)}"}
    ) as stream:
        assert [e.event for e in stream.all()] == ["response.created", "response.cancelled"]
    for user in (plain, retired):
        reply = open_stream(
            web_server.base, events_path(finished_task["id"]), headers={"Cookie": f"sessionid={_session_cookie(user)}"}
        )
        assert reply.status == 401, user.username
    # A session is for streams only: the rest of the API still needs a bearer token.
    cookie = {"Cookie": f"sessionid={_session_cookie(staff)}"}
    assert open_stream(web_server.base, f"/lmsp/v1/tasks/{finished_task['id']}", headers=cookie).status == 401


def _task(body: dict):
    from tasks_app.models import Task

    return Task.objects.get(pk=body["id"])
