"""Bad input on the task API: each gets the right RFC 9457 problem and writes nothing."""

from __future__ import annotations

import itertools
import json
import urllib.error
import urllib.request
from urllib.parse import urlencode

import pytest

from tasks_app.models import IdempotencyKey, Response, Task, TaskEvent
from tests.support.api import ApiClient
from tests.support.problems import assert_problem

TASKS = "/lmsp/v1/tasks"
_keys = itertools.count(1)


def fields_of(body: dict) -> set[str]:
    return {error["field"] for error in body.get("errors", [])}


def counts() -> tuple[int, int, int, int]:
    return (Task.objects.count(), Response.objects.count(), TaskEvent.objects.count(), IdempotencyKey.objects.count())


def new_key() -> str:
    return f"key-{next(_keys)}"


def post_task(api: ApiClient, body=None, *, raw=None, content_type="application/json", key: str | None = "new"):
    headers = {"Idempotency-Key": new_key() if key == "new" else key} if key is not None else {}
    return api.post(TASKS, body, headers=headers, raw=raw, content_type=content_type)


def request_with(**fields) -> dict:
    return {"type": "response", "input": {"model": "demo", "input": "Hello", **fields}}


def assert_invalid_writes_nothing(
    api: ApiClient, body=None, *, raw=None, fields=(), status=400, code="invalid_request", **kwargs
) -> dict:
    before = counts()
    reply = post_task(api, body, raw=raw, **kwargs)
    problem = assert_problem(reply, status, code)
    for field in fields:
        assert field in fields_of(problem), (field, problem)
    assert counts() == before
    return problem


# --- sanity ------------------------------------------------------------------------------------------


def test_valid_minimal_request_is_accepted_and_written(api):
    before = counts()
    reply = post_task(api, request_with())
    assert reply.status_code == 202, reply.content
    assert reply["Content-Type"].startswith("application/json")
    body = reply.json()
    assert body["object"] == "task" and body["status"] == "queued"
    assert counts() == tuple(n + 1 for n in before)
    assert Task.objects.filter(pk=body["id"], client=api.client).exists()


