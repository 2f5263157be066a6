"""The OpenAPI schema at /lmsp/v1/openapi.json: public, valid, complete, and true to what the endpoints answer."""

from __future__ import annotations

import copy
import json
import re
import shutil
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
from django.contrib.staticfiles import finders
from django.core.cache import cache
from django.core.files.uploadedfile import SimpleUploadedFile
from django.test import Client as HttpClient
from django.test import override_settings
from django.test.client import BOUNDARY, MULTIPART_CONTENT, encode_multipart
from django.urls import URLPattern, URLResolver, get_resolver
from openapi_schema_validator import OAS31Validator
from openapi_spec_validator import validate
from referencing import Registry, Resource
from referencing.jsonschema import DRAFT202012

from tasks_app.core import lifecycle
from tasks_app.edge.throttles import throttle_reset
from tasks_app.models import IdempotencyKey, ModelRecord, Task
from tasks_app.plumbing.db_locks import lock_wait
from tasks_app.services.clients import pairing_code_create
from tasks_app.services.retention import retention_cleanup
from tests.support.db import database_url, database_write_locked
from tests.support.demo import ENDLESS_MODEL
from tests.support.hf_hub import hf_hub_stand_in
from tests.support.server import REPO, free_port, uvicorn_process
from tests.support.specs import spec_json
from tests.support.sse import open_stream
from tests.support.tasks import wait_for_status
from tests.support.waiting import wait_until
from tests.support.webhooks import receiving

# The schema and its answers at the HTTP edge (schemathesis checks them against PostgreSQL): the SQLite
# pass only (pyproject.toml, the sqlite_pass marker).
pytestmark = pytest.mark.sqlite_pass

API = "/lmsp/v1/"
# Ollama's native API (docs/ollama.md), beside /lmsp/v1: its clients take a bare host.
OLLAMA = "/api/"
NDJSON = "application/x-ndjson"
SCHEMA_PATH = "/lmsp/v1/openapi.json"
DOCS_PATH = "/lmsp/v1/docs"
# Routes of tasks_app/api/urls.py that serve the schema itself; the schema documents the API.
SCHEMA_ROUTES = {"openapi", "openapi-docs"}
PROBLEM = "application/problem+json"
EVENT_STREAM = "text/event-stream"
UNKNOWN_TASK = "task_01ARZ3NDEKTSV4RRFFQ69G5FAV"
UNKNOWN_RESPONSE = "resp_01ARZ3NDEKTSV4RRFFQ69G5FAV"
UNKNOWN_WEBHOOK_ENDPOINT = "whep_01ARZ3NDEKTSV4RRFFQ69G5FAV"
UNKNOWN_TOKEN = "lmsp_" + "B" * 43
TERMINAL = {"succeeded", "failed", "cancelled"}
# Response headers whose presence the schema must announce when an answer carries them.
API_HEADERS = ("Location", "Retry-After", "WWW-Authenticate", "Idempotent-Replayed", "Allow")
# A short generation, so the single test worker is never blocked for long.
SHORT = {"max_output_tokens": 2}
CHAT_PATH = "/chat/completions"
MESSAGES_PATH = f"{API}messages"
COUNT_TOKENS_PATH = f"{MESSAGES_PATH}/count_tokens"


@pytest.fixture(autouse=True)
def _fresh_throttle() -> Iterator[None]:
    # POST /pair is rate-limited per address, counted in Redis.
    cache.clear()
    throttle_reset(scope="pair")
    yield
    throttle_reset(scope="pair")
    cache.clear()


@pytest.fixture(scope="module")
def spec() -> dict[str, Any]:
    return json.loads(HttpClient().get(SCHEMA_PATH).content)


# --- served, public, valid -----------------------------------------------------------------------------


def test_the_schema_is_served_without_a_token_and_is_valid_openapi():
    # No database either: this test has no db marker, so a query would fail it.
    http = HttpClient()
    for headers in ({}, {"Authorization": f"Bearer {UNKNOWN_TOKEN}"}, {"Authorization": "Basic abc"}):
        reply = http.get(SCHEMA_PATH, headers=headers)
        assert reply.status_code == 200, (headers, reply.content[:300])
        assert reply["Content-Type"] == "application/json"
    document = reply.json()

    validate(document)

    assert document["openapi"].startswith("3.1")
    assert document["paths"] and all(path.startswith((API, OLLAMA)) for path in document["paths"])


def test_the_docs_page_is_swagger_ui_on_local_static_files():
    reply = HttpClient().get(DOCS_PATH)

    assert reply.status_code == 200
    assert reply["Content-Type"].startswith("text/html")
    page = reply.content.decode()
    assets = re.findall(r'(?:src|href)="([^"]+)"', page)
    names = {asset.rsplit("/", 1)[-1] for asset in assets}
    assert {"swagger-ui-bundle.js", "swagger-ui-standalone-preset.js", "swagger-ui.css"} <= names
    for asset in assets:
        assert asset.startswith("/static/drf_spectacular_sidecar/swagger-ui-dist/"), asset
        assert finders.find(asset.removeprefix("/static/")) is not None, f"{asset} is not a static file"
    # Nothing comes from a CDN, so the page works offline.
    assert "http://" not in page and "https://" not in page
    assert f'url: "{SCHEMA_PATH}"' in page


def test_the_live_server_serves_the_docs_page_and_its_assets(transactional_db, web_server):
    import urllib.request

    page = urllib.request.urlopen(web_server.base + DOCS_PATH).read().decode()
    assets = re.findall(r'(?:src|href)="([^"]+)"', page)
    assert assets
    for asset in assets:
        with urllib.request.urlopen(web_server.base + asset) as reply:
            assert reply.status == 200, asset
            assert reply.read(), asset


# --- the schema documents exactly the routes -----------------------------------------------------------


def api_routes() -> Iterator[tuple[str, str | None]]:
    """(path template, route name) of every pattern mounted under /lmsp/v1/ and Ollama's /api/."""

    def walk(patterns: list, prefix: str) -> Iterator[tuple[str, str | None]]:
        for pattern in patterns:
            route = prefix + str(pattern.pattern)
            if isinstance(pattern, URLResolver):
                yield from walk(pattern.url_patterns, route)
            elif isinstance(pattern, URLPattern) and ("/" + route).startswith((API, OLLAMA)):
                yield "/" + re.sub(r"<(?:\w+:)?(\w+)>", r"{\1}", route), pattern.name

    return walk(get_resolver().url_patterns, "")


class _Unknown(dict):
    """A path parameter no test names: an id of nothing (its route answers 404, never 405)."""

    def __missing__(self, name: str) -> str:
        return f"unknown_{name}"


def fill(
    path: str,
    task_id: str = UNKNOWN_TASK,
    response_id: str = UNKNOWN_RESPONSE,
    model_id: str = "demo",
    webhook_endpoint_id: str = UNKNOWN_WEBHOOK_ENDPOINT,
    **others: str,
) -> str:
    named = {"task_id": task_id, "response_id": response_id, "model_id": model_id}
    return path.format_map(_Unknown(named, webhook_endpoint_id=webhook_endpoint_id, **others))


def test_the_schema_has_every_route_and_method_the_api_serves_and_no_other(db, spec):
    http = HttpClient()
    served: dict[str, set[str]] = {}
    for path, name in api_routes():
        if name in SCHEMA_ROUTES:
            continue
        # A method a route does not serve answers 405 before authentication; any other answer means
        # it is served. HEAD is left out: it is GET without the body, which OpenAPI does not list.
        served[path] = {
            method
            for method in ("get", "post", "put", "patch", "delete", "options", "trace")
            if http.generic(method.upper(), fill(path)).status_code != 405
        }

    documented = {path: set(operations) for path, operations in spec["paths"].items()}
    assert documented == served


