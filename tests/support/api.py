"""Django's test client for the JSON API, authenticated as one client."""

from __future__ import annotations

import json
from typing import Any

from django.test import Client as HttpClient

from tasks_app.models import Client


class ApiClient:
    """Django's test client speaking JSON with one bearer token."""

    def __init__(self, token: str | None, client: Client | None = None) -> None:
        self.token = token
        self.client = client
        self.http = HttpClient()

    def _headers(self, headers: dict[str, str] | None) -> dict[str, str]:
        out = {"Authorization": f"Bearer {self.token}"} if self.token else {}
        out.update(headers or {})
        return out

    def get(self, path: str, headers: dict[str, str] | None = None, **params: Any):
        return self.http.get(path, params, headers=self._headers(headers))

    def post(
        self,
        path: str,
        body: Any = None,
        headers: dict[str, str] | None = None,
        raw: str | bytes | None = None,
        content_type: str = "application/json",
    ):
        data = raw if raw is not None else ("" if body is None else json.dumps(body))
        return self.http.post(path, data=data, content_type=content_type, headers=self._headers(headers))

    def create_task(self, prompt: str = "Hello", headers: dict[str, str] | None = None, **envelope: Any):
        body = {"type": "response", "input": {"model": "demo", "input": prompt}, **envelope}
        return self.post("/lmsp/v1/tasks", body, headers=headers)