@pytest.mark.parametrize(
    "fields",
    [
        {"input": [{"type": "message", "role": "user", "content": "Hello"}]},
        {"input": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]},
        {"input": [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Hi"}]}]},
        {"input": [{"role": "assistant", "content": [{"type": "output_text", "text": "Hi"}]}]},
        {"stop": "\n"},
        {"stop": ["a", "b", "c", "d"]},
        {"metadata": {f"k{i}": f"v{i}" for i in range(16)}},
        {"metadata": {"k" * 64: "v" * 512}},
        {"temperature": 0, "top_p": 1, "seed": 0, "max_output_tokens": 1},
        {"temperature": 2.0, "top_p": 0.5, "seed": 2**64 - 1},
        {"top_k": 0, "min_p": 0, "repetition_penalty": 0.01},
        {"top_k": 1_000_000, "min_p": 1, "repetition_penalty": 100, "temperature": 0},
        {"top_k": 20.0, "min_p": None, "repetition_penalty": None},
        {"max_output_tokens": 5.0, "seed": 7.0},
        {"instructions": "Be brief.", "stream": True, "store": False},
        {"instructions": None, "temperature": None, "stop": None, "metadata": None},
    ],
    ids=lambda f: ",".join(f),
)
def test_accepted_variants(api, fields):
    before = counts()
    reply = post_task(api, request_with(**fields))
    assert reply.status_code == 202, reply.content
    assert counts() == tuple(n + 1 for n in before)


@pytest.mark.parametrize("policy", ["fail", "retry", "resume"])
def test_every_on_restart_policy_with_a_key_is_accepted(api, policy):
    reply = post_task(api, {**request_with(), "on_restart": policy})
    assert reply.status_code == 202, reply.content
    assert Task.objects.get(pk=reply.json()["id"]).on_restart == policy


# --- bodies that are not a JSON object ------------------------------------------------------------------


@pytest.mark.parametrize(
    "raw",
    [
        '{"type": "response", "input": ',
        "{'type': 'response'}",
        "not json",
        '{"type":"response","input":{"model":"demo","input":"x"}} trailing',
        b'{"type":"response","input":{"model":"demo","input":"\xff"}}',
    ],
    ids=["truncated", "single-quotes", "text", "trailing", "not-utf8"],
)
def test_malformed_json(api, raw):
    assert_invalid_writes_nothing(api, raw=raw)


@pytest.mark.parametrize(
    "raw",
    ['[{"type":"response","input":{"model":"demo","input":"x"}}]', '"response"', "42", "null", "true", "[]"],
)
def test_top_level_must_be_an_object(api, raw):
    assert_invalid_writes_nothing(api, raw=raw)


@pytest.mark.parametrize("constant", ["NaN", "Infinity", "-Infinity"])
def test_nan_and_infinity_literals(api, constant):
    raw = '{"type":"response","input":{"model":"demo","input":"x","temperature":' + constant + "}}"
    assert_invalid_writes_nothing(api, raw=raw)


@pytest.mark.parametrize(
    "raw",
    [
        '{"type":"response","type":"response","input":{"model":"demo","input":"x"}}',
        '{"type":"response","input":{"model":"demo","model":"other","input":"x"}}',
        '{"type":"response","input":{"model":"demo","input":"x","metadata":{"a":"1","a":"2"}}}',
    ],
    ids=["top", "input", "metadata"],
)
def test_duplicate_keys(api, raw):
    assert_invalid_writes_nothing(api, raw=raw)


# --- field types of the response request --------------------------------------------------------------

BAD_FIELDS = [
    ("model", 42),
    ("model", None),
    ("model", ["demo"]),
    ("input", 42),
    ("input", None),
    ("input", {"role": "user", "content": "x"}),
    ("max_output_tokens", "5"),
    ("max_output_tokens", 1.5),
    ("max_output_tokens", True),
    ("max_output_tokens", 0),
    ("temperature", "0.5"),
    ("temperature", True),
    ("temperature", 3),
    ("temperature", -0.1),
    ("top_p", 0),
    ("top_p", 1.5),
    ("top_p", "1"),
    ("top_k", -1),
    ("top_k", 1.5),
    ("top_k", "20"),
    ("top_k", 1_000_001),
    ("min_p", -0.1),
    ("min_p", 1.01),
    ("min_p", True),
    ("repetition_penalty", 0),
    ("repetition_penalty", 0.009),
    ("repetition_penalty", 100.5),
    ("repetition_penalty", "1.1"),
    ("seed", -1),
    ("seed", 2**64),
    ("seed", 1.5),
    ("stream", "yes"),
    ("stream", 1),
    ("store", 1),
    ("store", "true"),
    ("stop", 5),
    ("stop", ["a", "b", "c", "d", "e"]),
    ("stop", []),
    ("stop", ""),
    ("stop", ["a", 1]),
    ("metadata", {"a": 1}),
    ("metadata", {f"k{i}": "v" for i in range(17)}),
    ("metadata", {"k" * 65: "v"}),
    ("metadata", {"k": "v" * 513}),
    ("metadata", ["a", "b"]),
    ("metadata", "a=b"),
    ("instructions", ["be", "brief"]),
    ("instructions", 7),
]


@pytest.mark.parametrize(("name", "value"), BAD_FIELDS, ids=[f"{n}={v!r}"[:60] for n, v in BAD_FIELDS])
def test_wrong_type_or_range_names_the_field(api, name, value):
    problem = assert_invalid_writes_nothing(api, request_with(**{name: value}), fields=[f"input.{name}"])
    assert fields_of(problem) == {f"input.{name}"}


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"input": {"model": "demo", "input": "x"}}, "type"),
        ({"type": "response"}, "input"),
        ({"type": "response", "input": {"input": "x"}}, "input.model"),
        ({"type": "response", "input": {"model": "demo"}}, "input.input"),
        ({}, "type"),
        ({}, "input"),
    ],
    ids=["type", "input", "input.model", "input.input", "empty-type", "empty-input"],
)
def test_missing_required_field(api, body, field):
    assert_invalid_writes_nothing(api, body, fields=[field])


def test_empty_body_names_both_required_fields(api):
    problem = assert_invalid_writes_nothing(api, raw="{}")
    assert {"type", "input"} <= fields_of(problem)


def test_unknown_top_level_field(api):
    problem = assert_invalid_writes_nothing(api, {**request_with(), "priority": 5}, fields=["priority"])
    assert "priority" in problem["detail"]


def test_unknown_input_field(api):
    assert_invalid_writes_nothing(api, request_with(foo=1), fields=["input.foo"])