# --- the schema allows exactly what the server accepts ------------------------------------------------

# (operation, where, name, value, whether the server accepts it). Each was a disagreement schemathesis
# found (issue 14: empty strings, top_p 0, U+0000, undeclared fields, 7.0 as an integer, metadata keys,
# status lists), or is the boundary of one.
AGREEMENT = [
    ("get", "/lmsp/v1/tasks", "query", "after", "", False),
    ("get", "/lmsp/v1/tasks", "query", "after", "garbage", False),
    ("get", "/lmsp/v1/tasks", "query", "after", UNKNOWN_RESPONSE, False),
    ("get", "/lmsp/v1/tasks", "query", "after", UNKNOWN_TASK, True),
    ("get", "/lmsp/v1/tasks", "query", "status", "", False),
    ("get", "/lmsp/v1/tasks", "query", "status", "paused", False),
    ("get", "/lmsp/v1/tasks", "query", "status", "queued,,running", False),
    ("get", "/lmsp/v1/tasks", "query", "status", "queued, running", False),
    ("get", "/lmsp/v1/tasks", "query", "status", "queued,running", True),
    ("get", "/lmsp/v1/models", "query", "after", "", False),
    ("get", "/lmsp/v1/models", "query", "after", "x" * 201, False),
    ("get", "/lmsp/v1/models", "query", "after", " demo ", True),
    ("get", "/lmsp/v1/models", "query", "after", "de\u0000mo", False),
    ("post", "/lmsp/v1/tasks", "body", "model", "", False),
    ("post", "/lmsp/v1/tasks", "body", "model", "x" * 201, False),
    ("post", "/lmsp/v1/tasks", "body", "model", "demo", True),
    ("post", "/lmsp/v1/tasks", "body", "top_p", 0, False),
    ("post", "/lmsp/v1/tasks", "body", "top_p", -0.0, False),
    ("post", "/lmsp/v1/tasks", "body", "top_p", 1e-9, True),
    ("post", "/lmsp/v1/tasks", "body", "top_p", 1, True),
    ("post", "/lmsp/v1/tasks", "body", "model", "de\u0000mo", False),
    ("post", "/lmsp/v1/tasks", "body", "metadata", {"k" * 65: "v"}, False),
    ("post", "/lmsp/v1/tasks", "body", "metadata", {"k\u0000": "v"}, False),
    ("post", "/lmsp/v1/tasks", "body", "metadata", {"k" * 64: "v"}, True),
    ("post", "/lmsp/v1/tasks", "body", "seed", 7.0, True),
    ("post", "/lmsp/v1/tasks", "body", "seed", 7.5, False),
    ("post", "/lmsp/v1/tasks", "body", "undeclared", 1, False),
    ("post", "/lmsp/v1/responses", "body", "model", "", False),
    ("post", "/lmsp/v1/responses", "body", "top_p", 0, False),
    ("post", "/lmsp/v1/pair", "body", "code", "", False),
    ("post", "/lmsp/v1/pair", "body", "client_name", "", False),
    ("post", "/lmsp/v1/pair", "body", "undeclared", {}, False),
]


def _server_accepts(api, method: str, path: str, where: str, name: str, value: Any) -> bool:
    """Whether the server takes ``value`` for ``name``; a refusal must be a 400 naming it."""
    if where == "query":
        reply, field = api.get(path, **{name: value}), name
    elif path == f"{API}tasks":
        body = {"type": "response", "input": {"model": "demo", "input": "Hi", **SHORT, name: value}}
        reply, field = api.post(path, body), f"input.{name}"
    elif path == f"{API}responses":
        # Only refusals here: an accepted request would wait for a worker this test does not run.
        reply, field = api.post(path, {"model": "demo", "input": "Hi", name: value}), name
    else:
        reply, field = api.post(path, {"code": "0000-0000", "client_name": "phone", name: value}), name
    if reply.status_code < 300:
        return True
    assert reply.status_code == 400, (reply.status_code, reply.content)
    assert field in {error["field"] for error in reply.json()["errors"]}, reply.content
    return False


def _schema_accepts(ledger: Ledger, method: str, path: str, where: str, name: str, value: Any) -> bool:
    operation = ledger.spec["paths"][path][method]
    if where == "query":
        (index,) = [i for i, p in enumerate(operation["parameters"]) if p["in"] == "query" and p["name"] == name]
        return not ledger._invalid(pointer("paths", path, method, "parameters", str(index), "schema"), value)
    if path == f"{API}tasks":
        body = {"type": "response", "input": {"model": "demo", "input": "Hi", name: value}}
    elif path == f"{API}responses":
        body = {"model": "demo", "input": "Hi", name: value}
    else:
        body = {"code": "0000-0000", "client_name": "phone", name: value}
    schema_at = pointer("paths", path, method, "requestBody", "content", "application/json", "schema")
    return not ledger._invalid(schema_at, body)


@pytest.mark.parametrize(
    ("method", "path", "where", "name", "value", "accepted"),
    AGREEMENT,
    ids=[f"{m} {p.removeprefix(API)} {n}={v!r}"[:60] for m, p, _, n, v, _ in AGREEMENT],
)
def test_the_schema_allows_exactly_what_the_server_accepts(api, spec, method, path, where, name, value, accepted):
    assert _server_accepts(api, method, path, where, name, value) is accepted
    assert _schema_accepts(Ledger(spec, closed=False), method, path, where, name, value) is accepted


# --- every answer is documented, every documented answer happens ------------------------------------

