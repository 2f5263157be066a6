"""``POST /chat/completions`` (PROFILE.md 10.3) with the ``openai`` package as the real client.

A chat completion runs as a response task on the real worker: its text is
the response's text, its stream the task's events as chunks, its errors the
same problems; fields it cannot honour are refused by their chat names.
"""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from tasks_app.models import Response, Task
from tasks_app.states import TaskStatus
from tests.support.demo import ENDLESS_MODEL
from tests.support.waiting import wait_until

# A client's protocol over the engine, whose writes the lifecycle's, recovery's and the adapters' own tests
# test on both databases: the SQLite pass only (pyproject.toml, the sqlite_pass marker).
pytestmark = pytest.mark.sqlite_pass

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"}]


@pytest.fixture
def sdk(api, web_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{web_server.base}/lmsp/v1", api_key=api.token, max_retries=0, timeout=60)


def response_of(chat_id: str) -> Response:
    return Response.objects.get(pk="resp_" + chat_id.removeprefix("chatcmpl-"))


def test_a_chat_completion_is_the_response_of_the_same_request(sdk, running_worker):
    chat = sdk.chat.completions.create(model="demo", messages=MESSAGES, max_tokens=12, seed=7, temperature=0)

    same = sdk.responses.create(
        model="demo",
        input=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"}],
        max_output_tokens=12,
        temperature=0,
        extra_body={"seed": 7},
    )
    choice = chat.choices[0]
    assert chat.object == "chat.completion"
    assert choice.message.role == "assistant"
    assert choice.message.content == same.output_text
    assert choice.finish_reason == ("length" if same.status == "incomplete" else "stop")
    assert chat.usage.prompt_tokens == same.usage.input_tokens
    assert chat.usage.completion_tokens == same.usage.output_tokens
    assert chat.usage.total_tokens == chat.usage.prompt_tokens + chat.usage.completion_tokens
    # Not a stored response: a chat completion cannot be continued with previous_response_id.
    assert response_of(chat.id).request["store"] is False


def test_max_tokens_and_max_completion_tokens_end_the_text_with_finish_reason_length(sdk, running_worker):
    for limit in ({"max_tokens": 3}, {"max_completion_tokens": 3}):
        chat = sdk.chat.completions.create(model=ENDLESS_MODEL, messages=MESSAGES, **limit)
        assert chat.choices[0].finish_reason == "length"
        assert chat.usage.completion_tokens == 3


@pytest.mark.parametrize("include_usage", [False, True], ids=["plain", "include_usage"])
def test_a_stream_is_the_texts_chunks_then_finish_reason_then_usage_then_done(
    sdk, running_worker, web_server, api, include_usage
):
    options = {"stream_options": {"include_usage": True}} if include_usage else {}
    chunks = list(
        sdk.chat.completions.create(
            model=ENDLESS_MODEL, messages=MESSAGES, max_tokens=20, seed=3, stream=True, **options
        )
    )

    assert {chunk.object for chunk in chunks} == {"chat.completion.chunk"}
    assert len({chunk.id for chunk in chunks}) == 1
    assert chunks[0].choices[0].delta.role == "assistant"
    ends = [chunk for chunk in chunks if chunk.choices and chunk.choices[0].finish_reason]
    assert [chunk.choices[0].finish_reason for chunk in ends] == ["length"]
    text = "".join(chunk.choices[0].delta.content or "" for chunk in chunks if chunk.choices)
    response = response_of(chunks[0].id)
    assert text == "".join(part["text"] for item in response.output for part in item["content"])
    if include_usage:
        assert chunks[-1].choices == []
        assert chunks[-1].usage.completion_tokens == 20
        assert chunks[-1].usage.prompt_tokens == response.usage["input_tokens"]
        assert all(chunk.usage is None for chunk in chunks[:-1])
    else:
        assert chunks[-1] is ends[0]
        assert all(chunk.usage is None for chunk in chunks)
    # The raw stream ends with [DONE], as every Chat Completions client expects.
    raw = httpx.post(
        f"{web_server.base}/lmsp/v1/chat/completions",
        json={"model": "demo", "messages": MESSAGES, "max_tokens": 2, "stream": True},
        headers={"Authorization": f"Bearer {api.token}"},
        timeout=60,
    )
    assert raw.text.rstrip().endswith("data: [DONE]")


def test_a_client_that_leaves_a_stream_cancels_its_generation(api, web_server, running_worker):
    with httpx.stream(
        "POST",
        f"{web_server.base}/lmsp/v1/chat/completions",
        json={"model": ENDLESS_MODEL, "messages": MESSAGES, "max_tokens": 100000, "stream": True},
        headers={"Authorization": f"Bearer {api.token}"},
        timeout=60,
    ) as stream:
        first = next(line for line in stream.iter_lines() if line.startswith("data: "))
    chat_id = json.loads(first.removeprefix("data: "))["id"]
    task = Task.objects.get(response_id="resp_" + chat_id.removeprefix("chatcmpl-"))

    wait_until(
        lambda: Task.objects.get(pk=task.pk).status == TaskStatus.CANCELLED,
        what="the generation of a chat stream whose client left was not cancelled",
    )


def test_history_with_tool_calls_and_tool_results_is_accepted_and_rendered(sdk, running_worker):
    messages = [
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": "weather", "arguments": '{"city": "Paris"}'}}
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]
    chat = sdk.chat.completions.create(model="demo", messages=messages, max_tokens=4)
    stored = response_of(chat.id).request["input"]
    assert stored[1] == {
        "type": "function_call",
        "call_id": "call_1",
        "name": "weather",
        "arguments": '{"city": "Paris"}',
    }
    assert stored[2] == {"type": "function_call_output", "call_id": "call_1", "output": "sunny"}
    # The call reached the prompt (the demo template reads no tool_calls: written as <tool_call> text).
    plain = sdk.chat.completions.create(model="demo", messages=messages[:1], max_tokens=4)
    assert chat.usage.prompt_tokens > plain.usage.prompt_tokens + 10


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"n": 2}, "n"),
        ({"store": True}, "store"),
        ({"logprobs": True}, "logprobs"),
        ({"logit_bias": {"5": 10}}, "logit_bias"),
        (
            {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
            "messages[0].content[0].type",
        ),
        ({"audio": {"voice": "alloy", "format": "mp3"}}, "audio"),
    ],
    ids=["n", "store", "logprobs", "logit_bias", "image", "audio"],
)
def test_what_cannot_be_honoured_is_refused_by_its_chat_name(transactional_db, sdk, fields, param):
    before = Task.objects.count()
    with pytest.raises(openai.BadRequestError) as raised:
        sdk.chat.completions.create(**{"model": "demo", "messages": MESSAGES, **fields})
    assert raised.value.code == "unsupported_parameter"
    assert raised.value.param == param
    assert Task.objects.count() == before
