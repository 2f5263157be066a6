"""A stored request as the chat template's messages: conversations, function calls, truncation (PROFILE.md 10.1)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.specs import prompt_for
from workers.backends.base import prompt_messages
from workers.backends.onnx.chat_template import ChatTemplate, tool_calls_as_text

pytestmark = pytest.mark.database_free

CALL = {"type": "function_call", "call_id": "call_1", "name": "weather", "arguments": '{"city": "Paris"}'}
RESULT = {"type": "function_call_output", "call_id": "call_1", "output": "sunny"}


def test_the_continued_conversation_comes_first_and_instructions_stay_the_new_requests():
    request = {
        "instructions": "Be brief.",
        "context": [
            {"type": "message", "role": "user", "content": "Hi"},
            {"type": "message", "role": "assistant", "content": "Hello!"},
        ],
        "input": "And now?",
    }
    assert prompt_messages(prompt_for(request)) == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": "And now?"},
    ]


def test_function_calls_join_the_assistant_message_before_them_and_results_are_tool_messages():
    request = {
        "input": [
            {"type": "message", "role": "user", "content": "Weather?"},
            {"type": "message", "role": "assistant", "content": "Let me look."},
            CALL,
            {**CALL, "call_id": "call_2", "arguments": '{"city": "Rome"}'},
            RESULT,
            {**RESULT, "call_id": "call_2", "output": "rain"},
        ]
    }
    messages = prompt_messages(prompt_for(request))
    assert messages[1] == {
        "role": "assistant",
        "content": "Let me look.",
        "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "weather", "arguments": {"city": "Paris"}}},
            {"id": "call_2", "type": "function", "function": {"name": "weather", "arguments": {"city": "Rome"}}},
        ],
    }
    assert messages[2:] == [
        {"role": "tool", "tool_call_id": "call_1", "name": "weather", "content": "sunny"},
        {"role": "tool", "tool_call_id": "call_2", "name": "weather", "content": "rain"},
    ]


def test_a_call_without_an_assistant_message_before_it_opens_one_and_broken_arguments_stay_text():
    messages = prompt_messages(prompt_for({"input": [{**CALL, "arguments": "{not json"}]}))
    assert messages == [
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": "weather", "arguments": "{not json"}}
            ],
        }
    ]


def test_a_template_that_reads_no_tool_calls_gets_them_written_into_the_text(tmp_path: Path):
    plain = ChatTemplate(
        "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}", tmp_path / "plain", {}
    )
    messages = prompt_messages(
        prompt_for({"input": [{"type": "message", "role": "user", "content": "Weather?"}, CALL, RESULT]})
    )

    prompt = plain.render(messages)

    assert '[assistant] <tool_call>{"name": "weather", "arguments": {"city": "Paris"}}</tool_call>' in prompt
    assert "[tool] sunny" in prompt
    assert tool_calls_as_text(messages)[1]["content"] == (
        '<tool_call>{"name": "weather", "arguments": {"city": "Paris"}}</tool_call>'
    )


def test_a_template_that_reads_tool_calls_gets_them_as_they_are(tmp_path: Path):
    reading = ChatTemplate(
        "{% for m in messages %}{% for c in m.get('tool_calls') or [] %}CALL {{ c.function.name }} "
        "{{ c.function.arguments.city }}{% endfor %}{% endfor %}",
        tmp_path / "tools",
        {},
    )
    assert reading.render(prompt_messages(prompt_for({"input": [CALL]}))) == "CALL weather Paris"


def test_truncation_may_drop_every_item_but_the_newest():
    request = {"context": [{"type": "message", "role": "user", "content": "a"}] * 3, "input": "b", "truncation": "auto"}
    assert prompt_for(request).droppable == 3
    assert prompt_messages(prompt_for(request), dropped=3) == [{"role": "user", "content": "b"}]
    assert prompt_for({"input": "only", "truncation": "auto"}).droppable == 0
    assert prompt_for({**request, "truncation": "disabled"}).droppable == 0