# (method, path, status, code) documented but not produced here, and why.
CANNOT_PRODUCE = {
    # POST /tasks claims and completes its key in one transaction, so a second request never sees it
    # in progress; the code is reachable only if the key's holder rolls back twice between our insert
    # and our read (a race, not something a test can set up without a fault).
    ("post", "/lmsp/v1/tasks", 409, "idempotency_key_in_use"),
}
# A chat completion answers a failed response's stored problem as it is; these need a failing backend,
# a model that does not load, or a restart under a waiting request (tests/test_chat_completions.py
# answers context_length_exceeded through the same path).
CANNOT_PRODUCE |= {
    ("post", "/lmsp/v1/chat/completions", 500, code)
    for code in ("backend_error", "model_load_failed", "server_restarted")
}
# The Messages routes answer every problem in Anthropic's shape (application/json, no code): a status is seen
# or not. Their 500 and 507 need what every operation's do (below); count_tokens only reads.
CANNOT_PRODUCE |= {
    ("post", path, status, "application/json") for path in (MESSAGES_PATH, COUNT_TOKENS_PATH) for status in (500, 507)
}
CANNOT_PRODUCE.add(("post", COUNT_TOKENS_PATH, 503, "application/json"))
# Ollama's routes too (Ollama's {"error"}, application/json): their 500 and 507 as every operation's, but a failed
# pull's 500 (driven below); the 503 of those that never wait for a lock.
OLLAMA_OPERATIONS = {
    ("get", "/api/version"),
    ("get", "/api/tags"),
    ("post", "/api/show"),
    ("get", "/api/ps"),
    ("post", "/api/chat"),
    ("post", "/api/generate"),
    ("post", "/api/pull"),
}
CANNOT_PRODUCE |= {(method, path, 507, "application/json") for method, path in OLLAMA_OPERATIONS}
CANNOT_PRODUCE |= {
    (method, path, status, "application/json")
    for method, path in OLLAMA_OPERATIONS - {("post", "/api/chat"), ("post", "/api/generate")}
    for status in (500, 503)
    if (path, status) != ("/api/pull", 500)
}
# A generation's 500 is its failed task's stored problem (a failing backend, a model that does not load).
CANNOT_PRODUCE |= {("post", path, 500, "application/json") for path in ("/api/chat", "/api/generate")}
# Every operation's 500 needs an injected fault (a bug). Its 507, and the 503 of operations that never wait for a
# lock, need a database that is away, read-only or full: tests/test_database_outages.py has those from live servers
# (the 503 of the operations that write under a lock is still required here: the lock test below answers it).
CANNOT_PRODUCE_ANYWHERE = {(500, "internal_error"), (507, "insufficient_storage")}
CANNOT_PRODUCE |= {
    (method, path, 503, "service_unavailable")
    for method, path in (
        ("get", "/lmsp/v1/capabilities"),
        ("get", "/lmsp/v1/models"),
        ("get", "/lmsp/v1/models/{model_id}"),
        ("get", "/lmsp/v1/tasks"),
        ("get", "/lmsp/v1/tasks/{task_id}"),
        ("get", "/lmsp/v1/tasks/{task_id}/events"),
        ("post", "/lmsp/v1/tasks/{task_id}/stream_token"),
        ("get", "/lmsp/v1/responses/{response_id}"),
        ("get", "/lmsp/v1/webhook_endpoints"),
        ("get", "/lmsp/v1/webhook_endpoints/{webhook_endpoint_id}"),
        ("post", "/lmsp/v1/webhook_endpoints/{webhook_endpoint_id}/test"),
        ("get", "/lmsp/v1/webhook_event_types"),
        ("get", "/lmsp/v1/conversations/{conversation_id}"),
        ("get", "/lmsp/v1/conversations/{conversation_id}/items"),
        ("get", "/lmsp/v1/conversations/{conversation_id}/items/{item_id}"),
        ("get", "/lmsp/v1/files"),
        ("get", "/lmsp/v1/files/{file_id}"),
        ("get", "/lmsp/v1/files/{file_id}/content"),
        ("get", "/lmsp/v1/batches"),
        ("get", "/lmsp/v1/batches/{batch_id}"),
    )
}


@dataclass
class Answer:
    status: int
    headers: dict[str, str]
    body: bytes = b""
    events: list[dict[str, Any]] = field(default_factory=list)
    # The events as an SSE parser yields them, what the media type's schema describes.
    frames: list[dict[str, str]] = field(default_factory=list)

    @property
    def media_type(self) -> str | None:
        if self.status == 204:  # no content, whatever Content-Type a framework leaves on it
            return None
        raw = self.headers.get("content-type", "").split(";")[0].strip()
        return raw or None

    @property
    def code(self) -> str | None:
        return json.loads(self.body).get("code") if self.media_type == PROBLEM else None


def pointer(*parts: str) -> str:
    return "/".join(part.replace("~", "~0").replace("/", "~1") for part in parts)


class Ledger:
    """What the endpoints answered, checked against the schema as it comes."""

    URN = "urn:lmsp-openapi"

    def __init__(self, spec: dict[str, Any], *, closed: bool = True) -> None:
        self.spec = spec
        strict = copy.deepcopy(spec)
        # A field the objects carry but the schema does not name is drift too (``closed``; a check
        # of the schema's own word on requests leaves it as served).
        for component in strict["components"]["schemas"].values() if closed else ():
            if component.get("type") == "object" and "properties" in component:
                component.setdefault("additionalProperties", False)
        resource = Resource.from_contents(strict, default_specification=DRAFT202012)
        self.registry = Registry().with_resource(self.URN, resource)
        self.seen: set[tuple[str, str, int, str | None]] = set()
        self.faults: list[str] = []

    def saw(self, method: str, path: str, answer: Answer) -> Answer:
        """Record ``answer`` to ``method path`` (``*``: a method the path does not serve)."""
        methods = list(self.spec["paths"][path]) if method == "*" else [method.lower()]
        outcome = answer.code if answer.media_type == PROBLEM else answer.media_type
        for name in methods:
            self.seen.add((name, path, answer.status, outcome))
            self._check(name, path, answer)
        return answer

    def _invalid(self, schema_pointer: str, instance: Any) -> list[str]:
        validator = OAS31Validator({"$ref": f"{self.URN}#/{schema_pointer}"}, registry=self.registry)
        return [f"{list(error.absolute_path)}: {error.message}" for error in validator.iter_errors(instance)]

    def _check(self, method: str, path: str, answer: Answer) -> None:
        where = f"{method.upper()} {path} -> {answer.status} {answer.code or answer.media_type}"
        response = self.spec["paths"][path][method]["responses"].get(str(answer.status))
        if response is None:
            self.faults.append(f"{where}: status not documented")
            return
        documented_headers = response.get("headers", {})
        for name in API_HEADERS:
            if name.lower() in answer.headers and name not in documented_headers:
                if not (name == "Allow" and answer.status != 405):  # DRF adds Allow to every answer
                    self.faults.append(f"{where}: header {name} not documented")
        for name, header in documented_headers.items():
            if header.get("required") and name.lower() not in answer.headers:
                self.faults.append(f"{where}: required header {name} missing")
        content = response.get("content", {})
        if answer.media_type is None:
            if content or answer.body:
                self.faults.append(f"{where}: answered no body, documented {sorted(content)}")
            return
        if answer.media_type not in content:
            self.faults.append(f"{where}: media type not documented ({sorted(content)})")
            return
        schema_at = pointer("paths", path, method, "responses", str(answer.status), "content", answer.media_type)
        if answer.media_type == NDJSON:
            # One JSON object a line (what Ollama's clients read): each line against the line's schema.
            lines = [json.loads(line) for line in answer.body.decode().splitlines() if line.strip()]
            if not lines:
                self.faults.append(f"{where}: an NDJSON answer without lines")
            for line in lines:
                for error in self._invalid(schema_at + "/schema", line):
                    self.faults.append(f"{where}: line {line}: {error}")
            return
        if answer.media_type == EVENT_STREAM and path.endswith(CHAT_PATH):
            if not answer.events or answer.frames[-1] != {"data": "[DONE]"}:
                self.faults.append(f"{where}: a chat stream without chunks or without [DONE] at its end")
            for chunk in answer.events:
                for error in self._invalid("components/schemas/ChatCompletionChunk", chunk):
                    self.faults.append(f"{where}: chunk {chunk}: {error}")
            for frame in answer.frames:
                for error in self._invalid(schema_at + "/schema", frame):
                    self.faults.append(f"{where}: frame {frame}: {error}")
            return
        if answer.media_type == EVENT_STREAM and path == MESSAGES_PATH:
            kinds = [event.get("type") for event in answer.events]
            if not kinds or kinds[0] != "message_start" or kinds[-1] != "message_stop":
                self.faults.append(f"{where}: a Messages stream not from message_start to message_stop: {kinds}")
            for event in answer.events:
                for error in self._invalid("components/schemas/AnthropicStreamEvent", event):
                    self.faults.append(f"{where}: event {event.get('type')}: {error}")
            for frame in answer.frames:
                for error in self._invalid(schema_at + "/schema", frame):
                    self.faults.append(f"{where}: frame {frame}: {error}")
            return
        if answer.media_type == EVENT_STREAM:
            if not answer.events:
                self.faults.append(f"{where}: a stream without events")
            for event in answer.events:
                for error in self._invalid("components/schemas/StreamEvent", event):
                    self.faults.append(f"{where}: event {event.get('type')}: {error}")
            for frame in answer.frames:
                for error in self._invalid(schema_at + "/schema", frame):
                    self.faults.append(f"{where}: frame {frame.get('id')}: {error}")
            return
        if answer.media_type == "application/octet-stream":
            return  # a file's bytes, as stored: no JSON to check
        for error in self._invalid(schema_at + "/schema", json.loads(answer.body)):
            self.faults.append(f"{where}: {error}")

    def documented(self) -> set[tuple[str, str, int, str | None]]:
        out = set()
        for path, operations in self.spec["paths"].items():
            for method, operation in operations.items():
                for status, response in operation["responses"].items():
                    content = response.get("content")
                    if not content:
                        out.add((method, path, int(status), None))
                    for media_type, body in (content or {}).items():
                        if media_type == PROBLEM:
                            codes = body["schema"]["allOf"][1]["properties"]["code"]["enum"]
                            out.update((method, path, int(status), code) for code in codes)
                        else:
                            out.add((method, path, int(status), media_type))
        return out


