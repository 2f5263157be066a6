"""Models exported by the real tools, through the service: a real web server, real workers, real ONNX Runtime.

``tests/fixtures/models`` holds tiny random-weight exports in every layout
the service loads (flat Optimum, onnx-community with its fp16, int8, uint8,
q4, q4f16 and bnb4 variants, onnxruntime-genai builder fp32 and int4, legacy
merged Optimum), and ``tests/fixtures/model_references.json`` what the
exporting tools' own runtimes generated for them (``tests/fixtures/README.md``).
Greedy text and usage must equal those references (for the dynamically
quantized graphs, whose tokens depend on the CPU: onnxruntime's own loop on
this one) through ``POST /lmsp/v1/responses`` and through ``POST /tasks`` +
its event stream, with the whole prompt in one call and with a prefill
chunked in 8-token pieces; a generation whose worker is killed mid-way
resumes token for token on each layout.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from io import StringIO
from pathlib import Path
from typing import Any

import pytest
from django.core.management import call_command

from tasks_app.models import Task, TaskEvent
from tasks_app.registry.scan import model_scan
from tasks_app.states import TaskStatus
from tests.support.api import ApiClient
from tests.support.db import database_url
from tests.support.namespace import REDIS_PREFIX
from tests.support.quantized import expected_case
from tests.support.server import Server, uvicorn_process
from tests.support.sse import call, open_stream
from tests.support.waiting import wait_until
from tests.support.worker import (
    WorkerProcess,
    celery_worker,
    kill_process_group,
    maintenance_queue,
    process_stopped,
)

# Model layouts over the engine, whose writes the lifecycle's and recovery's own tests test on both
# databases (a resume token for token: test_recovery): the SQLite pass only (pyproject.toml, sqlite_pass).
pytestmark = pytest.mark.sqlite_pass

FIXTURES = Path(__file__).parent / "fixtures"
REFERENCES = json.loads((FIXTURES / "model_references.json").read_text(encoding="utf-8"))["models"]
CHUNK = 8
# Every layout the service loads once, the int8 and fp16 graphs (they resume by replay) included.
RESUME_MODELS = [
    "qwen2-tiny",
    "qwen2-community:q4",
    "qwen2-community:int8",
    "qwen2-community:fp16",
    "llama-genai-int4",
    "phi3-legacy",
]

CASES = [
    pytest.param(name, index, id=f"{name}-{'short' if index == 0 else 'long'}")
    for name in sorted(REFERENCES)
    for index in range(len(REFERENCES[name]["cases"]))
]


def reference(name: str, index: int, *, chunked: bool) -> dict[str, Any]:
    """What the reference runtime generated; for a dynamically quantized graph (its activation
    scales depend on the split, its products on the CPU), what onnxruntime's own loop gives here."""
    return expected_case(name, index, chunk=CHUNK if chunked else None)


@dataclass
class Stack:
    web: Server
    worker: WorkerProcess


@pytest.fixture(scope="module")
def fixture_models_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("real-models")
    shutil.copytree(FIXTURES / "models", root, dirs_exist_ok=True)
    return root


def _stack(name: str, models: Path, tmp: Path, extra: dict[str, str]) -> Iterator[Stack]:
    from django.conf import settings

    queue = f"{REDIS_PREFIX}-real-models-{name}"
    env = {
        "DATABASE_URL": database_url(),
        "REDIS_URL": settings.REDIS_URL,
        "LMSP_REDIS_PREFIX": REDIS_PREFIX,
        "LMSP_TASK_QUEUE": queue,
        "LMSP_MODELS_DIR": str(models),
        "LMSP_WORKER_MAX_MODELS": "12",
        "LMSP_DELTA_BATCH_MS": "20",
        **extra,
    }
    with (
        uvicorn_process(env["DATABASE_URL"], env) as web,
        celery_worker(env=env, queue=queue, log_path=tmp / f"{name}.log", name=name) as worker,
    ):
        yield Stack(web, worker)


@pytest.fixture(scope="module")
def whole_prompt_stack(django_db_setup, django_db_blocker, fixture_models_root, tmp_path_factory) -> Iterator[Stack]:
    with django_db_blocker.unblock():
        yield from _stack("whole", fixture_models_root, tmp_path_factory.mktemp("whole"), {})


