"""Anthropic's Messages API (PROFILE.md 11.1) with the ``anthropic`` package as the real client.

A message runs as a response task on the real worker: its text is the
response's text, its stream the task's events as Anthropic's, its errors in
Anthropic's shape and status codes; what it cannot honour is refused by name.
"""

from __future__ import annotations

import json

import anthropic
import httpx
import pytest

from tasks_app.models import Response, Task
from tasks_app.states import Protocol, TaskStatus
from tests.support.demo import ENDLESS_MODEL
from tests.support.waiting import wait_until

# A client's protocol over the engine, whose writes the lifecycle's, recovery's and the adapters' own tests
# test on both databases: the SQLite pass only (pyproject.toml, the sqlite_pass marker).
pytestmark = pytest.mark.sqlite_pass

WEATHER = {
    "name": "get_weather",
    "description": "The weather in a city.",
    "input_schema": {
        "type": "object",
        "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}},
        "required": ["city"],
        "additionalProperties": False,
    },
}
HELLO = [{"role": "user", "content": "Hello"}]


@pytest.fixture
def sdk(api, web_server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=f"{web_server.base}/lmsp", api_key=api.token, max_retries=0, timeout=120)


def response_of(message_id: str) -> Response:
    return Response.objects.get(pk="resp_" + message_id.removeprefix("msg_"))


def output_text(response: Response) -> str:
    return "".join(part["text"] for item in response.output if item["type"] == "message" for part in item["content"])


def test_a_message_is_a_durable_task_whose_text_and_usage_are_the_responses(sdk, api, running_worker):
    message = sdk.messages.create(
        model="demo",
        max_tokens=12,
        system="Be brief.",
        messages=HELLO,
        extra_body={"temperature": 0},
        metadata={"user_id": "u-1"},
    )

    response = response_of(message.id)
    assert message.type == "message" and message.role == "assistant" and message.model == "demo"
    assert [block.type for block in message.content] in (["text"], [])
    assert "".join(block.text for block in message.content) == output_text(response)
    assert message.stop_reason == ("max_tokens" if response.status == "incomplete" else "end_turn")
    assert message.usage.input_tokens + message.usage.cache_read_input_tokens == response.usage["input_tokens"]
    assert message.usage.output_tokens == response.usage["output_tokens"]
    # Stored as sent, in its own protocol, beside the spec the worker ran.
    assert response.protocol == Protocol.ANTHROPIC
    assert response.request["system"] == "Be brief." and response.request["max_tokens"] == 12
    assert response.generation["system"] == "Be brief."
    listed = api.get("/lmsp/v1/tasks").json()["data"]
    assert response.pk in [task["response_id"] for task in listed]
    # LMSP's own view of the same task echoes what was asked, in its words.
    task = api.get(f"/lmsp/v1/tasks/{response.task.pk}").json()
    assert task["response"]["instructions"] == "Be brief." and task["response"]["max_output_tokens"] == 12


def test_the_api_key_header_and_a_bearer_token_are_the_same_client(sdk, api, web_server, running_worker):
    bearer = anthropic.Anthropic(base_url=f"{web_server.base}/lmsp", auth_token=api.token, max_retries=0)
    message = bearer.messages.create(model="demo", max_tokens=3, messages=HELLO)
    assert response_of(message.id).client_id == api.client.pk


def test_a_stream_is_message_start_blocks_deltas_then_message_delta_and_stop(sdk, running_worker):
    with sdk.messages.stream(
        model=ENDLESS_MODEL, max_tokens=20, messages=HELLO, extra_body={"temperature": 0}
    ) as stream:
        events = list(stream)
        final = stream.get_final_message()

    kinds = [event.type for event in events]
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"]
    assert kinds.count("content_block_start") == kinds.count("content_block_stop") == 1
    response = response_of(final.id)
    deltas = [event.delta.text for event in events if event.type == "content_block_delta"]
    assert "".join(deltas) == final.content[0].text == output_text(response)
    assert final.stop_reason == "max_tokens" and final.usage.output_tokens == 20
    start = events[0].message
    # message_start counts the prompt at accept, as the worker then counted it.
    assert start.usage.input_tokens == response.usage["input_tokens"]


