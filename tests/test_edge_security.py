"""The edges an attacker reaches first: pairing guesses, the signing key, the Host header, cross-origin streams.

Over real sockets where a proxy header, a Host header or a browser's CORS
request would arrive, and with real processes where "every process" or
"after a restart" is the claim.
"""

from __future__ import annotations

import hashlib
import http.client
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit

import pytest
from django.core import signing
from django.test import Client as HttpClient

from tasks_app.edge.throttles import PairThrottle, throttle_reset
from tasks_app.models import Client, PairingCode
from tasks_app.services.clients import pairing_code_create
from tasks_app.services.stream_tokens import SALT
from tests.support.db import database_url
from tests.support.problems import assert_problem
from tests.support.server import REPO, Server, free_port, uvicorn_process
from tests.support.sse import call, open_stream

PAIR = "/lmsp/v1/pair"
# The key settings.py used when LMSP_SECRET_KEY was unset, known to anyone
# who read the source. Split here so that the search below finds no copy.
OLD_PUBLIC_KEY = "lmsp-insecure-local-key-" + "set-LMSP_SECRET_KEY-in-production"
APP_ORIGIN = "https://app.example"
OTHER_ORIGIN = "https://evil.example"
WRONG_CODE = {"code": "0000-0000", "client_name": "phone"}


@pytest.fixture(autouse=True)
def _no_pair_counts() -> Iterator[None]:
    """The pairing counts live in Redis, shared by every process of the run: each test starts from none."""
    throttle_reset(scope="pair")
    yield
    throttle_reset(scope="pair")


@pytest.fixture(scope="module")
def edge_server(django_db_setup, django_db_blocker) -> Iterator[Server]:
    """A web server of this module's, allowing one browser origin to read streams."""
    with django_db_blocker.unblock():
        url = database_url()
    with uvicorn_process(url, {"LMSP_CORS_ORIGINS": APP_ORIGIN}) as server:
        yield server


def pair_limit() -> int:
    allowed, _ = PairThrottle().parse_rate(PairThrottle().get_rate())
    return allowed


def redeem(http: HttpClient, body: dict, forwarded_for: str | None = None):
    headers = {"X-Forwarded-For": forwarded_for} if forwarded_for else {}
    return http.post(PAIR, data=json.dumps(body), content_type="application/json", headers=headers)


def raw_request(base: str, method: str, path: str, headers: dict[str, str] | None = None, body: dict | None = None):
    """One request as sent, Host header included; returns (status, lower-cased headers, body)."""
    parts = urlsplit(base)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=30)
    payload = json.dumps(body).encode() if body is not None else None
    sent = dict(headers or {})
    if payload is not None:
        sent["Content-Type"] = "application/json"
    try:
        conn.request(method, path, body=payload, headers=sent)
        response = conn.getresponse()
        return response.status, {k.lower(): v for k, v in response.getheaders()}, response.read()
    finally:
        conn.close()


# --- pairing: the rate limit and the code lockout -------------------------------------------------------


def test_a_rotating_x_forwarded_for_does_not_buy_more_pairing_attempts(db):
    http = HttpClient()
    for n in range(pair_limit()):
        assert_problem(redeem(http, WRONG_CODE, forwarded_for=f"198.51.100.{n}"), 400, "invalid_request")

    reply = redeem(http, WRONG_CODE, forwarded_for="198.51.100.250")

    assert_problem(reply, 429, "rate_limited")
    assert int(reply["Retry-After"]) >= 1


def test_a_rotating_x_forwarded_for_over_http_does_not_buy_more_attempts(transactional_db, web_server):
    statuses = [
        raw_request(web_server.base, "POST", PAIR, {"X-Forwarded-For": f"198.51.100.{n}"}, WRONG_CODE)[0]
        for n in range(pair_limit() + 1)
    ]

    assert statuses == [400] * pair_limit() + [429]