def test_unknown_fields_are_all_named(api):
    body = {**request_with(foo=1, bar="x"), "extra": True}
    problem = assert_invalid_writes_nothing(api, body)
    assert {"input.foo", "input.bar", "extra"} <= fields_of(problem)


@pytest.mark.parametrize("value", ["batch", "RESPONSE", "", 1, None])
def test_unknown_type(api, value):
    assert_invalid_writes_nothing(api, {**request_with(), "type": value}, fields=["type"])


@pytest.mark.parametrize("value", ["sometimes", "FAIL", "", 0, None])
def test_bad_on_restart(api, value):
    assert_invalid_writes_nothing(api, {**request_with(), "on_restart": value}, fields=["on_restart"])


def test_input_envelope_not_an_object(api):
    assert_invalid_writes_nothing(api, {"type": "response", "input": "Hello"}, fields=["input"])


# --- message items --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("items", "field"),
    [
        ([{"type": "message", "role": "robot", "content": "x"}], "input.input[0].role"),
        ([{"role": "user", "content": "x"}, {"role": "tool", "content": "x"}], "input.input[1].role"),
        ([{"role": "user"}], "input.input[0].content"),
        ([{"content": "x"}], "input.input[0].role"),
        ([{"type": "robot_call", "role": "user", "content": "x"}], "input.input[0].type"),
        ([{"role": "user", "content": "x", "name": "bob"}], "input.input[0].name"),
        ([{"role": "user", "content": [{"type": "input_text"}]}], "input.input[0].content[0].text"),
        ([{"role": "user", "content": [{"type": "input_text", "text": 5}]}], "input.input[0].content[0].text"),
        (
            [{"role": "user", "content": [{"type": "input_text", "text": "a"}, {"type": "output_txt", "text": "b"}]}],
            "input.input[0].content[1].type",
        ),
        ([{"role": "user", "content": []}], "input.input[0].content"),
        ([{"role": "user", "content": 5}], "input.input[0].content"),
        (["hello"], "input.input[0]"),
        ([], "input.input"),
    ],
    ids=[
        "bad-role",
        "second-item-bad-role",
        "no-content",
        "no-role",
        "item-type",
        "unknown-item-field",
        "part-no-text",
        "part-text-number",
        "second-part-type",
        "empty-content",
        "content-number",
        "item-string",
        "empty-list",
    ],
)
def test_bad_message_items(api, items, field):
    problem = assert_invalid_writes_nothing(api, request_with(input=items))
    assert field in fields_of(problem), problem


@pytest.mark.parametrize(
    ("items", "param"),
    [
        ([{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}], "input.input[0].content[0].type"),
        (
            [{"role": "user", "content": [{"type": "input_text", "text": "a"}, {"type": "input_audio", "text": "b"}]}],
            "input.input[0].content[1].type",
        ),
        ([{"role": "user", "content": "a"}, {"type": "web_search_call", "action": {}}], "input.input[1].type"),
    ],
    ids=["image-part", "second-part-audio", "web_search_call-item"],
)
def test_input_openai_has_but_this_service_cannot_read_is_refused_by_name(api, items, param):
    """PROFILE.md 10.1: image, file and audio parts and hosted items are OpenAI's, refused as unsupported."""
    problem = assert_invalid_writes_nothing(api, request_with(input=items), code="unsupported_parameter")
    assert problem["param"] == param
    assert problem["error"]["param"] == param


@pytest.mark.parametrize(
    "raw",
    [
        '{"type":"response","input":{"model":"demo","input":"x","temperature":1e400}}',
        '{"type":"response","input":{"model":"demo","input":"x","seed":1' + "0" * 5000 + "}}",
    ],
    ids=["float-overflow", "huge-int"],
)
def test_numbers_out_of_any_range(api, raw):
    assert_invalid_writes_nothing(api, raw=raw)


def test_deeply_nested_json_is_a_400_not_a_500(api):
    """A nesting depth the JSON decoder cannot follow is the client's error, not the server's."""
    api.http.raise_request_exception = False
    depth = 100_000
    raw = '{"type":"response","input":{"model":"demo","input":"x","metadata":' + "[" * depth + "]" * depth + "}}"
    assert len(raw) < 1024 * 1024
    assert_invalid_writes_nothing(api, raw=raw)