class Caller:
    """Requests through Django's test client (in this process) and through the live server."""

    def chat_live(self, path: str, *, token: str, body: Any) -> Answer:
        """A chat completion's stream from the live server: its ``data:`` lines, the chunks parsed."""
        reply = httpx.post(f"{self.base}{path}", json=body, headers={"Authorization": f"Bearer {token}"}, timeout=60)
        frames = [
            {"data": line.removeprefix("data: ")} for line in reply.text.splitlines() if line.startswith("data: ")
        ]
        chunks = [json.loads(frame["data"]) for frame in frames if frame["data"] != "[DONE]"]
        headers = {name.lower(): value for name, value in reply.headers.items()}
        return self.ledger.saw("POST", path, Answer(reply.status_code, headers, reply.content, chunks, frames))

    def ndjson_live(self, path: str, *, token: str, body: Any, base: str | None = None) -> Answer:
        """An Ollama answer from a live server (``base``: another than the session's), read to its end."""
        reply = httpx.post(
            f"{base or self.base}{path}", json=body, headers={"Authorization": f"Bearer {token}"}, timeout=120
        )
        headers = {name.lower(): value for name, value in reply.headers.items()}
        return self.ledger.saw("POST", path, Answer(reply.status_code, headers, reply.content))

    def __init__(self, ledger: Ledger, base: str) -> None:
        self.ledger = ledger
        self.base = base
        self.http = HttpClient()

    def here(
        self,
        method: str,
        path: str,
        *,
        url: str | None = None,
        token: str | None = None,
        body: Any = None,
        raw: str | bytes | None = None,
        content_type: str = "application/json",
        headers: dict[str, str] | None = None,
    ) -> Answer:
        sent = dict(headers or {})
        if token:
            sent["Authorization"] = f"Bearer {token}"
        data = raw if raw is not None else ("" if body is None else json.dumps(body))
        reply = self.http.generic(
            "PATCH" if method == "*" else method, url or fill(path), data, content_type=content_type, headers=sent
        )
        # A file's bytes come streamed from disk; an event stream is read from the live server (through the
        # test client it would never end).
        downloaded = reply.streaming and reply.get("Content-Type") == "application/octet-stream"
        assert downloaded or not reply.streaming, f"{method} {url or path} streamed through the test client"
        body = b"".join(reply.streaming_content) if downloaded else reply.content
        answer = Answer(reply.status_code, {name.lower(): value for name, value in reply.items()}, body)
        return self.ledger.saw(method, path, answer)

    def live(
        self,
        method: str,
        path: str,
        *,
        url: str,
        token: str | None = None,
        body: Any = None,
        headers: dict[str, str] | None = None,
    ) -> Answer:
        with open_stream(self.base, url, token=token, method=method, body=body, headers=headers) as stream:
            parsed = stream.all() if not stream.ended else []
            # A Messages stream puts an id on the last frame made from a task event only.
            frames = [
                {**({"id": str(event.id)} if event.id is not None else {}), "event": event.event, "data": event.data}
                for event in parsed
            ]
            answer = Answer(stream.status, stream.headers, stream.body, [event.payload for event in parsed], frames)
        return self.ledger.saw(method, path, answer)


HUB_REPO = "lmsp-fixtures/qwen2-community"


@contextmanager
def pulling_server(tmp_path: Path, settings: Any) -> Iterator[Any]:
    """A web server of its own whose pulls go to a stand-in Hugging Face Hub holding ``HUB_REPO``."""
    models, repo = tmp_path / "models", tmp_path / "repo"
    models.mkdir()
    shutil.copytree(REPO / "tests" / "fixtures" / "models" / "qwen2-community", repo)
    with hf_hub_stand_in({HUB_REPO: repo}) as hub:
        env = {
            "REDIS_URL": settings.REDIS_URL,
            "LMSP_MODELS_DIR": str(models),
            "HF_ENDPOINT": hub.url,
            "HF_HOME": str(tmp_path / "hf-home"),
            "HF_HUB_DISABLE_TELEMETRY": "1",
        }
        with uvicorn_process(database_url(), env) as server:
            yield server


