"""POST /responses keys survive the death of the request that waited on them (no worker here)."""

from __future__ import annotations

from tasks_app.services.idempotency import request_digest
from tasks_app.services.responses import response_start
from tests.support.specs import spec_of

BODY = {"model": "demo", "input": "Hello", "max_output_tokens": 5}


def test_a_key_whose_waiter_died_is_answered_once_its_task_ended(api):
    # The first request was accepted, then its web process died while waiting.
    started = response_start(
        client=api.client, request=BODY, spec=spec_of(BODY), idempotency_key="orphan", request_hash=request_digest(BODY)
    )
    headers = {"Idempotency-Key": "orphan"}

    while_running = api.post("/lmsp/v1/responses", BODY, headers=headers)

    assert while_running.status_code == 409
    assert while_running.json()["code"] == "idempotency_key_in_use"
    assert api.post(f"/lmsp/v1/tasks/{started.task_id}/cancel").json()["status"] == "cancelled"

    after = api.post("/lmsp/v1/responses", BODY, headers=headers)

    assert after.status_code == 200
    assert after["Idempotent-Replayed"] == "true"
    body = after.json()
    assert body["id"] == api.get(f"/lmsp/v1/tasks/{started.task_id}").json()["response_id"]
    assert body["status"] == "cancelled"
    assert api.post("/lmsp/v1/responses", BODY, headers=headers).content == after.content
