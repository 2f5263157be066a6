"""OpenAI's Files and Batch API (PROFILE.md 12.2; docs/batches.md), with the ``openai`` package as the client.

A real web server (its batch keeper feeds the lines and writes the files)
and a real worker: every line's result is in the output or the error file
exactly once, the counts agree with the files at every read, cancel and
expiry end what is left, a file that does not validate fails the batch, an
upload cut off leaves nothing behind, and another client sees nothing.
"""

from __future__ import annotations

import io
import json
import os
import socket
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import openai
import pytest
from django.utils import timezone

from tasks_app.models import (
    Batch,
    BatchLine,
    File,
    WebhookDelivery,
    WebhookEndpoint,
    WorkerNode,
    WorkerNodeState,
)
from tasks_app.registry.scan import model_scan
from tasks_app.selectors.workers import worker_rows_online
from tasks_app.services.workers import worker_node_report
from tests.support.db import database_url, frozen_between_transactions
from tests.support.demo import ENDLESS_MODEL
from tests.support.namespace import REDIS_PREFIX
from tests.support.server import uvicorn_process
from tests.support.tasks import create
from tests.support.waiting import wait_until
from tests.support.worker import kill_process_group

SMALL = {"max_output_tokens": 6}


def sdk_for(base: str, token: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base}/lmsp/v1", api_key=token, max_retries=0, timeout=60)


@pytest.fixture
def sdk(api, web_server) -> openai.OpenAI:
    return sdk_for(web_server.base, api.token)


def jsonl(lines: list[Any]) -> bytes:
    return b"".join((line if isinstance(line, bytes) else json.dumps(line).encode()) + b"\n" for line in lines)


def line(custom_id: str, url: str, body: dict[str, Any]) -> dict[str, Any]:
    return {"custom_id": custom_id, "method": "POST", "url": url, "body": body}


def upload(sdk: openai.OpenAI, data: bytes, name: str = "batch.jsonl") -> Any:
    return sdk.files.create(file=(name, io.BytesIO(data)), purpose="batch")


def ended(sdk: openai.OpenAI, batch_id: str, timeout: float = 90) -> Any:
    """``retrieve`` until the batch ended; the counts never exceed the total on the way."""

    def probe() -> Any:
        batch = sdk.batches.retrieve(batch_id)
        counts = batch.request_counts
        assert counts.completed + counts.failed <= counts.total
        return batch if batch.status in {"completed", "failed", "cancelled", "expired"} else None

    return wait_until(probe, what=f"batch {batch_id} did not end", timeout=timeout)


def results(sdk: openai.OpenAI, file_id: str | None) -> list[dict[str, Any]]:
    if file_id is None:
        return []
    text = sdk.files.content(file_id).text
    assert text == "" or text.endswith("\n")
    return [json.loads(raw) for raw in text.splitlines()]


def assert_each_line_once(batch: Any, output: list[dict], errors: list[dict], custom_ids: list[str]) -> None:
    seen = [row["custom_id"] for row in output + errors]
    assert sorted(seen) == sorted(custom_ids)
    assert batch.request_counts.total == len(custom_ids)
    assert (batch.request_counts.completed, batch.request_counts.failed) == (len(output), len(errors))
    assert all(row["id"].startswith("batch_req_") for row in output + errors)