def _conversations_answered(call: Caller, api: Any, big: str, short: dict[str, Any]) -> None:
    """The Conversations API (PROFILE.md 12.1): each operation's answer, its refusals, unknown ids, a busy
    conversation and a locked database; a response's ``conversation`` refused by name where it must be."""
    conversations = f"{API}conversations"
    one, items = f"{conversations}/{{conversation_id}}", f"{conversations}/{{conversation_id}}/items"
    item = f"{items}/{{item_id}}"
    message = {"type": "message", "role": "user", "content": "Hello"}
    created = json.loads(
        call.here("POST", conversations, token=api.token, body={"items": [message], "metadata": {"k": "v"}}).body
    )
    conversation_url = fill(one, conversation_id=created["id"])
    listed = json.loads(call.here("GET", items, url=f"{conversation_url}/items", token=api.token).body)
    item_url = f"{conversation_url}/items/{listed['data'][0]['id']}"
    for method, path, url, sent in [
        ("POST", conversations, conversations, {"items": [{"type": "computer_call"}]}),
        ("POST", conversations, conversations, {"undeclared": 1}),
        ("GET", one, conversation_url, None),
        ("POST", one, conversation_url, {"metadata": {"k": "w"}}),
        ("POST", one, conversation_url, {"metadata": "no"}),
        ("GET", items, f"{conversation_url}/items?order=asc&limit=1", None),
        ("GET", items, f"{conversation_url}/items?after=msg_nope", None),
        ("GET", items, f"{conversation_url}/items?order=sideways", None),
        ("POST", items, f"{conversation_url}/items", {"items": [message]}),
        ("POST", items, f"{conversation_url}/items", {"items": []}),
        ("POST", items, f"{conversation_url}/items", {"items": [{"type": "web_search_call"}]}),
        ("GET", item, item_url, None),
        ("GET", item, f"{item_url}?include=file_search_call.results", None),
        ("GET", item, f"{conversation_url}/items/msg_nope", None),
    ]:
        call.here(method, path, url=url, token=api.token, body=sent)
    for method, path in [("GET", one), ("POST", one), ("DELETE", one), ("GET", items), ("POST", items)]:
        call.here(method, path, token=api.token, body={"metadata": None} if path == one else {"items": [message]})
    call.here("GET", item, token=api.token)
    call.here("DELETE", item, token=api.token)
    call.here("DELETE", item, url=f"{conversation_url}/items/msg_nope", token=api.token)
    for method, path, url in [
        ("POST", conversations, conversations),
        ("POST", one, conversation_url),
        ("POST", items, f"{conversation_url}/items"),
    ]:
        call.here(method, path, url=url, token=api.token, raw="hello", content_type="text/plain")
        call.here(method, path, url=url, token=api.token, raw=big)
    # A response on it: together with previous_response_id, unstored, unknown, busy (a queued response on it).
    tasks, responses = f"{API}tasks", f"{API}responses"
    for path, envelope in ((responses, lambda r: r), (tasks, lambda r: {"type": "response", "input": r})):
        call.here("POST", path, token=api.token, body=envelope({**short, "conversation": "conv_nope"}))
        together = {**short, "conversation": created["id"], "previous_response_id": "resp_x"}
        call.here("POST", path, token=api.token, body=envelope(together))
        call.here("POST", path, token=api.token, body=envelope({**short, "conversation": {"id": created["id"]}}))
    queued = lifecycle.task_insert(
        client=api.client, request=short, generation=spec_json(short), model="demo", conversation_id=created["id"]
    )
    for path, envelope in ((responses, lambda r: r), (tasks, lambda r: {"type": "response", "input": r})):
        call.here("POST", path, token=api.token, body=envelope({**short, "conversation": created["id"]}))
    with database_write_locked(), lock_wait(0.2):
        call.here("POST", conversations, token=api.token, body={})
        call.here("POST", one, url=conversation_url, token=api.token, body={"metadata": None})
        call.here("POST", items, url=f"{conversation_url}/items", token=api.token, body={"items": [message]})
        call.here("DELETE", item, url=item_url, token=api.token)
        call.here("DELETE", one, url=conversation_url, token=api.token)
    call.here("POST", f"{API}tasks/{{task_id}}/cancel", url=f"{API}tasks/{queued.id}/cancel", token=api.token)
    call.here("DELETE", item, url=item_url, token=api.token)
    call.here("DELETE", one, url=conversation_url, token=api.token)


def _uploaded(name: str, data: bytes, **fields: str) -> bytes:
    return encode_multipart(BOUNDARY, {**fields, "file": SimpleUploadedFile(name, data)})


def _files_and_batches_answered(call: Caller, api: Any, big: str) -> None:
    """Files and the Batch API (PROFILE.md 12.2): each operation's answer and refusals; a batch that runs, is
    cancelled and refuses a second cancel; a file a running batch reads; a locked database."""
    files, batches = f"{API}files", f"{API}batches"
    one_file, content, one_batch = f"{files}/{{file_id}}", f"{files}/{{file_id}}/content", f"{batches}/{{batch_id}}"
    cancel = f"{one_batch}/cancel"
    request = {"model": ENDLESS_MODEL, "input": "Hello", "max_output_tokens": 4000}
    lines = b"".join(
        json.dumps({"custom_id": f"r{i}", "method": "POST", "url": "/v1/responses", "body": request}).encode() + b"\n"
        for i in range(3)
    )

    def upload(data: bytes, **fields: str) -> Answer:
        body = _uploaded("batch.jsonl", data, **fields)
        return call.here("POST", files, token=api.token, raw=body, content_type=MULTIPART_CONTENT)

    uploaded = json.loads(upload(lines, purpose="batch").body)
    broken = json.loads(upload(b"not json\n", purpose="batch").body)
    upload(lines)
    with override_settings(LMSP_MAX_FILE_BYTES=10):
        upload(lines, purpose="batch")
    call.here("GET", files, token=api.token)
    call.here("GET", files, url=f"{files}?limit=0", token=api.token)
    file_url = fill(one_file, file_id=uploaded["id"])
    call.here("GET", one_file, url=file_url, token=api.token)
    call.here("GET", content, url=f"{file_url}/content", token=api.token)
    call.here("GET", one_file, token=api.token)
    call.here("GET", content, token=api.token)

    asked = {"input_file_id": uploaded["id"], "endpoint": "/v1/responses", "completion_window": "24h"}
    running = json.loads(call.here("POST", batches, token=api.token, body=asked).body)
    failed = json.loads(call.here("POST", batches, token=api.token, body={**asked, "input_file_id": broken["id"]}).body)
    call.here("POST", batches, token=api.token, body={**asked, "completion_window": "1h"})
    call.here("POST", batches, token=api.token, body={**asked, "input_file_id": "file-nope"})
    call.here("POST", batches, token=api.token, raw="hello", content_type="text/plain")
    call.here("POST", batches, token=api.token, raw=big)
    call.here("GET", batches, token=api.token)
    call.here("GET", batches, url=f"{batches}?limit=0", token=api.token)
    batch_url = fill(one_batch, batch_id=running["id"])
    call.here("GET", one_batch, url=batch_url, token=api.token)
    call.here("GET", one_batch, token=api.token)
    call.here("DELETE", one_file, url=file_url, token=api.token)
    with database_write_locked(), lock_wait(0.2):
        upload(lines, purpose="batch")
        call.here("POST", batches, token=api.token, body=asked)
        call.here("POST", cancel, url=f"{batch_url}/cancel", token=api.token)
        call.here("DELETE", one_file, url=fill(one_file, file_id=broken["id"]), token=api.token)
    call.here("POST", cancel, url=f"{batch_url}/cancel", token=api.token)
    call.here("POST", cancel, url=f"{batch_url}/cancel", token=api.token, raw=big)
    call.here("POST", cancel, url=fill(cancel, batch_id=failed["id"]), token=api.token)
    call.here("POST", cancel, token=api.token)
    call.here("DELETE", one_file, url=fill(one_file, file_id=broken["id"]), token=api.token)
    call.here("DELETE", one_file, token=api.token)