def test_count_tokens_is_the_prompt_the_model_reads(sdk, running_worker):
    request = {"system": "You help.", "messages": HELLO, "tools": [WEATHER]}
    counted = sdk.messages.count_tokens(model="demo", **request)
    message = sdk.messages.create(model="demo", max_tokens=2, **request)

    assert counted.input_tokens == response_of(message.id).usage["input_tokens"] > 0
    longer = sdk.messages.count_tokens(model="demo", system="You help.", messages=HELLO * 3)
    assert (
        longer.input_tokens > sdk.messages.count_tokens(model="demo", system="You help.", messages=HELLO).input_tokens
    )


def test_a_tool_round_trip_with_a_named_tool_choice(sdk, running_worker):
    first = sdk.messages.create(
        model="demo",
        max_tokens=60,
        messages=[{"role": "user", "content": "Weather in Paris?"}],
        tools=[WEATHER],
        tool_choice={"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True},
    )

    calls = [block for block in first.content if block.type == "tool_use"]
    assert first.stop_reason == "tool_use" and len(calls) == 1
    assert calls[0].name == "get_weather" and calls[0].input["city"] in ("Paris", "Rome")
    second = sdk.messages.create(
        model="demo",
        max_tokens=8,
        tools=[WEATHER],
        messages=[
            {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": [block.model_dump() for block in first.content]},
            {
                "role": "user",
                "content": [{"type": "tool_result", "tool_use_id": calls[0].id, "content": "Sunny, 21 C"}],
            },
        ],
    )
    assert second.stop_reason in ("end_turn", "max_tokens", "tool_use")
    turns = response_of(second.id).generation["turns"]
    assert turns[1] == {
        "role": "assistant",
        "call_id": calls[0].id,
        "name": "get_weather",
        "arguments": json.dumps(calls[0].input),
    }
    assert turns[2] == {"role": "tool", "text": "Sunny, 21 C", "call_id": calls[0].id, "name": "get_weather"}


def test_a_streamed_tool_call_arrives_as_input_json_deltas(sdk, running_worker):
    # One call: with parallel calls allowed the sampled model may start a second one, which 60 tokens can cut
    # (stop_reason max_tokens, rightly; it happened in one CI run).
    with sdk.messages.stream(
        model="demo",
        max_tokens=60,
        messages=[{"role": "user", "content": "Weather?"}],
        tools=[WEATHER],
        tool_choice={"type": "any", "disable_parallel_tool_use": True},
    ) as stream:
        events = list(stream)
        final = stream.get_final_message()

    fragments = [
        event.delta.partial_json
        for event in events
        if getattr(getattr(event, "delta", None), "type", "") == "input_json_delta"
    ]
    call = next(block for block in final.content if block.type == "tool_use")
    assert json.loads("".join(fragments)) == call.input and final.stop_reason == "tool_use"


def test_a_stop_sequence_ends_the_text_before_it_and_is_named(sdk, running_worker):
    free = sdk.messages.create(model=ENDLESS_MODEL, max_tokens=30, messages=HELLO, extra_body={"temperature": 0})
    text = free.content[0].text
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    assert stop.strip(), text

    stopped = sdk.messages.create(
        model=ENDLESS_MODEL,
        max_tokens=30,
        messages=HELLO,
        extra_body={"temperature": 0},
        stop_sequences=["never-there", stop],
    )
    assert stopped.stop_reason == "stop_sequence" and stopped.stop_sequence == stop
    assert stopped.content[0].text == text[: text.index(stop)]


def test_a_bad_key_is_401_in_anthropics_shape(web_server, running_worker):
    bad = anthropic.Anthropic(base_url=f"{web_server.base}/lmsp", api_key="not-a-token", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as caught:
        bad.messages.create(model="demo", max_tokens=3, messages=HELLO)
    assert caught.value.status_code == 401
    assert caught.value.body["type"] == "error"
    assert caught.value.body["error"]["type"] == "authentication_error"


def test_a_prompt_over_the_context_is_refused_before_anything_is_queued(sdk, running_worker):
    tasks_before = Task.objects.count()
    with pytest.raises(anthropic.BadRequestError) as caught:
        sdk.messages.create(model="demo", max_tokens=5, messages=[{"role": "user", "content": "word " * 40_000}])

    message = caught.value.body["error"]["message"]
    assert caught.value.body["error"]["type"] == "invalid_request_error"
    assert message.startswith("prompt is too long: ") and message.endswith(" maximum"), message
    tokens, maximum = (int(n) for n in message[len("prompt is too long: ") : -len(" maximum")].split(" tokens > "))
    assert tokens > maximum > 0
    assert Task.objects.count() == tasks_before


@pytest.mark.parametrize(
    ("change", "param"),
    [
        ({"extra_body": {"top_logprobs": 3}}, "top_logprobs"),
        ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, "messages.0.content.0.type"),
        ({"container": "ctr_1"}, "container"),
        ({"tool_choice": {"type": "tool", "name": "web_search"}}, "tool_choice.name"),
    ],
    ids=["unknown-field", "image", "container", "server-tool-required"],
)
def test_what_cannot_be_honoured_is_refused_by_name(sdk, running_worker, change, param):
    request = {
        "model": "demo",
        "max_tokens": 5,
        "messages": HELLO,
        "tools": [{"type": "web_search_20250305", "name": "web_search"}],
        **change,
    }
    with pytest.raises(anthropic.BadRequestError) as caught:
        sdk.messages.create(**request)
    assert param in caught.value.body["error"]["message"]


def test_what_asks_for_nothing_is_accepted(sdk, running_worker):
    message = sdk.messages.create(
        model="demo",
        max_tokens=3,
        system=[{"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral"}}],
        messages=[
            {"role": "user", "content": "Hi"},
            {
                "role": "assistant",
                "content": [{"type": "thinking", "thinking": "...", "signature": "s"}, {"type": "text", "text": "Hey"}],
            },
            {"role": "user", "content": [{"type": "text", "text": "And?", "cache_control": {"type": "ephemeral"}}]},
        ],
        tools=[WEATHER, {"type": "web_search_20250305", "name": "web_search"}],
        thinking={"type": "enabled", "budget_tokens": 1024},
        extra_body={"context_management": {"edits": []}, "output_config": {"effort": "high"}},
        metadata={"user_id": "someone"},
    )
    assert message.stop_reason in ("end_turn", "max_tokens", "tool_use")
    assert not [block for block in message.content if block.type == "thinking"]


def test_a_stream_cut_off_is_taken_up_again_with_its_key_and_last_event_id(sdk, web_server, api, running_worker):
    body = {"model": ENDLESS_MODEL, "max_tokens": 120, "messages": HELLO, "stream": True, "temperature": 0}
    headers = {"x-api-key": api.token, "anthropic-version": "2023-06-01", "Idempotency-Key": "cut-1"}
    seen: list[tuple[str, dict]] = []
    last_id = None
    with httpx.stream("POST", f"{web_server.base}/lmsp/v1/messages", json=body, headers=headers, timeout=60) as cut:
        assert cut.status_code == 200
        frame: dict[str, str] = {}
        for line in cut.iter_lines():
            if line.startswith("id: "):
                frame["id"] = line[4:]
            elif line.startswith("data: "):
                frame["data"] = line[6:]
            elif not line and "data" in frame:
                seen.append((frame.get("id"), json.loads(frame["data"])))
                last_id = frame.get("id", last_id)
                frame = {}
                if sum(1 for _, e in seen if e["type"] == "content_block_delta") >= 3 and last_id is not None:
                    break
    message_id = seen[0][1]["message"]["id"]
    task = response_of(message_id).task
    assert Task.objects.get(pk=task.pk).status != TaskStatus.CANCELLED

    rest: list[dict] = []
    with httpx.stream(
        "POST",
        f"{web_server.base}/lmsp/v1/messages",
        json=body,
        headers={**headers, "Last-Event-ID": last_id},
        timeout=60,
    ) as again:
        assert again.headers["Idempotent-Replayed"] == "true"
        rest = [json.loads(line[6:]) for line in again.iter_lines() if line.startswith("data: ")]

    events = [event for _, event in seen] + rest
    assert [e["type"] for e in events].count("message_start") == 1
    assert events[-1]["type"] == "message_stop"
    text = "".join(e["delta"]["text"] for e in events if e["type"] == "content_block_delta")
    assert text == output_text(response_of(message_id))


def test_a_client_that_leaves_a_stream_without_a_key_cancels_the_generation(sdk, running_worker):
    with sdk.messages.stream(model=ENDLESS_MODEL, max_tokens=2000, messages=HELLO) as stream:
        for event in stream:
            if event.type == "content_block_delta":
                message_id = stream.current_message_snapshot.id
                break
    task = response_of(message_id).task
    wait_until(
        lambda: Task.objects.get(pk=task.pk).status == TaskStatus.CANCELLED,
        what=lambda: f"task {task.pk} cancelled after its client left (now {Task.objects.get(pk=task.pk).status})",
        timeout=30,
    )


def test_a_later_turn_hits_the_prefix_cache_though_the_attribution_line_changed(sdk, running_worker):
    def system(version: str) -> list[dict]:
        return [
            {"type": "text", "text": f"x-anthropic-billing-header: cc_version={version}; cc_entrypoint=cli;"},
            {"type": "text", "text": "You are a helpful assistant. " * 20, "cache_control": {"type": "ephemeral"}},
        ]

    first = sdk.messages.create(
        model="demo", max_tokens=8, extra_body={"temperature": 0}, system=system("1.0.1"), messages=HELLO
    )
    later = sdk.messages.create(
        model="demo",
        max_tokens=8,
        extra_body={"temperature": 0},
        system=system("1.0.2"),
        messages=[*HELLO, {"role": "assistant", "content": first.content[0].text}, {"role": "user", "content": "And?"}],
    )

    assert "billing" not in (response_of(later.id).generation["system"] or "")
    assert later.usage.cache_read_input_tokens > 0
    assert later.usage.input_tokens + later.usage.cache_read_input_tokens == response_of(later.id).usage["input_tokens"]


def test_an_output_format_holds_the_answer_to_its_schema(sdk, running_worker):
    schema = WEATHER["input_schema"]
    message = sdk.messages.create(
        model="demo",
        max_tokens=60,
        messages=[{"role": "user", "content": "Pick a city."}],
        output_config={"format": {"type": "json_schema", "schema": schema}},
    )

    assert message.stop_reason == "end_turn"
    assert json.loads(message.content[0].text)["city"] in ("Paris", "Rome")
    with pytest.raises(anthropic.BadRequestError) as caught:
        sdk.messages.create(
            model="demo",
            max_tokens=5,
            messages=HELLO,
            output_config={
                "format": {
                    "type": "json_schema",
                    "schema": {"type": "object", "properties": {"a": {"type": "string", "pattern": "(("}}},
                }
            },
        )
    assert "output_config.format.schema" in caught.value.body["error"]["message"]


def test_the_capabilities_name_each_protocols_base_url_and_its_sdk_works_there(api, web_server, running_worker):
    protocols = httpx.get(f"{web_server.base}/lmsp/v1/capabilities").json()["protocols"]
    assert set(protocols) == {"lmsp", "openai", "anthropic", "ollama"}

    there = anthropic.Anthropic(base_url=web_server.base + protocols["anthropic"], api_key=api.token, max_retries=0)
    assert there.messages.create(model="demo", max_tokens=2, messages=HELLO).type == "message"
    tags = httpx.get(
        f"{web_server.base}{protocols['ollama']}/api/tags", headers={"Authorization": f"Bearer {api.token}"}
    )
    assert "demo" in {model["name"] for model in tags.json()["models"]}
