"""Creating tasks over the HTTP API and waiting on their status."""

from __future__ import annotations

from typing import Any

from tests.support.waiting import wait_until


def wait_for_status(api, task_id: str, wanted: set[str]) -> dict[str, Any]:
    def probe() -> dict[str, Any] | None:
        body = api.get(f"/lmsp/v1/tasks/{task_id}").json()
        return body if body["status"] in wanted else None

    return wait_until(probe, what=f"task {task_id} never reached {sorted(wanted)}")


def create(api, prompt: str = "Tell me a story", **request: Any) -> dict[str, Any]:
    response = api.post("/lmsp/v1/tasks", {"type": "response", "input": {"model": "demo", "input": prompt, **request}})
    assert response.status_code == 202, response.content
    return response.json()