@pytest.mark.parametrize(
    "text",
    ["x\\ud800", "\\udfff", "a\\udc00b"],
    ids=["high", "low", "low-inside"],
)
def test_lone_surrogate_escape_is_a_400_not_a_500(api, text):
    """\\ud800 alone decodes to no Unicode character; it cannot be hashed, stored or echoed as UTF-8."""
    api.http.raise_request_exception = False
    raw = '{"type":"response","input":{"model":"demo","input":"' + text + '"}}'
    assert_invalid_writes_nothing(api, raw=raw)


NUL = "a\u0000b"


@pytest.mark.parametrize(
    ("fields", "field"),
    [
        ({"model": NUL}, "input.model"),
        ({"instructions": NUL}, "input.instructions"),
        ({"input": [{"role": "user", "content": [{"type": "input_text", "text": NUL}]}]}, "input.input[0]"),
        ({"input": NUL}, "input.input"),
        ({"input": [{"role": "user", "content": NUL}]}, "input.input[0]"),
        ({"metadata": {"k": NUL}}, "input.metadata"),
        ({"metadata": {NUL: "v"}}, "input.metadata"),
        ({"stop": NUL}, "input.stop"),
    ],
    ids=["model", "instructions", "text-part", "input", "content", "metadata-value", "metadata-key", "stop"],
)
def test_nul_character_is_refused_on_every_database(api, fields, field):
    """U+0000 cannot be stored in a PostgreSQL JSON column; refuse it up front, the same on every database."""
    api.http.raise_request_exception = False
    problem = assert_invalid_writes_nothing(api, request_with(**fields))
    assert any(name.startswith(field) for name in fields_of(problem)), problem


def test_content_length_not_a_number(api):
    before = counts()
    reply = api.http.post(
        TASKS,
        data=json.dumps(request_with()),
        content_type="application/json",
        CONTENT_LENGTH="abc",
        headers=api._headers({"Idempotency-Key": new_key()}),
    )
    assert_problem(reply, 400, "invalid_request")
    assert counts() == before


def test_key_of_a_refused_request_is_free_for_the_next_one(api):
    """A refused request leaves no idempotency record, so the same key works once the body is fixed."""
    key = new_key()
    assert_problem(post_task(api, request_with(model="nope"), key=key), 400, "model_not_found")
    assert_problem(post_task(api, request_with(temperature=9), key=key), 400, "invalid_request")
    reply = post_task(api, request_with(), key=key)
    assert reply.status_code == 202, reply.content
    assert not reply.has_header("Idempotent-Replayed")
    assert IdempotencyKey.objects.filter(key=key).count() == 1


# --- headers ----------------------------------------------------------------------------------------------


def test_retry_without_idempotency_key(api):
    problem = assert_invalid_writes_nothing(
        api, {**request_with(), "on_restart": "retry"}, key=None, fields=["Idempotency-Key"]
    )
    assert problem["code"] == "invalid_request"


@pytest.mark.parametrize(
    "key",
    ["k" * 256, "caf\u00e9", "tab\there", "new\nline", "\x7f", ""],
    ids=["256", "non-ascii", "tab", "nl", "del", "empty"],
)
def test_bad_idempotency_key(api, key):
    assert_invalid_writes_nothing(api, request_with(), key=key, fields=["Idempotency-Key"])


def test_idempotency_key_of_255_printable_chars_is_fine(api):
    reply = post_task(api, request_with(), key="k" * 254 + "~")
    assert reply.status_code == 202, reply.content
    assert IdempotencyKey.objects.filter(key="k" * 254 + "~").count() == 1


BAD_CURSORS = [
    ({"Last-Event-ID": "soon"}, {}, "Last-Event-ID"),
    ({"Last-Event-ID": "-1"}, {}, "Last-Event-ID"),
    ({"Last-Event-ID": "2147483648"}, {"starting_after": "1"}, "Last-Event-ID"),
    ({}, {"starting_after": "soon"}, "starting_after"),
    ({}, {"starting_after": "1.5"}, "starting_after"),
    ({}, {"starting_after": ""}, "starting_after"),
    ({"Last-Event-ID": ""}, {"starting_after": "1"}, "Last-Event-ID"),
    ({"Last-Event-ID": "1"}, {"starting_after": "2147483648"}, "starting_after"),
]


