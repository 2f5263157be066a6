"""``GET /`` and ``GET /lmsp/v1`` (the address the quick start prints): a way in for a newcomer."""

from __future__ import annotations

import json

import pytest
from django.conf import settings
from django.test import Client as HttpClient

BROWSER_ACCEPT = "text/html,application/xhtml+xml,application/xml;q=0.9,image/avif,image/webp,*/*;q=0.8"
LINKS = {
    "docs": "http://testserver/lmsp/v1/docs",
    "openapi": "http://testserver/lmsp/v1/openapi.json",
    "admin": "http://testserver/admin/",
    "health": "http://testserver/healthz",
    "metrics": "http://testserver/metrics",
}


@pytest.mark.parametrize("path", ["/", "/lmsp/v1"])
@pytest.mark.parametrize("accept", ["application/json", "*/*", None])
def test_an_api_client_gets_the_links_as_json_without_a_token(db, path, accept):
    headers = {} if accept is None else {"Accept": accept}
    reply = HttpClient().get(path, headers=headers)

    assert reply.status_code == 200
    assert reply["Content-Type"] == "application/json"
    assert "Accept" in reply["Vary"]
    body = reply.json()
    assert body["links"] == LINKS
    assert body["api"] == "http://testserver/lmsp/v1"
    # The README's first request, against this server.
    assert "curl -s -X POST http://testserver/lmsp/v1/tasks" in body["example"]
    assert '"on_restart":"fail"' in body["example"]


def test_a_browser_gets_a_page_whose_links_all_answer(db):
    http = HttpClient()
    reply = http.get("/lmsp/v1", headers={"Accept": BROWSER_ACCEPT})

    assert reply.status_code == 200
    assert reply["Content-Type"].startswith("text/html")
    page = reply.content.decode()
    for url in LINKS.values():
        assert f'href="{url}"' in page, url
    assert "curl -s -X POST http://testserver/lmsp/v1/tasks" in page
    for name, url in LINKS.items():
        answer = http.get(url.removeprefix("http://testserver"))
        # The admin sends a browser without a session to its login page.
        assert answer.status_code == (302 if name == "admin" else 200), (name, answer.status_code)


def test_it_shows_no_secret(db):
    for accept in ("application/json", BROWSER_ACCEPT):
        text = HttpClient().get("/", headers={"Accept": accept}).content.decode()
        assert settings.SECRET_KEY not in text
        assert str(settings.DATA_DIR) not in text
        assert settings.DATABASES["default"]["NAME"] not in text


def test_other_methods_get_a_problem(db):
    reply = HttpClient().post("/lmsp/v1", data="{}", content_type="application/json")

    assert reply.status_code == 405
    assert reply["Content-Type"] == "application/problem+json"
    assert reply.json()["code"] == "method_not_allowed"
    assert reply["Allow"] == "GET, HEAD"


def test_the_landing_page_is_not_part_of_the_api_schema(db):
    schema = json.loads(HttpClient().get("/lmsp/v1/openapi.json").content)

    assert "/" not in schema["paths"] and "/lmsp/v1" not in schema["paths"]
    # LMSP's own routes and the protocols' under it; Ollama's at /api/, where its clients look.
    assert all(path.startswith(("/lmsp/v1/", "/api/")) for path in schema["paths"])
