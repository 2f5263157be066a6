"""The JS OpenAI Agents SDK (``@openai/agents``, pinned in tests/clients/js) against the real service.

``tests/clients/js/agents_chat.mjs`` runs an agent for two turns, the second
sending the first one's history back as the SDK builds it: on Chat
Completions it echoes the assistant message's own members (``role``,
``refusal``, ``tool_calls``...) inside the text part, which PROFILE.md 10.1
says are ignored, never a reason to refuse. It runs under node against the
session's uvicorn and Celery worker; the checks are on what the service
stored. The unit test below holds the echoed part shapes without node.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

from tasks_app.models import Response
from tasks_app.openai.chat_completions.serializers import ChatContentField
from tasks_app.openai.responses.input_items import MessageContentField
from tests.support.demo import DEMO_MODEL
from tests.support.problems import assert_problem

# A client's protocol over the engine, whose writes the lifecycle's, recovery's and the adapters' own tests
# test on both databases: the SQLite pass only (pyproject.toml, the sqlite_pass marker).
pytestmark = pytest.mark.sqlite_pass

JS = Path(__file__).parent / "clients" / "js"
SCRIPT = JS / "agents_chat.mjs"
NODE = shutil.which("node")
INSTALLED = (JS / "node_modules" / "@openai" / "agents" / "package.json").is_file()

needs_sdk = pytest.mark.skipif(
    NODE is None or not INSTALLED,
    reason="the JS Agents SDK is not installed: run `npm ci` in tests/clients/js (CI does)",
)


def run_agent(base: str, token: str, api: str) -> dict[str, Any]:
    env = {
        **os.environ,
        "LMSP_BASE_URL": f"{base}/lmsp/v1",
        "LMSP_TOKEN": token,
        "LMSP_MODEL": DEMO_MODEL,
        "LMSP_API": api,
        # The demo model ends by itself well within this (fixture_models.demo); the SDK refuses an incomplete answer.
        "LMSP_MAX_TOKENS": "2000",
    }
    done = subprocess.run(
        [NODE, str(SCRIPT)], cwd=JS, env=env, capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def stored_text(response: Response) -> str:
    return "".join(part["text"] for item in response.output if item["type"] == "message" for part in item["content"])


def text_of(message: dict[str, Any]) -> str:
    content = message["content"]
    return content if isinstance(content, str) else "".join(part["text"] for part in content)


@needs_sdk
@pytest.mark.parametrize("api_name", ["chat", "responses"])
def test_the_js_agents_sdk_holds_a_two_turn_conversation(api, web_server, running_worker, api_name):
    result = run_agent(web_server.base, api.token, api_name)

    first, second = Response.objects.filter(client=api.client).order_by("created_at", "id")
    assert (first.status, second.status) == ("completed", "completed")
    assert [turn["output"] for turn in result["turns"]] == [stored_text(first), stored_text(second)]
    # The second turn carried the first one's exchange back, as the model saw it.
    # (Chat Completions carries the agent's instructions as a system message; Responses as `instructions`.)
    messages = [message for message in second.request["input"] if message["role"] != "system"]
    assert [message["role"] for message in messages] == ["user", "assistant", "user"]
    assert text_of(messages[1]) == stored_text(first)
    if api_name == "responses":
        assert [turn["response_id"] for turn in result["turns"]] == [first.id, second.id]


# What clients send back inside a part of an earlier answer: the message's own members (the JS Agents SDK
# spreads them into the part), OpenAI's annotations, and members yet to come.
ECHOED_PARTS = [
    pytest.param(
        {"type": "text", "text": "Hi", "role": "assistant", "refusal": None, "tool_calls": [], "annotations": []},
        {"type": "text", "text": "Hi"},
        id="js-agents-message-members",
    ),
    pytest.param(
        {"type": "text", "text": "Hi", "cache_control": {"type": "ephemeral"}}, {"type": "text", "text": "Hi"}
    ),
    pytest.param(
        {"type": "refusal", "refusal": "No.", "role": "assistant", "annotations": []},
        {"type": "refusal", "text": "No."},
        id="refusal-with-members",
    ),
]


@pytest.mark.parametrize(("part", "kept"), ECHOED_PARTS)
def test_extra_members_of_an_echoed_chat_part_are_ignored(part, kept):
    assert ChatContentField().to_internal_value([part]) == [kept]


# The same on the Responses API: an output part of ours echoed back, and what other clients add.
ECHOED_RESPONSE_PARTS = [
    pytest.param(
        {"type": "output_text", "text": "Hi", "annotations": [], "logprobs": [], "refusal": None, "role": "assistant"},
        {"type": "output_text", "text": "Hi"},
        id="output_text-with-members",
    ),
    pytest.param(
        {"type": "input_text", "text": "Hi", "cache_control": {"type": "ephemeral"}},
        {"type": "input_text", "text": "Hi"},
        id="input_text-cache_control",
    ),
    pytest.param({"type": "refusal", "refusal": "No.", "annotations": []}, {"type": "output_text", "text": "No."}),
]


@pytest.mark.parametrize(("part", "kept"), ECHOED_RESPONSE_PARTS)
def test_extra_members_of_an_echoed_responses_part_are_ignored(part, kept):
    assert MessageContentField().to_internal_value([part]) == [kept]


@pytest.mark.parametrize(
    ("part", "field"),
    [
        ({"type": "text", "role": "assistant"}, "messages.0.content.0.text"),
        ({"type": "text", "text": 5}, "messages.0.content.0.text"),
        ({"type": "refusal", "text": "No."}, "messages.0.content.0.refusal"),
        ({"type": "txt", "text": "Hi"}, "messages.0.content.0.type"),
        ("Hi", "messages.0.content.0"),
    ],
)
def test_a_refused_chat_part_names_the_member_at_fault(api, part, field):
    reply = api.post(
        "/lmsp/v1/chat/completions", {"model": DEMO_MODEL, "messages": [{"role": "user", "content": [part]}]}
    )

    body = assert_problem(reply, 400, "invalid_request")
    assert [error["field"] for error in body["errors"]] == [field]
    assert field in body["detail"]