@pytest.mark.parametrize("stream", [False, True], ids=["wait", "stream"])
@pytest.mark.parametrize(("headers", "query", "field"), BAD_CURSORS, ids=[str(c) for c in BAD_CURSORS])
def test_a_bad_resume_cursor_on_post_responses_is_refused_and_writes_nothing(
    transactional_db, api, web_server, headers, query, field, stream
):
    """The cursor matters only to a streamed retry, but a malformed one is refused on every request
    (schemathesis found a waiting one accepted). The live server answers; before the fix a waiting
    request was accepted and waited for a worker this test does not run."""
    before = counts()
    url = f"{web_server.base}/lmsp/v1/responses?{urlencode(query)}"
    body = json.dumps({"model": "demo", "input": "Hello", "stream": stream}).encode()
    sent = {"Authorization": f"Bearer {api.token}", "Content-Type": "application/json", "Idempotency-Key": new_key()}
    request = urllib.request.Request(url, data=body, headers={**sent, **headers}, method="POST")
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(request, timeout=10)
    assert refused.value.code == 400
    assert refused.value.headers["Content-Type"] == "application/problem+json"
    problem = json.loads(refused.value.read())
    assert problem["code"] == "invalid_request"
    assert fields_of(problem) == {field}
    assert counts() == before


@pytest.mark.parametrize(("headers", "query", "field"), BAD_CURSORS, ids=[str(c) for c in BAD_CURSORS])
def test_a_bad_resume_cursor_on_a_task_event_stream_is_refused(transactional_db, api, headers, query, field):
    """An empty cursor, and one the header outranks, are refused too (schemathesis found both accepted).
    The stream reads through its own connections, which see only committed rows."""
    task_id = post_task(api, request_with()).json()["id"]
    reply = api.get(f"{TASKS}/{task_id}/events", headers=headers, **query)
    problem = assert_problem(reply, 400, "invalid_request")
    assert fields_of(problem) == {field}


@pytest.mark.parametrize(("headers", "query", "field"), BAD_CURSORS, ids=[str(c) for c in BAD_CURSORS])
def test_a_bad_resume_cursor_on_reading_a_response_object_is_refused(api, headers, query, field):
    """``GET /responses/{id}`` without ``stream=true`` ignores the cursor, but refuses a malformed one
    as the stream does (schemathesis found ``starting_after=false`` accepted)."""
    response_id = post_task(api, request_with()).json()["response_id"]
    reply = api.get(f"/lmsp/v1/responses/{response_id}", headers=headers, **query)
    problem = assert_problem(reply, 400, "invalid_request")
    assert fields_of(problem) == {field}


# --- model, size, media type --------------------------------------------------------------------------------


@pytest.mark.parametrize("model", ["nope", "demo:v2", "DEMO", "demo:"])
def test_unknown_model(api, model):
    assert_invalid_writes_nothing(
        api, request_with(model=model), status=400, code="model_not_found", fields=["input.model"]
    )


def test_demo_latest_is_the_same_model(api):
    reply = post_task(api, request_with(model="demo:latest"))
    assert reply.status_code == 202, reply.content


def test_body_over_the_limit(api, settings):
    settings.LMSP_MAX_REQUEST_BYTES = 2000
    body = request_with(input="x" * 5000)
    assert len(json.dumps(body)) > 4000
    assert_invalid_writes_nothing(api, body, status=413, code="payload_too_large")


def test_body_just_under_the_limit_is_fine(api, settings):
    settings.LMSP_MAX_REQUEST_BYTES = 2000
    body = request_with(input="x" * 1800)
    assert len(json.dumps(body)) <= 2000
    reply = post_task(api, body)
    assert reply.status_code == 202, reply.content


@pytest.mark.parametrize(
    ("raw", "content_type"),
    [
        ('{"type":"response","input":{"model":"demo","input":"x"}}', "text/plain"),
        ("type=response&input=x", "application/x-www-form-urlencoded"),
        ('{"type":"response","input":{"model":"demo","input":"x"}}', "application/xml"),
    ],
    ids=["text", "form", "xml"],
)
def test_unsupported_media_type(api, raw, content_type):
    assert_invalid_writes_nothing(api, raw=raw, content_type=content_type, status=415, code="unsupported_media_type")


def test_json_with_charset_is_fine(api):
    reply = post_task(api, raw=json.dumps(request_with()), content_type="application/json; charset=utf-8")
    assert reply.status_code == 202, reply.content


