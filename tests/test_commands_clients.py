"""lmsp_client and lmsp_pair, and trading a pairing code for a token over HTTP."""

from __future__ import annotations

import io
import json
import re
import threading
from datetime import timedelta

import pytest
from django.core.management import call_command
from django.core.management.base import CommandError
from django.db import connection
from django.test import Client as HttpClient
from django.utils import timezone

from tasks_app.edge.throttles import throttle_reset
from tasks_app.models import Client, PairingCode, Task
from tasks_app.services.clients import client_local_token_ensure, token_digest
from tests.support.api import ApiClient
from tests.support.problems import assert_problem

PAIR = "/lmsp/v1/pair"
CODE_RE = re.compile(r"^[0-9A-HJKMNP-TV-Z]{4}-[0-9A-HJKMNP-TV-Z]{4}$")


@pytest.fixture(autouse=True)
def _no_pair_throttle_history():
    """POST /pair is throttled per address, counted in Redis; each test starts with a clean count."""
    throttle_reset(scope="pair")
    yield
    throttle_reset(scope="pair")


def run(*args: str) -> tuple[str, str]:
    out, err = io.StringIO(), io.StringIO()
    call_command(*args, stdout=out, stderr=err)
    return out.getvalue(), err.getvalue()


def create(name: str, scopes: str = "responses,read") -> str:
    out, _ = run("lmsp_client", "create", name, "--scopes", scopes)
    lines = out.splitlines()
    assert len(lines) == 1, out
    return lines[0]


def pair_code(*extra: str) -> str:
    out, _ = run("lmsp_pair", *extra)
    lines = out.splitlines()
    assert len(lines) == 1, out
    return lines[0]


def redeem(code: str, client_name: str = "phone", http: HttpClient | None = None):
    http = http or HttpClient()
    return http.post(PAIR, data=json.dumps({"code": code, "client_name": client_name}), content_type="application/json")


# --- lmsp_client ------------------------------------------------------------------------------------


def test_create_prints_only_the_token(db):
    out, err = run("lmsp_client", "create", "laptop", "--scopes", "responses,read")
    assert out.endswith("\n") and out.count("\n") == 1
    token = out.strip()
    assert token.startswith("lmsp_") and len(token) > 30
    assert token not in err
    client = Client.objects.get(name="laptop")
    assert client.scopes == ["responses", "read"]
    assert client.token_hash == token_digest(token)
    assert client.revoked_at is None


def test_created_token_works_over_http(db, demo_model):
    token = create("laptop", "responses,read")
    api = ApiClient(token)
    assert api.get("/lmsp/v1/tasks").status_code == 200
    reply = api.create_task()
    assert reply.status_code == 202, reply.content
    assert Task.objects.get(pk=reply.json()["id"]).client.name == "laptop"
    assert Client.objects.get(name="laptop").last_used_at is not None


def test_create_scopes_are_enforced(db, demo_model):
    token = create("viewer", "read")
    api = ApiClient(token)
    assert api.get("/lmsp/v1/models").status_code == 200
    assert_problem(api.create_task(), 403, "insufficient_scope")
    assert Task.objects.count() == 0


def test_create_default_scopes(db):
    out, _ = run("lmsp_client", "create", "default")
    assert out.count("\n") == 1
    assert Client.objects.get(name="default").scopes == ["responses", "read"]


def test_create_duplicate_name_fails(db):
    first = create("laptop")
    with pytest.raises(CommandError):
        run("lmsp_client", "create", "laptop")
    assert Client.objects.filter(name="laptop").count() == 1
    assert Client.objects.get(name="laptop").token_hash == token_digest(first)


@pytest.mark.parametrize("scopes", ["root", "read,write", "", ",", "READ"])
def test_create_unknown_or_empty_scope_fails(db, scopes):
    with pytest.raises(CommandError):
        run("lmsp_client", "create", "laptop", "--scopes", scopes)
    assert not Client.objects.filter(name="laptop").exists()


def test_create_too_long_name_fails(db):
    with pytest.raises(CommandError):
        run("lmsp_client", "create", "n" * 101)
    assert Client.objects.count() == 0
    create("n" * 100)
    assert Client.objects.filter(name="n" * 100).exists()


def test_create_blank_name_fails(db):
    with pytest.raises(CommandError):
        run("lmsp_client", "create", "   ")
    assert Client.objects.count() == 0


def test_list_shows_clients_and_scopes(db):
    create("laptop", "responses,read")
    create("ops", "admin")
    out, _ = run("lmsp_client", "list")
    lines = out.splitlines()
    assert len(lines) == 2
    laptop = next(line for line in lines if line.startswith("laptop\t"))
    ops = next(line for line in lines if line.startswith("ops\t"))
    assert laptop.split("\t")[1] == "responses,read"
    assert ops.split("\t")[1] == "admin"
    assert "active" in laptop and "never" in laptop
    assert "lmsp_" not in out


def test_list_marks_revoked_clients(db):
    create("laptop")
    run("lmsp_client", "revoke", "laptop")
    out, _ = run("lmsp_client", "list")
    assert out.startswith("laptop\t")
    assert "revoked" in out