def test_responses_and_chat_batches_write_every_line_once_invalid_lines_in_the_error_file(sdk, api, running_worker):
    subscribed = WebhookEndpoint.objects.create(
        id="whep_01J000000000000000000000AA",
        client=api.client,
        name="batches",
        url="https://hooks.example/batches",
        event_types=["batch.completed"],
        secret="whsec_" + "A" * 32,
        created_at="2026-01-01T00:00:00Z",
        updated_at="2026-01-01T00:00:00Z",
    )
    responses = [line(f"r{i}", "/v1/responses", {"model": "demo", "input": f"Say {i}", **SMALL}) for i in range(5)]
    responses += [
        line("r-unknown-model", "/v1/responses", {"model": "no-such-model", "input": "x"}),
        line("r-bad-param", "/v1/responses", {"model": "demo", "input": "x", "temperature": "hot"}),
        line("r-stream", "/v1/responses", {"model": "demo", "input": "x", "stream": True}),
    ]
    chats = [
        line(
            f"c{i}",
            "/v1/chat/completions",
            {"model": "demo", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 6},
        )
        for i in range(4)
    ]
    chats.append(line("c-no-messages", "/v1/chat/completions", {"model": "demo"}))

    responses_file = upload(sdk, jsonl(responses))
    chat_file = upload(sdk, jsonl(chats))
    assert (responses_file.purpose, responses_file.bytes, responses_file.status) == (
        "batch",
        len(jsonl(responses)),
        "processed",
    )
    assert sdk.files.retrieve(responses_file.id).filename == "batch.jsonl"
    assert sdk.files.content(responses_file.id).content == jsonl(responses)
    first = sdk.batches.create(
        input_file_id=responses_file.id, endpoint="/v1/responses", completion_window="24h", metadata={"run": "1"}
    )
    second = sdk.batches.create(input_file_id=chat_file.id, endpoint="/v1/chat/completions", completion_window="24h")
    assert first.status == "in_progress" and first.metadata == {"run": "1"}
    assert first.request_counts.total == 8 and first.request_counts.failed == 3

    for created, items, refused in ((first, responses, 3), (second, chats, 1)):
        batch = ended(sdk, created.id)
        assert batch.status == "completed", batch
        output, errors = results(sdk, batch.output_file_id), results(sdk, batch.error_file_id)
        assert_each_line_once(batch, output, errors, [item["custom_id"] for item in items])
        assert len(errors) == refused
        assert all(row["response"]["status_code"] == 200 and row["error"] is None for row in output)
        assert all(row["response"]["status_code"] == 400 for row in errors)
        for row in output:
            body = row["response"]["body"]
            assert body["object"] == ("chat.completion" if created is second else "response")
        # The batch's usage is its lines' usage, summed (a refused line used nothing).
        usages = [row["response"]["body"]["usage"] for row in output]
        if created is second:
            spent = sum(u["prompt_tokens"] for u in usages), sum(u["completion_tokens"] for u in usages)
        else:
            spent = sum(u["input_tokens"] for u in usages), sum(u["output_tokens"] for u in usages)
        assert (batch.usage.input_tokens, batch.usage.output_tokens) == spent and spent[1] > 0
        assert batch.usage.total_tokens == sum(spent)
        assert sdk.files.retrieve(batch.output_file_id).purpose == "batch_output"
    by_id = {row["custom_id"]: row for row in results(sdk, sdk.batches.retrieve(first.id).error_file_id)}
    assert by_id["r-unknown-model"]["response"]["body"]["error"]["code"] == "model_not_found"
    assert by_id["r-stream"]["response"]["body"]["error"]["param"] == "stream"
    assert by_id["r-bad-param"]["response"]["body"]["error"]["param"] == "temperature"
    # The batch.completed events went to the outbox, one per batch, naming the batch.
    events = [json.loads(row.payload) for row in WebhookDelivery.objects.filter(endpoint=subscribed)]
    assert sorted(event["data"]["id"] for event in events) == sorted([first.id, second.id])
    assert {event["type"] for event in events} == {"batch.completed"}
    listed = sdk.batches.list()
    assert [batch.id for batch in listed.data][:2] == [second.id, first.id]


def test_a_file_with_a_bad_line_fails_validation_naming_the_lines(transactional_db, sdk):
    items = [
        line("a", "/v1/responses", {"model": "demo", "input": "x"}),
        b"{not json",
        line("a", "/v1/responses", {"model": "demo", "input": "x"}),
        line("b", "/v1/chat/completions", {"model": "demo", "messages": []}),
        {"custom_id": "c", "method": "GET", "url": "/v1/responses", "body": {}},
    ]
    batch = sdk.batches.create(
        input_file_id=upload(sdk, jsonl(items)).id, endpoint="/v1/responses", completion_window="24h"
    )
    assert batch.status == "failed" and batch.failed_at is not None
    assert [(e.line, e.code) for e in batch.errors.data] == [
        (2, "invalid_json_line"),
        (3, "duplicate_custom_id"),
        (4, "mismatched_endpoint"),
        (5, "invalid_method"),
    ]
    assert not BatchLine.objects.filter(batch_id=batch.id).exists()
    with pytest.raises(openai.NotFoundError) as refused:
        sdk.batches.create(input_file_id="file-nope", endpoint="/v1/responses", completion_window="24h")
    assert refused.value.param == "input_file_id"
    with pytest.raises(openai.BadRequestError):
        sdk.batches.create(input_file_id=batch.input_file_id, endpoint="/v1/embeddings", completion_window="24h")