# --- routes and methods ------------------------------------------------------------------------------------


def test_unknown_route(api):
    assert_problem(api.get("/lmsp/v1/nope"), 404, "not_found")
    assert_problem(api.post("/lmsp/v1/nope", {}), 404, "not_found")


def test_unknown_route_without_token(db):
    assert_problem(ApiClient(None).get("/lmsp/v1/nope"), 404, "not_found")


def test_delete_on_tasks_is_405(api):
    before = counts()
    reply = api.http.delete(TASKS, headers=api._headers(None))
    assert_problem(reply, 405, "method_not_allowed")
    assert counts() == before


@pytest.mark.parametrize(
    ("path", "served"),
    [
        (TASKS, {"GET", "HEAD", "POST"}),
        (f"{TASKS}/task_unknown", {"GET", "HEAD"}),
        (f"{TASKS}/task_unknown/cancel", {"POST"}),
        ("/lmsp/v1/models", {"GET", "HEAD"}),
        ("/lmsp/v1/capabilities", {"GET", "HEAD"}),
    ],
)
def test_a_405_names_exactly_the_methods_that_are_served(api, path, served):
    # OPTIONS is refused (the OpenAPI schema describes the API), so Allow must not offer it.
    for method in ("options", "delete", "patch"):
        reply = getattr(api.http, method)(path, headers=api._headers(None))
        assert_problem(reply, 405, "method_not_allowed")
        assert {m.strip() for m in reply["Allow"].split(",")} == served


def test_put_on_a_task_is_405(api):
    task = post_task(api, request_with()).json()
    reply = api.http.put(
        f"{TASKS}/{task['id']}", data="{}", content_type="application/json", headers=api._headers(None)
    )
    assert_problem(reply, 405, "method_not_allowed")
    assert Task.objects.get(pk=task["id"]).status == "queued"


# --- list query -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("params", "field"),
    [
        ({"limit": "0"}, "limit"),
        ({"limit": "101"}, "limit"),
        ({"limit": "-1"}, "limit"),
        ({"limit": "abc"}, "limit"),
        ({"status": "paused"}, "status"),
        ({"status": "queued,paused"}, "status"),
        ({"status": ""}, "status"),
        ({"after": "garbage"}, "after"),
        ({"after": "resp_01ARZ3NDEKTSV4RRFFQ69G5FAV"}, "after"),
    ],
    ids=lambda v: json.dumps(v) if isinstance(v, dict) else v,
)
def test_bad_list_query(api, params, field):
    problem = assert_problem(api.get(TASKS, **params), 400, "invalid_request")
    assert field in fields_of(problem), problem


@pytest.mark.parametrize(
    "params",
    [
        {},
        {"limit": "1"},
        {"limit": "100"},
        {"status": "queued,cancelled"},
        {"after": "task_01ARZ3NDEKTSV4RRFFQ69G5FAV"},
    ],
    ids=json.dumps,
)
def test_good_list_query(api, params):
    post_task(api, request_with())
    reply = api.get(TASKS, **params)
    assert reply.status_code == 200, reply.content
    assert reply.json()["object"] == "list"


def test_accept_html_still_gets_json(api):
    task = post_task(api, request_with()).json()
    for path in (TASKS, f"{TASKS}/{task['id']}", "/lmsp/v1/models"):
        reply = api.get(path, headers={"Accept": "text/html"})
        assert reply.status_code == 200, (path, reply.content)
        assert reply["Content-Type"].startswith("application/json")
        assert isinstance(reply.json(), dict)


def test_accept_html_error_is_still_a_problem(api):
    reply = api.get(f"{TASKS}/task_01ARZ3NDEKTSV4RRFFQ69G5FAV", headers={"Accept": "text/html"})
    assert_problem(reply, 404, "task_not_found")


# --- 500 ---------------------------------------------------------------------------------------------------


def test_internal_error_leaks_nothing(api, monkeypatch):
    from tasks_app.api import task_views as views

    def explode(**kwargs):
        raise RuntimeError("secret-detail")

    monkeypatch.setattr(views.selectors, "task_get_visible", explode)
    api.http.raise_request_exception = False
    reply = api.get(f"{TASKS}/x")
    assert_problem(reply, 500, "internal_error")
    text = reply.content.decode()
    assert "secret-detail" not in text
    assert "Traceback" not in text
    assert "RuntimeError" not in text
