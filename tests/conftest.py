"""Shared fixtures: a real database (SQLite file or PostgreSQL), a real demo model."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from django.db import connection
from django.test import Client as HttpClient

from tasks_app.models import Client, ModelRecord
from tasks_app.services.clients import client_create
from tasks_app.services.models import model_scan


def pytest_report_header(config: pytest.Config) -> str:
    from django.conf import settings

    db = settings.DATABASES["default"]
    return f"lmsp database: {db['ENGINE'].rsplit('.', 1)[-1]} {db.get('HOST') or ''}"


@pytest.fixture(scope="session")
def demo_models_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A models folder holding the real demo model, built once per run."""
    from workers.demo_model import build_demo_model

    root = tmp_path_factory.mktemp("models")
    build_demo_model(root / "demo", size="demo")
    return root


@pytest.fixture
def models_dir(demo_models_root: Path, settings) -> Path:
    settings.LMSP_MODELS_DIR = demo_models_root
    return demo_models_root


@pytest.fixture
def demo_model(db, models_dir: Path) -> ModelRecord:
    model_scan(models_dir=models_dir)
    return ModelRecord.objects.get(name="demo")


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


@pytest.fixture
def make_client(db) -> Callable[..., tuple[Client, str]]:
    counter = {"n": 0}

    def make(name: str | None = None, scopes: str = "responses,read") -> tuple[Client, str]:
        counter["n"] += 1
        return client_create(name=name or f"client-{counter['n']}", scopes=scopes)

    return make


@pytest.fixture
def api(make_client, demo_model) -> ApiClient:
    client, token = make_client("alice")
    return ApiClient(token, client)


@pytest.fixture
def other_api(make_client, demo_model) -> ApiClient:
    client, token = make_client("bob")
    return ApiClient(token, client)


def is_postgres() -> bool:
    return connection.vendor == "postgresql"