@pytest.fixture(scope="module")
def chunked_stack(django_db_setup, django_db_blocker, fixture_models_root, tmp_path_factory) -> Iterator[Stack]:
    with django_db_blocker.unblock():
        yield from _stack(
            "chunked", fixture_models_root, tmp_path_factory.mktemp("chunked"), {"LMSP_PREFILL_CHUNK": str(CHUNK)}
        )


@pytest.fixture
def token(transactional_db, make_client, fixture_models_root: Path, settings) -> str:
    settings.LMSP_MODELS_DIR = fixture_models_root
    report = model_scan(models_dir=fixture_models_root)
    assert set(REFERENCES) <= set(report.added), report
    return make_client("alice")[1]


def greedy(name: str, index: int) -> dict[str, Any]:
    return {"model": name, **REFERENCES[name]["cases"][index]["request"], "temperature": 0}


def output_text(response: dict[str, Any]) -> str:
    return "".join(part["text"] for item in response["output"] for part in item["content"])


def assert_matches(response: dict[str, Any], expected: dict[str, Any], worker: WorkerProcess) -> None:
    assert response["status"] == ("completed" if expected["ended_on_eos"] else "incomplete"), worker.log()[-3000:]
    assert output_text(response) == expected["shown_text"]
    # The worker's prefix cache may hold the prompt's start (the same case ran before on this worker):
    # the text above is the reference's all the same, and one prompt token at least is computed.
    cached = response["usage"]["input_tokens_details"]["cached_tokens"]
    assert 0 <= cached < expected["prompt_tokens"]
    assert response["usage"] == {
        "input_tokens": expected["prompt_tokens"],
        "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": 0},
        "output_tokens": expected["output_tokens"],
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": expected["prompt_tokens"] + expected["output_tokens"],
    }


@pytest.mark.parametrize(("name", "index"), CASES)
def test_a_response_equals_the_exporting_tools_greedy_output_with_the_whole_prompt(
    whole_prompt_stack: Stack, token: str, name: str, index: int
):
    status, response = call(
        whole_prompt_stack.web.base, "POST", "/lmsp/v1/responses", token=token, body=greedy(name, index)
    )
    assert status == 200, response
    assert_matches(response, reference(name, index, chunked=False), whole_prompt_stack.worker)


@pytest.mark.parametrize(("name", "index"), CASES)
def test_a_response_equals_the_exporting_tools_greedy_output_with_a_chunked_prefill(
    chunked_stack: Stack, token: str, name: str, index: int
):
    status, response = call(chunked_stack.web.base, "POST", "/lmsp/v1/responses", token=token, body=greedy(name, index))
    assert status == 200, response
    assert REFERENCES[name]["cases"][index]["prompt_tokens"] > CHUNK or index == 0
    assert_matches(response, reference(name, index, chunked=True), chunked_stack.worker)


@pytest.mark.parametrize("name", sorted(REFERENCES))
def test_a_task_streams_the_reference_text_and_ends_with_its_usage(whole_prompt_stack: Stack, token: str, name: str):
    body = {"type": "response", "on_restart": "fail", "input": greedy(name, 1)}
    status, task = call(whole_prompt_stack.web.base, "POST", "/lmsp/v1/tasks", token=token, body=body)
    assert status == 202, task
    with open_stream(whole_prompt_stack.web.base, f"/lmsp/v1/tasks/{task['id']}/events", token=token) as stream:
        events = [event.payload for event in stream.all()]
    expected = reference(name, 1, chunked=False)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta") == expected["shown_text"]
    assert_matches(events[-1]["response"], expected, whole_prompt_stack.worker)


# --------------------------------------------------------------------------- #
# resume from a snapshot, on every layout: a worker killed inside a batch commit
# --------------------------------------------------------------------------- #


def _task(base: str, token: str, task_id: str) -> dict[str, Any]:
    status, body = call(base, "GET", f"/lmsp/v1/tasks/{task_id}", token=token)
    assert status == 200, body
    return body