def test_revoke_makes_the_token_fail(db):
    token = create("laptop", "read")
    api = ApiClient(token)
    assert api.get("/lmsp/v1/tasks").status_code == 200
    out, _ = run("lmsp_client", "revoke", "laptop")
    assert out == ""
    assert Client.objects.get(name="laptop").revoked_at is not None
    reply = api.get("/lmsp/v1/tasks")
    assert_problem(reply, 401, "unauthorized")
    assert reply["WWW-Authenticate"].startswith("Bearer")


def test_revoke_unknown_or_twice_fails(db):
    with pytest.raises(CommandError):
        run("lmsp_client", "revoke", "nobody")
    create("laptop")
    run("lmsp_client", "revoke", "laptop")
    with pytest.raises(CommandError):
        run("lmsp_client", "revoke", "laptop")


def test_revoked_name_can_be_reused_with_a_new_token(db):
    old = create("laptop")
    run("lmsp_client", "revoke", "laptop")
    new = create("laptop")
    assert new != old
    assert ApiClient(new).get("/lmsp/v1/tasks").status_code == 200
    assert_problem(ApiClient(old).get("/lmsp/v1/tasks"), 401, "unauthorized")


def test_revoke_leaves_other_clients_alone(db):
    keep = create("keep")
    create("drop")
    run("lmsp_client", "revoke", "drop")
    assert ApiClient(keep).get("/lmsp/v1/tasks").status_code == 200


# --- lmsp_pair and POST /pair ----------------------------------------------------------------------


def test_pair_prints_a_code(db):
    out, _ = run("lmsp_pair", "--scopes", "read")
    code = out.strip()
    assert out == code + "\n"
    assert CODE_RE.match(code), code
    pairing = PairingCode.objects.get()
    assert pairing.scopes == ["read"]
    assert pairing.used_at is None and pairing.client is None
    # Only the hash is stored.
    assert pairing.code_hash == token_digest(code.replace("-", ""))
    assert code not in json.dumps(list(PairingCode.objects.values()), default=str)
    assert code.replace("-", "") not in json.dumps(list(PairingCode.objects.values()), default=str)
    # Expires ten minutes after it was made, by default.
    lifetime = (pairing.expires_at - pairing.created_at).total_seconds()
    assert 590 < lifetime <= 600


def test_pair_unknown_scope_fails(db):
    with pytest.raises(CommandError):
        run("lmsp_pair", "--scopes", "root")
    assert PairingCode.objects.count() == 0


def test_pair_redeem_gives_a_read_only_token(db, demo_model):
    code = pair_code("--scopes", "read")
    reply = redeem(code, "phone")
    assert reply.status_code == 201, reply.content
    body = reply.json()
    assert body["name"] == "phone"
    assert body["scopes"] == ["read"]
    token = body["token"]
    assert token.startswith("lmsp_")

    client = Client.objects.get(name="phone")
    assert client.scopes == ["read"]
    assert client.token_hash == token_digest(token)
    stored = json.dumps([list(Client.objects.values()), list(PairingCode.objects.values())], default=str)
    assert token not in stored
    pairing = PairingCode.objects.get()
    assert pairing.used_at is not None
    assert pairing.client_id == client.pk

    api = ApiClient(token)
    assert api.get("/lmsp/v1/tasks").status_code == 200
    assert api.get("/lmsp/v1/models").status_code == 200
    assert_problem(api.create_task(), 403, "insufficient_scope")
    assert Task.objects.count() == 0


def test_pair_needs_no_token_and_ignores_a_bad_one(db):
    code = pair_code("--scopes", "read")
    http = HttpClient(headers={"Authorization": "Bearer not-a-token"})
    assert redeem(code, "phone", http).status_code == 201


def test_pair_code_is_single_use(db):
    code = pair_code("--scopes", "read")
    assert redeem(code, "phone").status_code == 201
    body = assert_problem(redeem(code, "tablet"), 400, "invalid_request")
    assert "code" in {e["field"] for e in body["errors"]}
    assert not Client.objects.filter(name="tablet").exists()
    assert Client.objects.filter(name="phone").count() == 1


def test_expired_code_with_ttl_zero_is_refused(db):
    code = pair_code("--scopes", "read", "--ttl", "0")
    assert_problem(redeem(code), 400, "invalid_request")
    assert not Client.objects.filter(name="phone").exists()
    assert PairingCode.objects.get().used_at is None


def test_expired_code_is_refused(db):
    code = pair_code("--scopes", "read")
    PairingCode.objects.update(expires_at=timezone.now() - timedelta(seconds=1))
    assert_problem(redeem(code), 400, "invalid_request")
    assert not Client.objects.filter(name="phone").exists()


@pytest.mark.parametrize("transform", [str.lower, lambda c: c.replace("-", "").lower(), lambda c: f" {c} "])
def test_code_is_forgiving_about_case_dash_and_spaces(db, transform):
    code = pair_code("--scopes", "read")
    reply = redeem(transform(code))
    assert reply.status_code == 201, reply.content
    assert Client.objects.filter(name="phone").exists()


