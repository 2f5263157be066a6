"""Ollama's native API at ``/api/...`` (PROFILE.md 11.2) with the ``ollama`` package as the real client.

Every generation is a task on the session's real worker: its text is the
response's text, its stream the task's events as NDJSON lines, its errors
Ollama's ``{"error"}`` with its status codes; what a field asks and this
service cannot do is refused by its name. A model scripted to write a call
in its template's format (tests/support/codex_scripted.py) gives the call
back as an object, and the next turn sends it and the tool's answer back.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import httpx
import jsonschema
import ollama
import pytest
from tokenizers import Tokenizer

from fixture_models.demo import CHAT_TEMPLATE
from tasks_app.models import Response, Task
from tasks_app.registry.scan import model_scan
from tasks_app.states import Protocol, TaskStatus
from tests.support.codex_scripted import scripted_after_prompt
from tests.support.db import database_url
from tests.support.demo import ENDLESS_MODEL
from tests.support.hf_hub import hf_hub_stand_in
from tests.support.server import REPO, uvicorn_process
from tests.support.waiting import wait_until

# A client's protocol over the engine, whose writes the lifecycle's, recovery's and the adapters' own tests
# test on both databases: the SQLite pass only (pyproject.toml, the sqlite_pass marker).
pytestmark = pytest.mark.sqlite_pass

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"}]


@pytest.fixture
def client(api, web_server) -> ollama.Client:
    return ollama.Client(host=web_server.base, headers={"Authorization": f"Bearer {api.token}"}, timeout=60)


def response_of_newest() -> Response:
    return Response.objects.filter(protocol=Protocol.OLLAMA).order_by("-created_at").first()


# --------------------------------------------------------------------------- catalog


def test_version_tags_show_and_an_unknown_model(client, running_worker):
    assert client._client.get("/api/version").json()["version"].count(".") == 2

    names = {model.model: model for model in client.list().models}
    assert {"demo", ENDLESS_MODEL} <= set(names)
    demo = names["demo"]
    assert demo.details.format == "onnx" and demo.size > 0 and demo.digest

    shown = client.show("demo")
    assert shown.template == CHAT_TEMPLATE
    assert shown.capabilities == ["completion"]  # the demo template renders no tools
    assert shown.modelinfo["general.architecture"] == shown.details.family
    assert shown.modelinfo[f"{shown.details.family}.context_length"] > 0

    for call in (lambda: client.show("nope"), lambda: client.chat(model="nope", messages=MESSAGES)):
        with pytest.raises(ollama.ResponseError) as caught:
            call()
        assert (caught.value.status_code, caught.value.error) == (404, "model 'nope' not found")


def test_ps_lists_the_model_a_worker_runs_a_task_of(client, running_worker):
    stream = client.generate(model=ENDLESS_MODEL, prompt="Hi", stream=True, options={"num_predict": 100000})
    next(stream)
    assert [model.model for model in client.ps().models] == [ENDLESS_MODEL]
    stream.close()
    wait_until(lambda: not client.ps().models, what="/api/ps still lists a model after its task ended")


def test_a_bad_token_or_none_is_401_in_ollamas_shape(api, web_server):
    for headers in ({"Authorization": "Bearer wrong"}, {}):
        with pytest.raises(ollama.ResponseError) as caught:
            ollama.Client(host=web_server.base, headers=headers).list()
        assert caught.value.status_code == 401
        assert caught.value.error.startswith("unauthorized: ")


# --------------------------------------------------------------------------- chat and generate


def test_a_chat_answers_the_tasks_text_with_its_counts_and_durations(client, running_worker, api, web_server):
    answer = client.chat(model="demo", messages=MESSAGES, options={"num_predict": 12, "seed": 7, "temperature": 0})

    stored = response_of_newest()
    assert stored.request["messages"] == MESSAGES  # the body as sent
    assert stored.generation["sampling"] == {"seed": 7, "temperature": 0}
    assert answer.message.role == "assistant"
    assert answer.message.content == "".join(p["text"] for item in stored.output for p in item["content"])
    assert answer.done and answer.done_reason == ("length" if stored.status == "incomplete" else "stop")
    assert (answer.prompt_eval_count, answer.eval_count) == (
        stored.usage["input_tokens"],
        stored.usage["output_tokens"],
    )
    assert answer.total_duration >= answer.load_duration + answer.prompt_eval_duration + answer.eval_duration > 0
    # A durable task like any other, listed with its events.
    task = Task.objects.get(response_id=stored.pk)
    listed = httpx.get(
        f"{web_server.base}/lmsp/v1/tasks", headers={"Authorization": f"Bearer {api.token}"}, timeout=30
    ).json()
    assert task.pk in [item["id"] for item in listed["data"]]
    events = httpx.get(
        f"{web_server.base}/lmsp/v1/tasks/{task.pk}/events",
        headers={"Authorization": f"Bearer {api.token}"},
        timeout=30,
    ).text
    assert "event: response.created" in events and "event: response.completed" in events.replace(
        "response.incomplete", "response.completed"
    )


def test_a_stream_is_ndjson_lines_of_text_then_the_done_line(client, running_worker, api, web_server):
    chunks = list(client.chat(model=ENDLESS_MODEL, messages=MESSAGES, stream=True, options={"num_predict": 20}))

    *texts, last = chunks
    assert texts and not any(chunk.done for chunk in texts)
    assert (last.done, last.done_reason, last.eval_count, last.message.content) == (True, "length", 20, "")
    stored = response_of_newest()
    assert "".join(chunk.message.content for chunk in texts) == stored.output[0]["content"][0]["text"]
    assert last.prompt_eval_count == stored.usage["input_tokens"]
    # stream defaults to true, as Ollama's, in its own content type.
    raw = httpx.post(
        f"{web_server.base}/api/generate",
        json={"model": "demo", "prompt": "Hi", "options": {"num_predict": 2}},
        headers={"Authorization": f"Bearer {api.token}"},
        timeout=60,
    )
    assert raw.headers["content-type"].startswith("application/x-ndjson")
    lines = [json.loads(text) for text in raw.text.splitlines()]
    assert lines[-1]["done"] is True and all("response" in body for body in lines)


def test_generate_with_a_limit_and_a_stop(client, running_worker):
    options = {"temperature": 0, "seed": 1}
    cut = client.generate(model=ENDLESS_MODEL, prompt="Once", options={**options, "num_predict": 8})
    assert (cut.done_reason, cut.eval_count) == ("length", 8)
    middle = len(cut.response) // 2
    stop = cut.response[middle : middle + 2]

    stopped = client.generate(model=ENDLESS_MODEL, prompt="Once", options={**options, "num_predict": 8, "stop": [stop]})
    assert stopped.done_reason == "stop"
    assert stopped.response == cut.response[: cut.response.index(stop)]
    streamed = list(client.generate(model="demo", prompt="Once", system="Be brief.", stream=True))
    assert streamed[-1].done and response_of_newest().generation["system"] == "Be brief."


SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
    },
    "required": ["name", "age"],
}


def test_format_constrains_the_answer_to_json_and_to_a_schema(client, running_worker):
    answer = client.chat(model="demo", messages=MESSAGES, format=SCHEMA, options={"num_predict": 200})
    assert answer.done_reason == "stop"
    jsonschema.validate(json.loads(answer.message.content), SCHEMA)
    assert response_of_newest().generation["constraint"]["kind"] == "json_schema"

    # Any object may go on for ever (its keys are the model's): what came is the start of one.
    any_object = client.generate(model="demo", prompt="Hi", format="json", options={"num_predict": 20})
    assert any_object.response.startswith("{")
    if any_object.done_reason == "stop":
        assert isinstance(json.loads(any_object.response), dict)
    assert response_of_newest().generation["constraint"]["kind"] == "json_object"


@pytest.mark.parametrize(
    ("call", "named"),
    [
        (dict(format={"type": "object", "properties": {"a": {"type": "string", "format": "nope"}}}), "format"),
        (dict(options={"mirostat": 2}), "options.mirostat"),
        (dict(options={"num_ctx": 10**7}), "options.num_ctx"),
        (dict(think=True), "think"),
        (dict(format="json", options={"stop": ["}"]}), "options.stop"),
        (dict(messages=[{"role": "user", "content": "Hi", "images": ["aGk="]}]), "messages[0].images"),
    ],
    ids=["schema", "mirostat", "num_ctx", "think", "stop-with-format", "images"],
)
def test_what_cannot_be_honoured_is_refused_by_name(client, running_worker, call, named):
    before = Task.objects.count()
    with pytest.raises(ollama.ResponseError) as caught:
        client.chat(model="demo", **{"messages": MESSAGES, **call})
    assert caught.value.status_code == 400
    assert named in caught.value.error
    assert Task.objects.count() == before


def test_options_that_ask_for_nothing_we_lack_are_accepted(client, running_worker):
    options = {"num_ctx": 2048, "num_gpu": 1, "num_thread": 4, "use_mmap": True, "mirostat": 0, "num_predict": 2}
    answer = client.chat(model="demo", messages=MESSAGES, options=options, keep_alive="5m")
    assert answer.done
    with pytest.raises(ollama.ResponseError) as caught:
        client.generate(model="demo", prompt="Hi", raw=True)
    assert (caught.value.status_code, "raw" in caught.value.error) == (400, True)
    # Nothing to generate: Ollama's load request answers at once.
    assert client.generate(model="demo").done_reason == "load"


def test_a_client_that_leaves_a_stream_cancels_its_generation(api, web_server, running_worker):
    with httpx.stream(
        "POST",
        f"{web_server.base}/api/chat",
        json={"model": ENDLESS_MODEL, "messages": MESSAGES, "options": {"num_predict": 100000}},
        headers={"Authorization": f"Bearer {api.token}"},
        timeout=60,
    ) as stream:
        next(stream.iter_lines())
    task = Task.objects.get(response_id=response_of_newest().pk)
    wait_until(
        lambda: Task.objects.get(pk=task.pk).status == TaskStatus.CANCELLED,
        what="the generation of an Ollama stream whose client left was not cancelled",
    )


# --------------------------------------------------------------------------- tools

# A Qwen-like template that renders tools and calls (Hermes' <tool_call> format).
TOOLS_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\n<tools>{% for t in tools %}{{ t | tojson }}{% endfor %}</tools>\n"
    'Call one as <tool_call>\n{"name": <name>, "arguments": <args>}\n</tool_call><|im_end|>\n{% endif %}'
    "{%- for m in messages %}"
    "{%- if m.role == 'assistant' and m.tool_calls %}<|im_start|>assistant\n"
    "{% for c in m.tool_calls %}<tool_call>\n{{ {'name': c.function.name, 'arguments': c.function.arguments} "
    "| tojson }}\n</tool_call>{% endfor %}<|im_end|>\n"
    "{%- elif m.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m.content }}\n</tool_response><|im_end|>\n"
    "{%- else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}"
    "{%- endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The forecast.",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo"]}},
                "required": ["city"],
            },
        },
    }
]
ASK = [{"role": "user", "content": "Weather in Paris?"}]
SCRIPT = 'Checking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city":"Paris"}}\n</tool_call>'


@pytest.fixture
def tools_model(client, running_worker, worker_models_root: Path) -> str:
    """The demo model with a template that takes tools, scripted to write ``SCRIPT`` after ``ASK``."""
    folder = worker_models_root / "ollama-tools"
    if not folder.exists():
        base = worker_models_root / "ollama-tools-base"
        if not base.exists():
            shutil.copytree(worker_models_root / "demo", base, ignore=shutil.ignore_patterns("endless"))
            (base / "chat_template.jinja").write_text(TOOLS_TEMPLATE, encoding="utf-8")
            model_scan(models_dir=worker_models_root)
        probe = client.chat(model="ollama-tools-base", messages=ASK, tools=TOOLS, options={"num_predict": 1})
        tokenizer = Tokenizer.from_file(str(base / "tokenizer.json"))
        eos = json.loads((base / "generation_config.json").read_text())["eos_token_id"]
        staging = worker_models_root / ".ollama-tools"
        scripted_after_prompt(
            base,
            staging,
            prompt_tokens=probe.prompt_eval_count,
            script=tokenizer.encode(SCRIPT, add_special_tokens=False).ids,
            eos=eos[0] if isinstance(eos, list) else eos,
        )
        staging.rename(folder)
    model_scan(models_dir=worker_models_root)
    return "ollama-tools"


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_tool_call_comes_back_as_an_object_and_its_answer_goes_back(client, tools_model, stream):
    assert "tools" in client.show(tools_model).capabilities
    answer = client.chat(model=tools_model, messages=ASK, tools=TOOLS, stream=stream, options={"temperature": 0})
    chunks = list(answer) if stream else [answer]
    text = "".join(chunk.message.content or "" for chunk in chunks)
    calls = [call for chunk in chunks for call in chunk.message.tool_calls or ()]
    assert text == "Checking."
    assert [(call.function.name, dict(call.function.arguments)) for call in calls] == [
        ("get_weather", {"city": "Paris"})
    ]
    assert chunks[-1].done and chunks[-1].done_reason == "stop"

    history = [
        *ASK,
        {"role": "assistant", "content": text, "tool_calls": calls},
        {"role": "tool", "content": "18 C, sunny", "tool_name": "get_weather"},
    ]
    after = client.chat(model=tools_model, messages=history, tools=TOOLS, options={"num_predict": 4})
    assert after.done
    turns = response_of_newest().generation["turns"]
    call, result = turns[-2:]
    assert (call["name"], json.loads(call["arguments"])) == ("get_weather", {"city": "Paris"})
    assert (result["role"], result["text"], result["call_id"]) == ("tool", "18 C, sunny", call["call_id"])


# --------------------------------------------------------------------------- anonymous access and pull

HUB_REPO = "lmsp-fixtures/qwen2-community"


@pytest.fixture
def private_server(transactional_db, make_client, tmp_path: Path, settings):
    """A web server of the test's own: local clients without a token act as ``anon``; pulls go to a stand-in hub."""
    make_client("anon", scopes="read")
    models = tmp_path / "models"
    models.mkdir()
    repo = tmp_path / "repo"
    shutil.copytree(REPO / "tests" / "fixtures" / "models" / "qwen2-community", repo)
    with hf_hub_stand_in({HUB_REPO: repo}) as hub:
        env = {
            "REDIS_URL": settings.REDIS_URL,
            "LMSP_MODELS_DIR": str(models),
            "LMSP_OLLAMA_ANONYMOUS": "anon",
            "HF_ENDPOINT": hub.url,
            "HF_HOME": str(tmp_path / "hf-home"),
            "HF_HUB_DISABLE_TELEMETRY": "1",
        }
        with uvicorn_process(database_url(), env) as server:
            yield server