def test_cancel_ends_the_lines_not_started_and_writes_each_line_once(sdk, running_worker):
    items = [
        line(f"l{i}", "/v1/responses", {"model": ENDLESS_MODEL, "input": "Go", "max_output_tokens": 200})
        for i in range(40)
    ]
    created = sdk.batches.create(
        input_file_id=upload(sdk, jsonl(items)).id, endpoint="/v1/responses", completion_window="24h"
    )
    wait_until(lambda: BatchLine.objects.filter(batch_id=created.id, state="sent").exists(), what="no line was sent")
    cancelling = sdk.batches.cancel(created.id)
    assert cancelling.status in {"cancelling", "cancelled"} and cancelling.cancelling_at is not None
    batch = ended(sdk, created.id)
    assert batch.status == "cancelled" and batch.cancelled_at is not None
    output, errors = results(sdk, batch.output_file_id), results(sdk, batch.error_file_id)
    assert_each_line_once(batch, output, errors, [item["custom_id"] for item in items])
    assert any(row["error"] and row["error"]["code"] == "batch_cancelled" for row in errors)
    # At most the lines sent before the cancel ran; the rest never became tasks.
    assert BatchLine.objects.filter(batch_id=created.id).exclude(task_id="").count() <= 16
    with pytest.raises(openai.ConflictError):
        sdk.batches.cancel(
            sdk.batches.create(
                input_file_id=upload(sdk, b"x\n").id, endpoint="/v1/responses", completion_window="24h"
            ).id
        )


def test_the_window_s_end_expires_what_has_not_finished(sdk, running_worker):
    items = [
        line(f"e{i}", "/v1/responses", {"model": ENDLESS_MODEL, "input": "Go", "max_output_tokens": 2000})
        for i in range(12)
    ]
    created = sdk.batches.create(
        input_file_id=upload(sdk, jsonl(items)).id, endpoint="/v1/responses", completion_window="24h"
    )
    wait_until(lambda: BatchLine.objects.filter(batch_id=created.id, state="sent").exists(), what="no line was sent")
    Batch.objects.filter(pk=created.id).update(expires_at=Batch.objects.get(pk=created.id).created_at)
    batch = ended(sdk, created.id)
    assert batch.status == "expired" and batch.expired_at is not None
    output, errors = results(sdk, batch.output_file_id), results(sdk, batch.error_file_id)
    assert_each_line_once(batch, output, errors, [item["custom_id"] for item in items])
    assert {row["error"]["code"] for row in errors} == {"batch_expired"}


def test_an_upload_cut_off_leaves_nothing_behind(transactional_db, api, web_server):
    files_dir = Path(os.environ["LMSP_DATA_DIR"]) / "files"
    before = set(files_dir.glob("*")) if files_dir.exists() else set()
    files_before = File.objects.count()
    boundary = "cutcutcut"
    head = (
        f'--{boundary}\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n'
        f'--{boundary}\r\nContent-Disposition: form-data; name="file"; filename="big.jsonl"\r\n'
        "Content-Type: application/jsonl\r\n\r\n"
    ).encode()
    host, port = web_server.base.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port))) as sock:
        sock.sendall(
            f"POST /lmsp/v1/files HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {api.token}\r\n"
            f"Content-Type: multipart/form-data; boundary={boundary}\r\n"
            f"Content-Length: {8 * 1024 * 1024}\r\n\r\n".encode()
        )
        sock.sendall(head + b"x" * (3 * 1024 * 1024))
    # A complete upload afterwards works, and only it is left.
    reply = sdk_for(web_server.base, api.token).files.create(file=("ok.jsonl", io.BytesIO(b"{}\n")), purpose="batch")
    assert File.objects.count() == files_before + 1
    assert set(files_dir.glob("*")) - before == {files_dir / reply.id}
    # A purpose the service does not read is refused by name.
    with pytest.raises(openai.APIStatusError) as refused:
        sdk_for(web_server.base, api.token).files.create(file=("x.jsonl", io.BytesIO(b"{}\n")), purpose="fine-tune")
    assert refused.value.status_code == 400