@pytest.mark.parametrize("code", ["0000-0000", "", "not a code", "X" * 32])
def test_unknown_code_is_refused(db, code):
    pair_code("--scopes", "read")
    assert_problem(redeem(code), 400, "invalid_request")
    assert Client.objects.count() == 0
    assert PairingCode.objects.get().used_at is None


@pytest.mark.parametrize(
    "body",
    [
        {},
        {"code": "ABCD-EFGH"},
        {"client_name": "phone"},
        {"code": 1234, "client_name": "phone"},
        {"code": "ABCD-EFGH", "client_name": "phone", "scopes": "admin"},
    ],
    ids=["empty", "no-name", "no-code", "code-number", "extra-field"],
)
def test_pair_bad_body(db, body):
    reply = HttpClient().post(PAIR, data=json.dumps(body), content_type="application/json")
    assert_problem(reply, 400, "invalid_request")
    assert Client.objects.count() == 0


def test_redeem_with_a_taken_name_keeps_the_code_usable(db):
    create("phone")
    code = pair_code("--scopes", "read")
    assert_problem(redeem(code, "phone"), 400, "invalid_request")
    assert PairingCode.objects.get().used_at is None
    assert Client.objects.filter(name="phone").count() == 1
    reply = redeem(code, "tablet")
    assert reply.status_code == 201, reply.content
    assert PairingCode.objects.get().client.name == "tablet"


def test_paired_admin_scope_is_carried_over(db):
    code = pair_code("--scopes", "responses,admin")
    reply = redeem(code, "ops")
    assert reply.status_code == 201, reply.content
    assert reply.json()["scopes"] == ["responses", "admin"]
    assert Client.objects.get(name="ops").scopes == ["responses", "admin"]


def test_pair_is_rate_limited(db):
    from tasks_app.edge.throttles import PairThrottle

    allowed, _ = PairThrottle().parse_rate(PairThrottle().get_rate())
    http = HttpClient()
    for _ in range(allowed):
        assert_problem(redeem("0000-0000", "phone", http), 400, "invalid_request")
    reply = redeem("0000-0000", "phone", http)
    assert_problem(reply, 429, "rate_limited")
    assert int(reply["Retry-After"]) >= 1
    assert Client.objects.count() == 0


@pytest.mark.django_db(transaction=True)
def test_concurrent_redeem_of_one_code_gives_one_token():
    code = pair_code("--scopes", "read")
    barrier = threading.Barrier(2)
    results: dict[str, tuple[int, dict]] = {}
    failures: list[BaseException] = []

    def worker(name: str) -> None:
        try:
            http = HttpClient()
            barrier.wait(timeout=30)
            reply = redeem(code, name, http)
            results[name] = (reply.status_code, json.loads(reply.content))
        except BaseException as error:  # reported below, in the main thread
            failures.append(error)
        finally:
            connection.close()

    threads = [threading.Thread(target=worker, args=(name,)) for name in ("phone", "tablet")]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert not any(thread.is_alive() for thread in threads)
    assert not failures, failures

    statuses = sorted(status for status, _ in results.values())
    assert statuses == [201, 400], results
    winner = next(name for name, (status, _) in results.items() if status == 201)
    loser = next(name for name, (status, _) in results.items() if status == 400)
    assert results[loser][1]["code"] == "invalid_request"

    assert list(Client.objects.values_list("name", flat=True)) == [winner]
    pairing = PairingCode.objects.get()
    assert pairing.used_at is not None
    assert pairing.client.name == winner
    assert ApiClient(results[winner][1]["token"]).get("/lmsp/v1/tasks").status_code == 200


# --------------------------------------------------------------------------- #
# The local token of scripts/prepare (lmsp_prepare)
# --------------------------------------------------------------------------- #


def test_the_local_token_is_made_once_readable_by_its_user_only_and_works(db, demo_model, tmp_path):
    path = tmp_path / "data" / "local-token"

    made = client_local_token_ensure(path=path)
    again = client_local_token_ensure(path=path)

    assert made is not None and again is None
    assert path.read_text() == made + "\n"
    assert path.stat().st_mode & 0o777 == 0o600
    assert ApiClient(made).get("/lmsp/v1/tasks").status_code == 200


@pytest.mark.parametrize("kept", ["revoked", "another-database", "empty"])
def test_a_local_token_that_does_not_belong_to_this_database_is_replaced(db, demo_model, tmp_path, kept):
    path = tmp_path / "local-token"
    if kept == "revoked":
        path.write_text(client_local_token_ensure(path=path) + "\n")
        Client.objects.update(revoked_at=timezone.now())
    elif kept == "another-database":
        path.write_text("lmsp_not-a-token-of-this-database\n")
    else:
        path.write_text("")

    made = client_local_token_ensure(path=path)

    assert made is not None and path.read_text() == made + "\n"
    assert ApiClient(made).get("/lmsp/v1/tasks").status_code == 200