def test_anonymous_local_clients_get_the_named_clients_scopes(private_server, make_client):
    anonymous = ollama.Client(host=private_server.base)
    assert anonymous.list().models == []  # read: the anon client's scope (its models folder is empty)
    with pytest.raises(ollama.ResponseError) as caught:
        anonymous.chat(model="demo", messages=MESSAGES)
    assert caught.value.status_code == 403  # no responses scope
    with pytest.raises(ollama.ResponseError) as caught:
        ollama.Client(host=private_server.base, headers={"Authorization": "Bearer wrong"}).list()
    assert caught.value.status_code == 401  # a header is checked whatever the setting says


def test_pull_maps_onto_the_services_own_pull(private_server, make_client):
    _, admin = make_client("root", scopes="admin")
    _, reader = make_client("reader", scopes="read")
    pulling = ollama.Client(host=private_server.base, headers={"Authorization": f"Bearer {admin}"}, timeout=120)

    statuses = [progress.status for progress in pulling.pull(f"hf.co/{HUB_REPO}", stream=True)]
    assert statuses[0] == "pulling manifest" and statuses[-1] == "success"
    assert "qwen2-community" in [model.model for model in pulling.list().models]
    assert pulling.pull(f"{HUB_REPO}:latest").status == "success"  # again: nothing left to fetch

    with pytest.raises(ollama.ResponseError) as caught:
        list(pulling.pull("hf.co/lmsp-fixtures/missing", stream=True))
    assert "missing" in caught.value.error
    with pytest.raises(ollama.ResponseError) as caught:
        pulling.pull("llama3.2")
    assert caught.value.status_code == 400 and "hf.co/<owner>/<repo>" in caught.value.error
    with pytest.raises(ollama.ResponseError) as caught:
        ollama.Client(host=private_server.base, headers={"Authorization": f"Bearer {reader}"}).pull(HUB_REPO)
    assert caught.value.status_code == 403