def test_another_client_sees_none_of_a_client_s_files_and_batches(running_worker, sdk, web_server, other_api):
    # Three long lines on the shared worker (one row, about a second each at least): the batch still runs at
    # the owner's calls below (a line of a few tokens had ended, and the batch with it, once the keeper woke
    # at each line's end).
    long = {"model": ENDLESS_MODEL, "input": "x", "max_output_tokens": 5000}
    file = upload(sdk, jsonl([line(f"a{n}", "/v1/responses", long) for n in range(3)]))
    batch = sdk.batches.create(input_file_id=file.id, endpoint="/v1/responses", completion_window="24h")
    other = sdk_for(web_server.base, other_api.token)
    for call in (
        lambda: other.files.retrieve(file.id),
        lambda: other.files.content(file.id),
        lambda: other.files.delete(file.id),
        lambda: other.batches.retrieve(batch.id),
        lambda: other.batches.cancel(batch.id),
    ):
        with pytest.raises(openai.NotFoundError):
            call()
    assert other.files.list().data == [] and other.batches.list().data == []
    with pytest.raises(openai.NotFoundError):
        other.batches.create(input_file_id=file.id, endpoint="/v1/responses", completion_window="24h")
    # Its owner cannot delete the input of a batch still running; once it ended, it can.
    with pytest.raises(openai.ConflictError):
        sdk.files.delete(file.id)
    sdk.batches.cancel(batch.id)
    assert sdk.files.delete(ended(sdk, batch.id).input_file_id).deleted


def test_a_worker_and_a_web_process_killed_mid_batch_lose_no_line_and_write_none_twice(lab):
    """200 lines in two batches (Responses and Chat, some refused), their worker and their web process
    (the keeper writing the files) SIGKILLed while lines run: after recovery and a restart, every line's
    result is in the output or the error file exactly once, the counts agree, each batch's end is in the
    webhook outbox once."""
    env = {**lab.env, "LMSP_TASK_QUEUE": lab.queue, "LMSP_BATCH_ACTIVE_LINES": "16", "LMSP_BATCH_POLL_SECONDS": "0.1"}
    # One engine batch runs the window's lines together (a worker of one row would run them one by one).
    batched = {"pool": "threads", "concurrency": 16, "LMSP_MAX_BATCH": "16", "LMSP_DELTA_BATCH_MS": "20"}
    WebhookEndpoint.objects.create(
        id="whep_01J000000000000000000000KL",
        client=lab.api.client,
        name="batches",
        url="https://hooks.example/batches",
        event_types=["batch.completed"],
        secret="whsec_" + "A" * 32,
        created_at="2026-01-01T00:00:00Z",
        updated_at="2026-01-01T00:00:00Z",
    )
    request = {"model": ENDLESS_MODEL, "input": "Go", "max_output_tokens": 12}
    responses = [line(f"r{i}", "/v1/responses", request) for i in range(140)]
    responses += [line(f"r-bad{i}", "/v1/responses", {**request, "temperature": "hot"}) for i in range(10)]
    chat = {"model": ENDLESS_MODEL, "messages": [{"role": "user", "content": "Go"}], "max_tokens": 12}
    chats = [line(f"c{i}", "/v1/chat/completions", chat) for i in range(45)]
    chats += [line(f"c-bad{i}", "/v1/chat/completions", {"model": ENDLESS_MODEL}) for i in range(5)]

    with uvicorn_process(env["DATABASE_URL"], env) as first_web:
        sdk = sdk_for(first_web.base, lab.api.token)
        created = [
            sdk.batches.create(input_file_id=upload(sdk, jsonl(items)).id, endpoint=endpoint, completion_window="24h")
            for items, endpoint in ((responses, "/v1/responses"), (chats, "/v1/chat/completions"))
        ]
        # A slowed device: the kills land while lines run, on a loaded machine too.
        with lab.worker("first", **batched, LMSP_FAULT_MODEL_CALL_SECONDS="0.002") as worker:
            wait_until(
                lambda: BatchLine.objects.filter(state="ended", written=True).count() >= 30,
                what="no results were written before the kills",
                timeout=120,
            )
            kill_process_group(worker.proc)
            os.kill(first_web.pid, 9)
    lab.recover()
    # The lines whose run messages died with the worker are sent again by the sweeper (docs/recovery.md).
    sweeping = {"LMSP_SWEEP_INTERVAL_SECONDS": "1", "LMSP_SWEEP_GRACE_SECONDS": "2"}
    with (
        uvicorn_process(env["DATABASE_URL"], env) as second_web,
        lab.worker("second", beat=True, **batched, **sweeping),
    ):
        sdk = sdk_for(second_web.base, lab.api.token)
        for batch, items in zip(created, (responses, chats), strict=True):
            done = ended(sdk, batch.id, timeout=180)
            assert done.status == "completed", done
            output, errors = results(sdk, done.output_file_id), results(sdk, done.error_file_id)
            assert_each_line_once(done, output, errors, [item["custom_id"] for item in items])
            assert sorted(row["custom_id"] for row in errors) == sorted(
                item["custom_id"] for item in items if "-bad" in item["custom_id"]
            )
    events = [json.loads(row.payload) for row in WebhookDelivery.objects.all()]
    assert sorted(event["data"]["id"] for event in events) == sorted(batch.id for batch in created)