def _wait_terminal(base: str, token: str, task_id: str, worker: WorkerProcess) -> dict[str, Any]:
    def done() -> dict[str, Any] | None:
        body = _task(base, token, task_id)
        return body if body["status"] in {"succeeded", "failed", "cancelled"} else None

    return wait_until(done, what=lambda: f"task {task_id} did not end:\n{worker.log()[-3000:]}", timeout=120)


@pytest.mark.parametrize("name", RESUME_MODELS)
def test_a_killed_generation_resumes_token_for_token(
    whole_prompt_stack: Stack, token: str, name: str, fixture_models_root: Path, tmp_path: Path, settings
):
    # Sampled with a seed, so the resumed half must restore the random stream too.
    request = {"model": name, "input": "Tell me a long story about the sea.", "temperature": 1.0, "seed": 11}
    request["max_output_tokens"] = 120
    base = whole_prompt_stack.web.base
    status, reference_task = call(
        base, "POST", "/lmsp/v1/tasks", token=token, body={"type": "response", "on_restart": "fail", "input": request}
    )
    assert status == 202
    expected = _wait_terminal(base, token, reference_task["id"], whole_prompt_stack.worker)["response"]
    assert expected["usage"]["output_tokens"] >= 12, expected  # long enough to be cut after a few commits

    queue = f"{REDIS_PREFIX}-resume-{tmp_path.name}"
    settings.LMSP_TASK_QUEUE = queue
    settings.LMSP_MAINTENANCE_QUEUE = maintenance_queue(queue)
    env = {
        "DATABASE_URL": database_url(),
        "REDIS_URL": settings.REDIS_URL,
        "LMSP_REDIS_PREFIX": REDIS_PREFIX,
        "LMSP_MODELS_DIR": str(fixture_models_root),
        "LMSP_HEARTBEAT_SECONDS": "1",
        "LMSP_DELTA_BATCH_TOKENS": "2",
    }
    api = ApiClient(token)
    reply = api.create_task(on_restart="resume", input=request, headers={"Idempotency-Key": os.urandom(6).hex()})
    assert reply.status_code == 202, reply.content
    task_id = reply.json()["id"]
    # Frozen inside its third batch commit, then killed: that batch never lands.
    # Each model call slowed down: a fast machine would otherwise make all the tokens before the
    # worker's first commit, and the task would end in one batch, never frozen. 0.1 s a call, so the
    # generation (at least 12 s) also outlasts three commits on a loaded machine, whose commits (each
    # an fsync) can take a second: at 0.02 s the 120 tokens could end before the third one.
    crashing = {**env, "LMSP_FAULT_FREEZE": "task_progress@3", "LMSP_FAULT_MODEL_CALL_SECONDS": "0.1"}
    with celery_worker(env=crashing, queue=queue, log_path=tmp_path / "crashing.log", name="crashing") as worker:
        held = wait_until(
            lambda: Task.objects.filter(pk=task_id, status=TaskStatus.RUNNING).exclude(worker="").first(),
            what=lambda: f"the task never ran:\n{worker.log()[-3000:]}",
        )
        pid = int(held.worker.rpartition("/")[2])
        wait_until(lambda: process_stopped(pid), what=lambda: f"the worker did not freeze:\n{worker.log()[-3000:]}")
        kill_process_group(worker.proc)
    committed = TaskEvent.objects.filter(task_id=task_id, type="response.output_text.delta").count()
    assert 0 < committed < expected["usage"]["output_tokens"]
    out = StringIO()
    call_command("lmsp_recover", "--inspect-timeout", "0.5", stdout=out)
    assert "running (to resume): 1" in out.getvalue()
    with celery_worker(env=env, queue=queue, log_path=tmp_path / "resuming.log", name="resuming") as worker:
        result = _wait_terminal(base, token, task_id, worker)
    assert result["status"] == "succeeded", result
    assert output_text(result["response"]) == output_text(expected)
    # The same usage, but for what each worker's prefix cache held: the reference ran on a worker that had
    # seen this prompt; the resumed generation on a new one, which computed all of it.
    usage = result["response"]["usage"]
    assert usage["input_tokens_details"]["cached_tokens"] == 0
    assert {**usage, "input_tokens_details": None} == {**expected["usage"], "input_tokens_details": None}
    assert Task.objects.get(pk=task_id).attempts == 2