def test_through_a_trusted_proxy_the_client_is_the_right_most_hop_it_did_not_add(db, settings):
    settings.LMSP_TRUSTED_PROXIES = ["10.0.0.0/8"]
    proxy = HttpClient(REMOTE_ADDR="10.1.2.3")
    # The client wrote the left-most hops itself; the proxies appended "203.0.113.7" and "10.9.9.9".
    for n in range(pair_limit()):
        chain = f"192.0.2.{n}, 203.0.113.7, 10.9.9.9"
        assert_problem(redeem(proxy, WRONG_CODE, forwarded_for=chain), 400, "invalid_request")

    assert_problem(redeem(proxy, WRONG_CODE, forwarded_for="203.0.113.7"), 429, "rate_limited")
    assert_problem(redeem(proxy, WRONG_CODE, forwarded_for="203.0.113.8, 10.9.9.9"), 400, "invalid_request")
    # A peer that is no trusted proxy is its own client, whatever it forwards.
    stranger = HttpClient(REMOTE_ADDR="198.51.100.1")
    assert_problem(redeem(stranger, WRONG_CODE, forwarded_for="203.0.113.8"), 400, "invalid_request")


def test_an_ipv6_client_is_counted_per_64_block(db):
    for n in range(pair_limit()):
        assert_problem(redeem(HttpClient(REMOTE_ADDR=f"2001:db8::{n + 1:x}"), WRONG_CODE), 400, "invalid_request")

    assert_problem(redeem(HttpClient(REMOTE_ADDR="2001:db8::ffff:1"), WRONG_CODE), 429, "rate_limited")
    assert_problem(redeem(HttpClient(REMOTE_ADDR="2001:db8:0:1::1"), WRONG_CODE), 400, "invalid_request")


def test_the_pairing_count_is_shared_by_web_processes_and_survives_a_restart(transactional_db, web_server, edge_server):
    http = HttpClient()  # this process, from 127.0.0.1 as the servers see their test clients
    for _ in range(pair_limit() - 2):
        assert_problem(redeem(http, WRONG_CODE), 400, "invalid_request")
    assert raw_request(web_server.base, "POST", PAIR, body=WRONG_CODE)[0] == 400
    assert raw_request(edge_server.base, "POST", PAIR, body=WRONG_CODE)[0] == 400

    with uvicorn_process(database_url()) as restarted:
        status, headers, body = raw_request(restarted.base, "POST", PAIR, body=WRONG_CODE)

    assert (status, json.loads(body)["code"]) == (429, "rate_limited")
    assert int(headers["retry-after"]) >= 1


def test_without_redis_pairing_is_refused_with_a_problem_not_let_through(db, settings):
    settings.REDIS_URL = f"redis://127.0.0.1:{free_port()}/0"  # nothing listens there
    _, code = pairing_code_create(scopes="read")

    reply = redeem(HttpClient(), {"code": code, "client_name": "phone"})

    body = assert_problem(reply, 503, "service_unavailable")
    assert int(reply["Retry-After"]) >= 1
    assert "rate limit" in body["detail"]
    assert Client.objects.count() == 0


def test_a_pending_code_locks_after_the_allowed_number_of_wrong_codes(db, settings):
    settings.LMSP_PAIRING_MAX_FAILURES = 3
    _, code = pairing_code_create(scopes="read")
    http = HttpClient()
    for n in range(3):
        assert_problem(redeem(http, {"code": f"0000-000{n}", "client_name": "x"}), 400, "invalid_request")

    body = assert_problem(redeem(http, {"code": code, "client_name": "phone"}), 400, "invalid_request")

    assert "locked" in body["detail"]
    assert Client.objects.count() == 0
    assert PairingCode.objects.get().used_at is None
    # Codes made afterwards start with a clean count.
    _, fresh = pairing_code_create(scopes="read")
    assert redeem(http, {"code": fresh, "client_name": "phone"}).status_code == 201


def test_a_right_code_after_fewer_wrong_ones_still_pairs(db, settings):
    settings.LMSP_PAIRING_MAX_FAILURES = 3
    _, code = pairing_code_create(scopes="read")
    http = HttpClient()
    for _ in range(2):
        assert_problem(redeem(http, WRONG_CODE), 400, "invalid_request")

    assert redeem(http, {"code": code, "client_name": "phone"}).status_code == 201
    assert PairingCode.objects.get().failed_attempts == 2


# --- the signing key ----------------------------------------------------------------------------------


def test_the_old_public_signing_key_appears_nowhere(settings):
    tracked = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"],
        cwd=REPO,
        capture_output=True,
        check=True,
    ).stdout.decode()
    holders = [
        name
        for name in tracked.split("\0")
        if name and (REPO / name).is_file() and OLD_PUBLIC_KEY.encode() in (REPO / name).read_bytes()
    ]

    assert holders == []
    assert settings.SECRET_KEY != OLD_PUBLIC_KEY