def _report_worker(name: str, rows: int) -> None:
    worker_node_report(
        name=name,
        hostname="host",
        pid=1,
        pool="threads",
        state=WorkerNodeState.ONLINE,
        started_at=timezone.now(),
        max_rows=rows,
        engines=[],
    )


def test_a_batch_takes_the_online_workers_rows_less_one_each_and_leaves_room_for_interactive_requests(
    transactional_db, api, worker_models_root: Path, settings, web_server
):
    """LMSP_BATCH_ACTIVE_LINES 0 (the default): as many lines are tasks at once as the workers that report
    themselves online have rows, less one row each and less every other task queued or running."""
    # The session's shared web server keeps batches too, with its own queue and its own idea of which workers
    # are online (none of this test's, after 4 s: 8 lines then); it stands still while this web's keeper is
    # the only one.
    with frozen_between_transactions(web_server.pid):
        _one_keeper_fills_the_free_rows(api, worker_models_root, settings)


def _one_keeper_fills_the_free_rows(api: Any, worker_models_root: Path, settings: Any) -> None:
    # No worker consumes this queue: whatever the keeper sends stays queued, so its window is what it sent.
    env = {
        "REDIS_URL": settings.REDIS_URL,
        "LMSP_REDIS_PREFIX": REDIS_PREFIX,
        "LMSP_TASK_QUEUE": f"{REDIS_PREFIX}-nobody",
        "LMSP_MODELS_DIR": str(worker_models_root),
        "LMSP_BATCH_POLL_SECONDS": "0.1",
        "LMSP_WORKER_SILENT_SECONDS": "60",
    }
    settings.LMSP_WORKER_SILENT_SECONDS = 60
    settings.LMSP_TASK_QUEUE = env["LMSP_TASK_QUEUE"]
    model_scan(models_dir=worker_models_root)
    _report_worker("one@host", 4)

    def sent() -> int:
        return BatchLine.objects.filter(state="sent").count()

    def theirs(ours: tuple[int, int]) -> int:
        # The suite's shared workers, if this process runs any, report themselves too: their free rows count.
        rows, workers = worker_rows_online()
        return max(0, (rows - ours[0]) - (workers - ours[1]))

    def settles_at(count: int, ours: tuple[int, int]) -> None:
        wait_until(lambda: sent() == count + theirs(ours), what=lambda: f"{sent()} lines sent", timeout=30)
        time.sleep(0.5)  # five more rounds of the keeper: it sends no more
        assert sent() == count + theirs(ours)

    with uvicorn_process(database_url(), env) as web:
        sdk = sdk_for(web.base, api.token)
        items = [line(f"l{n}", "/v1/responses", {"model": "demo", "input": "x", **SMALL}) for n in range(12)]
        sdk.batches.create(
            input_file_id=upload(sdk, jsonl(items)).id, endpoint="/v1/responses", completion_window="24h"
        )
        settles_at(3, (4, 1))  # 4 rows, one kept for interactive requests

        interactive = create(api, max_output_tokens=5)["id"]
        _report_worker("two@host", 4)
        settles_at(5, (8, 2))  # 8 rows less 2 kept, less the interactive task: 5 lines

        # A worker that went silent no longer counts.
        before = sent()
        WorkerNode.objects.filter(pk="two@host").update(reported_at=timezone.now() - timedelta(seconds=120))
        assert api.post(f"/lmsp/v1/tasks/{interactive}/cancel").json()["status"] == "cancelled"
        time.sleep(0.5)
        assert sent() == before  # more lines queued than one worker of 4 rows can run: none sent, none taken back