def test_every_answer_is_documented_and_every_documented_answer_happens(
    spec, api, make_client, running_worker, web_server, settings, tmp_path
):
    ledger = Ledger(spec)
    call = Caller(ledger, web_server.base)
    _, read_only = make_client("reader", scopes="read")
    _, write_only = make_client("writer", scopes="responses")
    tasks, responses = f"{API}tasks", f"{API}responses"
    task_path, response_path = f"{API}tasks/{{task_id}}", f"{API}responses/{{response_id}}"
    cancel_path, events_path = f"{task_path}/cancel", f"{task_path}/events"
    token_path, pair = f"{task_path}/stream_token", f"{API}pair"
    big = "x" * (settings.LMSP_MAX_REQUEST_BYTES + 1)

    # Every operation as nobody, with an unknown token, and with each single scope: refused exactly
    # as its security requirement says. And a method no path serves, on every path.
    scope_of = {None: None, UNKNOWN_TOKEN: None, read_only: "read", write_only: "responses"}
    for path, operations in spec["paths"].items():
        for method, operation in operations.items():
            needed = [scopes for alternative in operation["security"] for scopes in alternative.get("bearerAuth", [])]
            bearer = any("bearerAuth" in alternative for alternative in operation["security"])
            for token, scope in scope_of.items():
                answer = call.here(method.upper(), path, token=token)
                if not bearer:
                    expected = None
                elif scope is None:
                    expected = 401
                else:
                    expected = None if scope in needed else 403
                refused = answer.status if answer.status in (401, 403) else None
                if refused != expected:
                    ledger.faults.append(f"{method.upper()} {path} with scope {scope}: {answer.status}, not {expected}")
        call.here("*", path)

    # A task that ran to the end on the live worker.
    body = {"type": "response", "input": {"model": "demo", "input": "Hello", **SHORT}}
    done = wait_for_status(api, api.post(tasks, body).json()["id"], TERMINAL)
    assert done["status"] == "succeeded", done
    done_url, last = fill(task_path, done["id"]), Task.objects.get(pk=done["id"]).last_sequence

    # POST /tasks
    call.here("POST", tasks, token=api.token, body=body, headers={"Idempotency-Key": "k-task"})
    call.here("POST", tasks, token=api.token, body=body, headers={"Idempotency-Key": "k-task"})
    other_body = {**body, "on_restart": "retry"}
    call.here("POST", tasks, token=api.token, body=other_body, headers={"Idempotency-Key": "k-task"})
    call.here("POST", tasks, token=api.token, raw="{not json")
    call.here("POST", tasks, token=api.token, body={**body, "input": {**body["input"], "model": "nope"}})
    call.here("POST", tasks, token=api.token, raw="hello", content_type="text/plain")
    call.here("POST", tasks, token=api.token, raw=big)
    with override_settings(LMSP_MAX_QUEUED_TASKS=0):
        call.here("POST", tasks, token=api.token, body=body)
    demo = ModelRecord.objects.get(name="demo")
    capabilities = demo.capabilities
    ModelRecord.objects.filter(pk=demo.pk).update(capabilities={**capabilities, "resumable_snapshots": False})
    try:
        call.here("POST", tasks, token=api.token, body={**body, "on_restart": "resume"})
    finally:
        ModelRecord.objects.filter(pk=demo.pk).update(capabilities=capabilities)

    # GET /tasks, GET /models
    call.here("GET", tasks, url=f"{tasks}?limit=0", token=api.token)
    call.here("GET", f"{API}models", url=f"{API}models?limit=0", token=api.token)
    call.here("GET", f"{API}models/{{model_id}}", url=f"{API}models/demo:latest", token=api.token)
    call.here("GET", f"{API}models/{{model_id}}", url=f"{API}models/nope", token=api.token)

    # One task: read, mint a stream token, cancel (a finished one cannot be), oversized bodies.
    call.here("GET", task_path, url=done_url, token=api.token)
    call.here("POST", token_path, url=f"{done_url}/stream_token", token=api.token)
    call.here("POST", token_path, url=f"{done_url}/stream_token", token=api.token, raw=big)
    call.here("POST", cancel_path, url=f"{done_url}/cancel", token=api.token)
    call.here("POST", cancel_path, url=f"{done_url}/cancel", token=api.token, raw=big)

    # Event streams: the whole log (live), the end (204), cursors, stream tokens.
    events_url = f"{done_url}/events"
    call.live("GET", events_path, url=events_url, token=api.token)
    call.here("GET", events_path, url=events_url, token=api.token, headers={"Last-Event-ID": str(last)})
    call.here("GET", events_path, url=f"{events_url}?starting_after=soon", token=api.token)
    call.here("GET", events_path, url=f"{events_url}?starting_after={last + 1}", token=api.token)
    call.here("GET", events_path, url=f"{events_url}?token=forged")

    # GET /responses/{id}: the object, its events, the end, a bad flag.
    stored_url = fill(response_path, response_id=done["response_id"])
    call.here("GET", response_path, url=stored_url, token=api.token)
    call.live("GET", response_path, url=f"{stored_url}?stream=true", token=api.token)
    call.here("GET", response_path, url=f"{stored_url}?stream=true&starting_after={last}", token=api.token)
    call.here("GET", response_path, url=f"{stored_url}?stream=maybe", token=api.token)

    # POST /responses: streamed (live), its retry from the end and from the start, another body.
    request = {"model": "demo", "input": "Hello", "stream": True, **SHORT}
    keyed = {"Idempotency-Key": "k-stream"}
    streamed = call.live("POST", responses, url=responses, token=api.token, body=request, headers=keyed)
    stream_last = streamed.events[-1]["sequence_number"]
    at_end = {**keyed, "Last-Event-ID": str(stream_last)}
    call.live("POST", responses, url=responses, token=api.token, body=request, headers=at_end)
    call.live("POST", responses, url=responses, token=api.token, body=request, headers=keyed)
    call.here("POST", responses, token=api.token, body={**request, "seed": 1}, headers=keyed)
    call.here("POST", responses, token=api.token, body={**request, "model": "nope"})
    call.here("POST", responses, token=api.token, raw="hello", content_type="text/plain")
    call.here("POST", responses, token=api.token, raw=big)
    with override_settings(LMSP_MAX_QUEUED_TASKS=0):
        call.here("POST", responses, token=api.token, body=request)

    # A client that holds as many open streams as allowed is refused one more (429 too_many_streams).
    with override_settings(LMSP_MAX_STREAMS_PER_CLIENT=0):
        call.here("GET", events_path, url=events_url, token=api.token)
        call.here("GET", response_path, url=f"{stored_url}?stream=true", token=api.token)
        call.here("POST", responses, token=api.token, body=request)

    # A waiting POST /responses (live) holds its key: a second one with it meanwhile is 409. Its long
    # generation is then cancelled (200), and the waiting request answers the cancelled response.
    waiting = {"model": ENDLESS_MODEL, "input": "A long story", "max_output_tokens": 8000}
    held = {"Idempotency-Key": "k-wait"}
    with ThreadPoolExecutor(1) as pool:
        first = pool.submit(call.live, "POST", responses, url=responses, token=api.token, body=waiting, headers=held)
        record = wait_until(
            lambda: IdempotencyKey.objects.filter(key="k-wait", task__isnull=False).first(),
            what="the waiting request never claimed its key",
        )
        call.here("POST", responses, token=api.token, body=waiting, headers=held)
        call.here("POST", cancel_path, url=fill(cancel_path, record.task_id), token=api.token)
        assert first.result().status == 200

    # Background responses (PROFILE.md section 9): answered queued; cancel twice; delete; what cannot be.
    response_cancel = f"{response_path}/cancel"
    background = {"model": ENDLESS_MODEL, "input": "A long story", "max_output_tokens": 8000, "background": True}
    queued = call.here("POST", responses, token=api.token, body=background)
    running_id = json.loads(queued.body)["id"]
    wait_until(lambda: Task.objects.filter(response_id=running_id, status="running").exists(), what="never ran")
    call.here("DELETE", response_path, url=fill(response_path, response_id=running_id), token=api.token)
    call.here("POST", response_cancel, url=fill(response_cancel, response_id=running_id), token=api.token)
    call.here("POST", response_cancel, url=fill(response_cancel, response_id=running_id), token=api.token)
    call.here("POST", response_cancel, url=f"{stored_url}/cancel", token=api.token)
    call.here("POST", response_cancel, url=f"{stored_url}/cancel", token=api.token, raw=big)
    call.here("POST", response_cancel, url=fill(response_cancel, response_id="resp_nope"), token=api.token)
    call.here("DELETE", response_path, url=fill(response_path, response_id=running_id), token=api.token)
    call.here("DELETE", response_path, url=fill(response_path, response_id=running_id), token=api.token)
    call.here("POST", responses, token=api.token, body={**background, "store": False})
    ModelRecord.objects.filter(pk=demo.pk).update(capabilities={**capabilities, "resumable_snapshots": False})
    try:
        call.here("POST", responses, token=api.token, body={**request, "model": "demo", "on_restart": "resume"})
    finally:
        ModelRecord.objects.filter(pk=demo.pk).update(capabilities=capabilities)

    # Conversations (PROFILE.md 10.2) and what the service refuses by name (10.1), on both endpoints.
    pending = lifecycle.task_insert(
        client=api.client, request=body["input"], generation=spec_json(body["input"]), model="demo"
    )
    short = {"model": "demo", "input": "Hello", **SHORT}
    for path, envelope in ((responses, lambda r: r), (tasks, lambda r: {"type": "response", "input": r})):
        call.here("POST", path, token=api.token, body=envelope({**short, "previous_response_id": "resp_nope"}))
        call.here("POST", path, token=api.token, body=envelope({**short, "previous_response_id": pending.response_id}))
        uncompilable = {"type": "json_schema", "name": "out", "schema": {"type": "frob"}}
        call.here("POST", path, token=api.token, body=envelope({**short, "text": {"format": uncompilable}}))
        cut = {**short, "text": {"format": {"type": "json_object"}}, "stop": ["}"]}
        call.here("POST", path, token=api.token, body=envelope(cut))

    # POST /chat/completions (PROFILE.md 10.3): waited for, streamed, refused, failed, cancelled, limited.
    chat = f"{API}chat/completions"
    chat_body = {"model": "demo", "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 2}
    call.here("POST", chat, token=api.token, body=chat_body)
    call.chat_live(chat, token=api.token, body={**chat_body, "stream": True, "stream_options": {"include_usage": True}})
    call.here("POST", chat, token=api.token, body={**chat_body, "n": 2})
    call.here("POST", chat, token=api.token, body={**chat_body, "model": "nope"})
    call.here("POST", chat, token=api.token, body={**chat_body, "messages": []})
    call.here("POST", chat, token=api.token, raw="hello", content_type="text/plain")
    call.here("POST", chat, token=api.token, raw=big)
    context = ModelRecord.objects.get(name="demo").config["max_position_embeddings"]
    too_long = {**chat_body, "messages": [{"role": "user", "content": "Hello " * context}]}
    call.here("POST", chat, token=api.token, body=too_long)
    with override_settings(LMSP_MAX_QUEUED_TASKS=0):
        call.here("POST", chat, token=api.token, body=chat_body)
    with override_settings(LMSP_MAX_STREAMS_PER_CLIENT=0):
        call.here("POST", chat, token=api.token, body={**chat_body, "stream": True})
    with database_write_locked(), lock_wait(0.2):
        call.here("POST", chat, token=api.token, body=chat_body)
    # A waiting chat completion whose generation is cancelled (by an operator) answers 409.
    endless_chat = {**chat_body, "model": ENDLESS_MODEL, "max_tokens": 8000}
    with ThreadPoolExecutor(1) as pool:
        before = set(Task.objects.values_list("id", flat=True))
        waiting_chat = pool.submit(call.here, "POST", chat, token=api.token, body=endless_chat)
        chat_task = wait_until(
            lambda: Task.objects.exclude(id__in=before).filter(status="running").first(),
            what="the waiting chat completion never ran",
        )
        call.here("POST", cancel_path, url=fill(cancel_path, chat_task.id), token=api.token)
        assert waiting_chat.result().status == 409

    # POST /messages (PROFILE.md 11.1): Anthropic's shapes, its errors included, waited for and streamed.
    message = {"model": "demo", "max_tokens": 2, "messages": [{"role": "user", "content": "Hello"}]}
    call.here("POST", MESSAGES_PATH, token=api.token, body=message)
    streamed_message = {**message, "stream": True}
    message_key = {"Idempotency-Key": "k-message"}
    call.live("POST", MESSAGES_PATH, url=MESSAGES_PATH, token=api.token, body=streamed_message, headers=message_key)
    call.here("POST", MESSAGES_PATH, token=api.token, body={**streamed_message, "top_k": 3}, headers=message_key)
    # Its retry from its terminal event: nothing is left to send.
    last = Task.objects.order_by("-id").values_list("last_sequence", flat=True).first()
    ended = {**message_key, "Last-Event-ID": str(last)}
    assert call.here("POST", MESSAGES_PATH, token=api.token, body=streamed_message, headers=ended).status == 204
    call.here("POST", MESSAGES_PATH, token=api.token, body={**message, "model": "nope"})
    call.here("POST", MESSAGES_PATH, token=api.token, body={**message, "container": "c"})
    call.here("POST", MESSAGES_PATH, token=api.token, raw="hello", content_type="text/plain")
    call.here("POST", MESSAGES_PATH, token=api.token, raw=big)
    with override_settings(LMSP_MAX_QUEUED_TASKS=0):
        call.here("POST", MESSAGES_PATH, token=api.token, body=message)
    with override_settings(LMSP_MAX_STREAMS_PER_CLIENT=0):
        call.here("POST", MESSAGES_PATH, token=api.token, body=streamed_message)
    with database_write_locked(), lock_wait(0.2):
        call.here("POST", MESSAGES_PATH, token=api.token, body=message)
    # A waiting message whose generation is cancelled (by an operator) answers 409.
    endless_message = {**message, "model": ENDLESS_MODEL, "max_tokens": 8000}
    with ThreadPoolExecutor(1) as pool:
        before = set(Task.objects.values_list("id", flat=True))
        waiting_message = pool.submit(call.here, "POST", MESSAGES_PATH, token=api.token, body=endless_message)
        message_task = wait_until(
            lambda: Task.objects.exclude(id__in=before).filter(status="running").first(),
            what="the waiting message never ran",
        )
        call.here("POST", cancel_path, url=fill(cancel_path, message_task.id), token=api.token)
        assert waiting_message.result().status == 409
    call.here("POST", COUNT_TOKENS_PATH, token=api.token, body={"model": "demo", "messages": message["messages"]})
    call.here("POST", COUNT_TOKENS_PATH, token=api.token, body={"model": "demo", "messages": []})
    call.here("POST", COUNT_TOKENS_PATH, token=api.token, raw="hello", content_type="text/plain")
    call.here("POST", COUNT_TOKENS_PATH, token=api.token, raw=big)

    # Ollama's native API (PROFILE.md 11.2, docs/ollama.md): its catalog, its generations waited for, streamed,
    # refused, limited and cancelled, every error in Ollama's shape.
    call.here("GET", "/api/version")
    call.here("GET", "/api/tags", token=api.token)
    call.here("GET", "/api/ps", token=api.token)
    call.here("POST", "/api/show", token=api.token, body={"model": "demo"})
    call.here("POST", "/api/show", token=api.token, body={"model": "nope"})
    call.here("POST", "/api/show", token=api.token, body={"verbose": "yes"})
    call.here("POST", "/api/show", token=api.token, raw=big)
    hello = [{"role": "user", "content": "Hello"}]
    for path, asks in (("/api/chat", {"messages": hello}), ("/api/generate", {"prompt": "Hello"})):
        ask = {"model": "demo", **asks, "options": {"num_predict": 2}}
        waited = {**ask, "stream": False}
        call.here("POST", path, token=api.token, body=waited)
        call.ndjson_live(path, token=api.token, body=ask)
        call.here("POST", path, token=api.token, body={"model": "demo", "stream": False})  # a load request
        call.here("POST", path, token=api.token, body={**waited, "model": "nope"})
        call.here("POST", path, token=api.token, body={**waited, "think": True})
        call.here("POST", path, token=api.token, raw="{not json", content_type="text/plain")
        call.here("POST", path, token=api.token, raw=big)
        with override_settings(LMSP_MAX_QUEUED_TASKS=0):
            call.here("POST", path, token=api.token, body=waited)
        with override_settings(LMSP_MAX_STREAMS_PER_CLIENT=0):
            call.here("POST", path, token=api.token, body=ask)
        with database_write_locked(), lock_wait(0.2):
            call.here("POST", path, token=api.token, body=waited)
        # A waiting generation whose task is cancelled (by an operator) answers 409.
        endless = {**waited, "model": ENDLESS_MODEL, "options": {"num_predict": 8000}}
        with ThreadPoolExecutor(1) as pool:
            before = set(Task.objects.values_list("id", flat=True))
            waiting_ollama = pool.submit(call.here, "POST", path, token=api.token, body=endless)
            ollama_task = wait_until(
                lambda before=before: Task.objects.exclude(id__in=before).filter(status="running").first(),
                what=f"the waiting {path} never ran",
            )
            call.here("POST", cancel_path, url=fill(cancel_path, ollama_task.id), token=api.token)
            assert waiting_ollama.result().status == 409
    # POST /api/pull (admin): a library name is no repository; a body too large.
    _, admin = make_client("root", scopes="admin")
    call.here("POST", "/api/pull", token=admin, body={"model": "llama3.2"})
    call.here("POST", "/api/pull", token=admin, raw=big)

    # POST /pair: a real code, then bad ones until the rate limit answers.
    _, code = pairing_code_create(scopes="read")
    call.here("POST", pair, body={"code": code, "client_name": "phone"})
    call.here("POST", pair, raw="hello", content_type="text/plain")
    call.here("POST", pair, raw=big)
    for _ in range(50):
        if call.here("POST", pair, body={"code": "0000-0000", "client_name": "x"}).status == 429:
            break
    # Without Redis the rate limit cannot be counted, so pairing is refused (503), not let through.
    with override_settings(REDIS_URL=f"redis://127.0.0.1:{free_port()}/0"):
        call.here("POST", pair, body={"code": code, "client_name": "tablet"})

    # Webhook endpoints (docs/webhooks.md): each operation's answer, its refusals and an unknown id.
    hooks, hook_path = f"{API}webhook_endpoints", f"{API}webhook_endpoints/{{webhook_endpoint_id}}"
    rotate_path = f"{hook_path}/rotate_secret"
    hook_body = {"name": "n", "url": "https://hooks.example.invalid/x", "event_types": ["response.completed"]}
    hook_id = json.loads(call.here("POST", hooks, token=api.token, body=hook_body).body)["id"]
    hook_url = fill(hook_path, webhook_endpoint_id=hook_id)
    call.here("POST", hooks, token=api.token, body={**hook_body, "url": "http://127.0.0.1/x"})
    call.here("POST", hooks, token=api.token, raw="hello", content_type="text/plain")
    call.here("POST", hooks, token=api.token, raw=big)
    call.here("GET", hooks, token=api.token)
    call.here("GET", hooks, url=f"{hooks}?limit=0", token=api.token)
    for method, path, url, sent in [
        ("GET", hook_path, hook_url, None),
        ("POST", hook_path, hook_url, {"name": "renamed"}),
        ("POST", rotate_path, f"{hook_url}/rotate_secret", {}),
    ]:
        call.here(method, path, url=url, token=api.token, body=sent)
        call.here(method, path, token=api.token, body=sent)
        if method == "POST":
            call.here(method, path, url=url, token=api.token, body={"undeclared": 1})
            call.here(method, path, url=url, token=api.token, raw="hello", content_type="text/plain")
            call.here(method, path, url=url, token=api.token, raw=big)
    call.here("DELETE", hook_path, token=api.token)
    # A sample event: the endpoint's host does not resolve (502), then a receiver answers (200).
    test_path, sample = f"{hook_path}/test", {"event_type": "response.completed"}
    call.here("POST", test_path, url=f"{hook_url}/test", token=api.token, body=sample)
    call.here("POST", test_path, token=api.token, body=sample)
    call.here("POST", test_path, url=f"{hook_url}/test", token=api.token, body={"event_type": "batch.unknown"})
    call.here("POST", test_path, url=f"{hook_url}/test", token=api.token, raw="hello", content_type="text/plain")
    call.here("POST", test_path, url=f"{hook_url}/test", token=api.token, raw=big)
    with receiving() as receiver, override_settings(LMSP_WEBHOOK_ALLOW_PRIVATE_TARGETS=True):
        answering = json.loads(call.here("POST", hooks, token=api.token, body={**hook_body, "url": receiver.url}).body)
        call.here("POST", test_path, url=f"{API}webhook_endpoints/{answering['id']}/test", token=api.token, body=sample)
    assert len(receiver.received) == 1
    call.here("GET", f"{API}webhook_event_types", token=api.token)

    _conversations_answered(call, api, big, short)
    _files_and_batches_answered(call, api, big)

    # A writer frozen with the database's lock (a stopped process): every write waits its bounded time,
    # answers 503 service_unavailable with Retry-After, and writes nothing.
    waiting_task = lifecycle.task_insert(
        client=api.client, request=body["input"], generation=spec_json(body["input"]), model="demo"
    )
    with database_write_locked(), lock_wait(0.2):
        call.here("POST", hooks, token=api.token, body=hook_body)
        call.here("POST", hook_path, url=hook_url, token=api.token, body={"name": "locked"})
        call.here("POST", rotate_path, url=f"{hook_url}/rotate_secret", token=api.token, body={})
        call.here("DELETE", hook_path, url=hook_url, token=api.token)
        call.here("POST", tasks, token=api.token, body=body)
        call.here("POST", cancel_path, url=fill(cancel_path, waiting_task.id), token=api.token)
        call.here("POST", responses, token=api.token, body={**request, "stream": False})
        waiting_cancel = fill(response_cancel, response_id=waiting_task.response_id)
        call.here("POST", response_cancel, url=waiting_cancel, token=api.token)
        call.here("DELETE", response_path, url=stored_url, token=api.token)

    call.here("DELETE", hook_path, url=hook_url, token=api.token)

    # Retention removes the finished tasks' events: every way to read them is 410 now.
    settings.LMSP_EVENT_RETENTION_SECONDS = 0
    assert retention_cleanup().events > 0
    call.here("GET", events_path, url=events_url, token=api.token)
    call.here("GET", response_path, url=f"{stored_url}?stream=true", token=api.token)
    call.here("POST", responses, token=api.token, body=request, headers=keyed)
    call.here("POST", MESSAGES_PATH, token=api.token, body=streamed_message, headers=message_key)

    # Pulls that run (last: the pulling server's start scans its own empty models folder, which unregisters
    # the session's models): streamed and waited for, from a stand-in Hub, and one of a missing repository.
    with pulling_server(tmp_path, settings) as puller:
        for pulled in ({"model": f"hf.co/{HUB_REPO}"}, {"model": HUB_REPO, "stream": False}):
            assert call.ndjson_live("/api/pull", token=admin, body=pulled, base=puller.base).status == 200
        missing = {"model": "hf.co/lmsp-fixtures/missing", "stream": False}
        assert call.ndjson_live("/api/pull", token=admin, body=missing, base=puller.base).status == 500

    assert ledger.faults == []
    unproduced = {
        entry
        for entry in ledger.documented() - ledger.seen
        if entry not in CANNOT_PRODUCE and entry[2:] not in CANNOT_PRODUCE_ANYWHERE
    }
    assert sorted(unproduced) == []