def test_a_stream_token_signed_with_the_old_public_key_is_refused(api, transactional_db, web_server):
    task = api.create_task("for the browser").json()
    forged = signing.dumps({"t": task["id"], "c": api.client.pk}, key=OLD_PUBLIC_KEY, salt=SALT, compress=False)

    reply = open_stream(web_server.base, f"/lmsp/v1/tasks/{task['id']}/events?token={forged}")

    assert reply.status == 401
    assert json.loads(reply.body)["code"] == "unauthorized"


def _start_settings(data_dir: Path, *extra: str) -> subprocess.Popen:
    """A process that loads the settings, as every start does, and prints a digest of its signing key."""
    env = {k: v for k, v in os.environ.items() if k not in {"LMSP_SECRET_KEY", "DJANGO_SECRET_KEY"}}
    env["LMSP_DATA_DIR"] = str(data_dir)
    script = (
        "import hashlib; from lmsp_project import settings; "
        "print(hashlib.sha256(settings.SECRET_KEY.encode()).hexdigest())"
    )
    return subprocess.Popen(
        [sys.executable, "-c", script], cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def test_first_starts_at_once_agree_on_one_private_key_and_later_starts_reuse_it(tmp_path):
    data_dir = tmp_path / "fresh"
    starts = [_start_settings(data_dir) for _ in range(6)]
    digests = set()
    for start in starts:
        out, err = start.communicate(timeout=60)
        assert start.returncode == 0, err
        digests.add(out.strip())
    key_file = data_dir / "secret-key"

    assert len(digests) == 1
    assert oct(key_file.stat().st_mode & 0o777) == oct(0o600)
    assert sorted(p.name for p in data_dir.iterdir()) == ["secret-key"]  # no temporary file left behind
    again = _start_settings(data_dir)
    assert again.communicate(timeout=60)[0].strip() in digests
    assert hashlib.sha256(OLD_PUBLIC_KEY.encode()).hexdigest() not in digests


def test_a_key_file_others_can_read_stops_the_start(tmp_path):
    data_dir = tmp_path / "data"
    assert _start_settings(data_dir).wait(timeout=60) == 0
    (data_dir / "secret-key").chmod(0o644)

    start = _start_settings(data_dir)
    _, err = start.communicate(timeout=60)

    assert start.returncode != 0
    assert "chmod 600" in err


# --- the Host header ------------------------------------------------------------------------------------


@pytest.mark.parametrize("path", ["/lmsp/v1/capabilities", "/admin/login/", "/lmsp/v1/tasks/task_x/events", "/metrics"])
def test_a_foreign_host_header_is_a_400_problem_on_every_path(web_server, path):
    status, headers, body = raw_request(web_server.base, "GET", path, {"Host": "evil.example"})

    assert status == 400
    assert headers["content-type"].startswith("application/problem+json")
    problem = json.loads(body)
    assert problem["code"] == "invalid_request"
    assert "evil.example" in problem["detail"]


@pytest.mark.parametrize("host", ["127.0.0.1", "localhost", "[::1]"])
def test_the_loopback_names_are_answered(web_server, host):
    port = urlsplit(web_server.base).port

    assert raw_request(web_server.base, "GET", "/lmsp/v1/capabilities", {"Host": f"{host}:{port}"})[0] == 200


def _allowed_hosts(**env: str) -> list[str]:
    base = {k: v for k, v in os.environ.items() if k not in {"LMSP_HOST", "LMSP_ALLOWED_HOSTS"}}
    script = "import json; from lmsp_project import settings; print(json.dumps(settings.ALLOWED_HOSTS))"
    done = subprocess.run(
        [sys.executable, "-c", script], cwd=REPO, env={**base, **env}, capture_output=True, text=True, check=True
    )
    return json.loads(done.stdout)


def test_allowed_hosts_default_to_the_bound_host_and_loopback_and_can_be_set():
    assert _allowed_hosts() == ["127.0.0.1", "localhost", "[::1]"]
    assert _allowed_hosts(LMSP_HOST="192.0.2.10") == ["192.0.2.10", "localhost", "127.0.0.1", "[::1]"]
    assert _allowed_hosts(LMSP_HOST="0.0.0.0") == ["localhost", "127.0.0.1", "[::1]"]
    assert _allowed_hosts(LMSP_ALLOWED_HOSTS="lmsp.example, .internal") == ["lmsp.example", ".internal"]


# --- CORS on the read-only streams ----------------------------------------------------------------------


@pytest.fixture
def finished_task(api, transactional_db) -> dict:
    task = api.create_task("for another origin").json()
    api.post(f"/lmsp/v1/tasks/{task['id']}/cancel")
    return task


def _stream_token(base: str, token: str, task_id: str) -> str:
    status, minted = call(base, "POST", f"/lmsp/v1/tasks/{task_id}/stream_token", token=token)
    assert status == 201, minted
    return minted["token"]


def _preflight(base: str, path: str, origin: str) -> tuple[int, dict[str, str]]:
    asked = {
        "Origin": origin,
        "Access-Control-Request-Method": "GET",
        "Access-Control-Request-Headers": "last-event-id",
    }
    status, headers, _ = raw_request(base, "OPTIONS", path, asked)
    return status, headers


def test_an_allowed_origin_reads_a_stream_with_a_stream_token(api, finished_task, edge_server):
    token = _stream_token(edge_server.base, api.token, finished_task["id"])
    events = f"/lmsp/v1/tasks/{finished_task['id']}/events?token={token}"

    status, preflight = _preflight(edge_server.base, events, APP_ORIGIN)
    with open_stream(edge_server.base, events, headers={"Origin": APP_ORIGIN}) as stream:
        names = [event.event for event in stream.all()]

    assert status == 204
    assert preflight["access-control-allow-origin"] == APP_ORIGIN
    assert "GET" in preflight["access-control-allow-methods"]
    assert "last-event-id" in preflight["access-control-allow-headers"].lower()
    assert int(preflight["access-control-max-age"]) > 0
    assert "access-control-allow-credentials" not in preflight
    assert stream.status == 200
    assert stream.headers["access-control-allow-origin"] == APP_ORIGIN
    assert "Origin" in stream.headers["vary"]
    assert names == ["response.created", "response.cancelled"]


def test_a_response_stream_takes_part_and_resumes_with_last_event_id(api, finished_task, edge_server):
    token = _stream_token(edge_server.base, api.token, finished_task["id"])
    path = f"/lmsp/v1/responses/{finished_task['response_id']}?stream=true&token={token}"

    assert _preflight(edge_server.base, path, APP_ORIGIN)[0] == 204
    with open_stream(edge_server.base, path, headers={"Origin": APP_ORIGIN, "Last-Event-ID": "0"}) as stream:
        assert stream.headers["access-control-allow-origin"] == APP_ORIGIN
        assert [event.event for event in stream.all()] == ["response.cancelled"]


def test_another_origin_gets_no_cors_headers(api, finished_task, edge_server):
    token = _stream_token(edge_server.base, api.token, finished_task["id"])
    events = f"/lmsp/v1/tasks/{finished_task['id']}/events?token={token}"

    status, preflight = _preflight(edge_server.base, events, OTHER_ORIGIN)
    with open_stream(edge_server.base, events, headers={"Origin": OTHER_ORIGIN}) as stream:
        got = stream.headers

    assert status == 405
    assert not any(name.startswith("access-control-") for name in [*preflight, *got])


def test_other_endpoints_stay_without_cors_for_an_allowed_origin(api, finished_task, edge_server):
    task_path = f"/lmsp/v1/tasks/{finished_task['id']}"
    bearer = {"Origin": APP_ORIGIN, "Authorization": f"Bearer {api.token}"}

    for path in (task_path, "/lmsp/v1/capabilities", f"{task_path}/stream_token"):
        status, preflight = _preflight(edge_server.base, path, APP_ORIGIN)
        assert status == 405, path
        assert not any(name.startswith("access-control-") for name in preflight), path
    _, headers, _ = raw_request(edge_server.base, "GET", task_path, bearer)
    assert not any(name.startswith("access-control-") for name in headers)
    # The JSON form of a response is not a stream: no CORS either.
    detail = f"/lmsp/v1/responses/{finished_task['response_id']}"
    _, headers, _ = raw_request(edge_server.base, "GET", detail, bearer)
    assert not any(name.startswith("access-control-") for name in headers)


def test_without_configured_origins_a_stream_has_no_cors(api, finished_task, web_server):
    token = _stream_token(web_server.base, api.token, finished_task["id"])
    events = f"/lmsp/v1/tasks/{finished_task['id']}/events?token={token}"

    status, preflight = _preflight(web_server.base, events, APP_ORIGIN)

    assert status == 405
    assert "access-control-allow-origin" not in preflight
