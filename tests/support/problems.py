"""Assertions on RFC 9457 problem responses."""

from __future__ import annotations

import json

PROBLEM_KEYS = {"type", "title", "status", "detail", "code", "instance"}


def assert_problem(response, status: int, code: str) -> dict:
    """An RFC 9457 problem with this status and code; returns the body."""
    assert response.status_code == status, (response.status_code, response.content[:500])
    assert response["Content-Type"].split(";")[0].strip() == "application/problem+json"
    body = json.loads(response.content)
    assert PROBLEM_KEYS <= set(body), body
    assert body["status"] == status
    assert body["code"] == code
    assert body["type"].endswith(code)
    assert isinstance(body["title"], str) and body["title"]
    assert isinstance(body["detail"], str) and body["detail"]
    assert body["instance"] == response.wsgi_request.path
    assert "Traceback" not in response.content.decode()
    if "errors" in body:
        assert isinstance(body["errors"], list) and body["errors"]
        for error in body["errors"]:
            assert set(error) == {"field", "message"}, error
            assert isinstance(error["field"], str) and isinstance(error["message"], str)
    return body
