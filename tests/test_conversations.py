"""OpenAI's Conversations API (PROFILE.md 12.1; docs/conversations.md), through the real clients.

The openai SDK's ``conversations.*`` and openai-agents' ``OpenAIConversationsSession``
against a real web server and worker: a conversation's items are the
context of the responses that name it, a finished response adds its input
and output in the transaction of its terminal event, a failed or cancelled
one adds nothing, a second response while one runs is ``409
conversation_busy``, and a conversation goes on after every process and
Redis restarted.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import agents
import openai
import pytest
from agents import Agent, ModelSettings, OpenAIResponsesModel, Runner
from agents.memory import OpenAIConversationsSession

from tasks_app.generation.spec import GenerationSpec
from tasks_app.models import ConversationItem, Response
from tests.support.demo import DEMO_MODEL, ENDLESS_MODEL
from tests.support.waiting import wait_until

# The endless model's answers are cut at this many tokens (``incomplete``, which a conversation keeps).
FEW = 8
INSTRUCTIONS = "Answer in French."
# openai-agents raises on an incomplete response: its runs use `demo`, which ends by itself well within this.
TO_THE_END = 2000


def sdk_for(base: str, token: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base}/lmsp/v1", api_key=token, max_retries=0, timeout=60)


def texts(sdk: openai.OpenAI, conversation_id: str) -> list[tuple[str, str]]:
    """The conversation's items, oldest first, as (role, text) pairs."""
    return [
        (item.role, "".join(part.text for part in item.content))
        for item in sdk.conversations.items.list(conversation_id, order="asc", limit=100)
    ]


def context_of(response_id: str) -> list[tuple[str, str]]:
    """The turns a response's spec copied from its conversation, as (role, text) pairs."""
    spec = GenerationSpec.from_json(Response.objects.get(pk=response_id).generation)
    return [(turn.role, turn.text) for turn in spec.turns[: spec.context_turns]]


def final(sdk: openai.OpenAI, response_id: str) -> Any:
    def ended() -> Any:
        response = sdk.responses.retrieve(response_id)
        return response if response.status not in {"queued", "in_progress"} else None

    return wait_until(ended, what=f"response {response_id} did not end", timeout=120)


def test_the_openai_sdk_creates_reads_lists_and_deletes_conversations_and_their_items(
    transactional_db, api, other_api, web_server
):
    sdk = sdk_for(web_server.base, api.token)
    first = [
        {"type": "message", "role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": [{"type": "output_text", "text": "4"}]},
    ]
    created = sdk.conversations.create(items=first, metadata={"topic": "sums"})
    assert created.id.startswith("conv_") and created.object == "conversation"
    assert sdk.conversations.retrieve(created.id).metadata == {"topic": "sums"}
    assert sdk.conversations.update(created.id, metadata={"topic": "math"}).metadata == {"topic": "math"}

    added = sdk.conversations.items.create(
        created.id,
        items=[
            {"type": "function_call", "call_id": "call_1", "name": "add", "arguments": '{"a":2}'},
            {"type": "function_call_output", "call_id": "call_1", "output": "4"},
            {"role": "user", "content": "And 3+3?"},
        ],
    )
    assert [item.type for item in added.data] == ["function_call", "function_call_output", "message"]
    # Newest first unless asked otherwise, as OpenAI lists them; pages follow `after`.
    newest = sdk.conversations.items.list(created.id, limit=2)
    assert [item.type for item in newest.data] == ["message", "function_call_output"] and newest.has_more
    every = list(sdk.conversations.items.list(created.id, order="asc", limit=2))
    assert [item.id for item in every] == [
        *[item.id for item in sdk.conversations.items.list(created.id, order="asc", limit=2).data],
        *[item.id for item in added.data],
    ]
    assert (every[0].role, every[0].content[0].type) == ("user", "input_text")
    assert (every[1].role, every[1].content[0].type, every[1].content[0].text) == ("assistant", "output_text", "4")
    assert sdk.conversations.items.retrieve(every[2].id, conversation_id=created.id).name == "add"

    after_delete = sdk.conversations.items.delete(every[2].id, conversation_id=created.id)
    assert after_delete.id == created.id
    assert [item.type for item in sdk.conversations.items.list(created.id, order="asc")] == [
        "message",
        "message",
        "function_call_output",
        "message",
    ]
    with pytest.raises(openai.NotFoundError):
        sdk.conversations.items.retrieve(every[2].id, conversation_id=created.id)

    # Another client's conversation does not exist for it, whatever it tries.
    other = sdk_for(web_server.base, other_api.token)
    for attempt in (
        lambda: other.conversations.retrieve(created.id),
        lambda: other.conversations.items.list(created.id),
        lambda: other.conversations.items.create(created.id, items=[{"role": "user", "content": "hi"}]),
        lambda: other.conversations.delete(created.id),
        lambda: other.responses.create(model=DEMO_MODEL, input="hi", conversation=created.id),
    ):
        with pytest.raises(openai.NotFoundError) as refused:
            attempt()
        assert refused.value.body["code"] == "conversation_not_found"

    assert sdk.conversations.delete(created.id).deleted is True
    with pytest.raises(openai.NotFoundError):
        sdk.conversations.retrieve(created.id)
    assert not ConversationItem.objects.filter(conversation_id=created.id).exists()


def test_responses_read_a_conversation_and_add_their_turn_when_they_finish(api, web_server, running_worker):
    """Foreground, background and a task alike: each reads every earlier turn and adds its own."""
    sdk = sdk_for(web_server.base, api.token)
    conversation = sdk.conversations.create(items=[{"role": "user", "content": "Hello"}])

    foreground = sdk.responses.create(
        model=ENDLESS_MODEL, input="First question", conversation=conversation.id, max_output_tokens=FEW
    )
    assert (foreground.status, foreground.conversation.id) == ("incomplete", conversation.id)
    background = sdk.responses.create(
        model=ENDLESS_MODEL,
        input=[{"role": "user", "content": "Second question"}],
        conversation={"id": conversation.id},
        max_output_tokens=FEW,
        background=True,
    )
    background = final(sdk, background.id)
    accepted = sdk.post(
        "/tasks",
        body={
            "type": "response",
            "input": {
                "model": ENDLESS_MODEL,
                "input": "Third question",
                "conversation": conversation.id,
                "max_output_tokens": FEW,
            },
        },
        cast_to=object,
    )
    by_task = final(sdk, accepted["response_id"])

    assert texts(sdk, conversation.id) == [
        ("user", "Hello"),
        ("user", "First question"),
        ("assistant", foreground.output_text),
        ("user", "Second question"),
        ("assistant", background.output_text),
        ("user", "Third question"),
        ("assistant", by_task.output_text),
    ]
    assert context_of(by_task.id) == texts(sdk, conversation.id)[:5]
    assert by_task.usage.input_tokens > background.usage.input_tokens > foreground.usage.input_tokens
    # The answer's item is the response's own output item, id and all.
    assert sdk.conversations.items.retrieve(foreground.output[0].id, conversation_id=conversation.id).id == (
        foreground.output[0].id
    )


def test_a_busy_conversation_refuses_a_second_response_and_a_cancelled_one_adds_nothing(
    api, web_server, running_worker
):
    sdk = sdk_for(web_server.base, api.token)
    conversation = sdk.conversations.create(items=[{"role": "user", "content": "Hello"}])
    running = sdk.responses.create(
        model=ENDLESS_MODEL, input="Go on forever", conversation=conversation.id, background=True
    )
    with pytest.raises(openai.ConflictError) as refused:
        sdk.responses.create(model=ENDLESS_MODEL, input="Me too", conversation=conversation.id, max_output_tokens=FEW)
    assert refused.value.body["code"] == "conversation_busy"
    assert running.id in refused.value.message
    # Its input is not listed while it runs; items the client adds meanwhile are.
    sdk.conversations.items.create(conversation.id, items=[{"role": "user", "content": "A note"}])
    assert texts(sdk, conversation.id) == [("user", "Hello"), ("user", "A note")]

    wait_until(lambda: sdk.responses.retrieve(running.id).status == "in_progress", what="it never started")
    sdk.responses.cancel(running.id)
    assert final(sdk, running.id).status == "cancelled"
    assert texts(sdk, conversation.id) == [("user", "Hello"), ("user", "A note")]
    assert not ConversationItem.objects.filter(response_id=running.id).exists()
    # Idle again: the next response reads what is there, and adds its turn.
    after = sdk.responses.create(
        model=ENDLESS_MODEL, input="Again", conversation=conversation.id, max_output_tokens=FEW
    )
    assert context_of(after.id) == [("user", "Hello"), ("user", "A note")]
    assert texts(sdk, conversation.id)[2:] == [("user", "Again"), ("assistant", after.output_text)]


def test_a_conversation_and_a_previous_response_together_or_unstored_are_refused_by_name(
    transactional_db, api, web_server
):
    sdk = sdk_for(web_server.base, api.token)
    conversation = sdk.conversations.create()
    for asked, field in (({"previous_response_id": "resp_x"}, "conversation"), ({"store": False}, "store")):
        with pytest.raises(openai.BadRequestError) as refused:
            sdk.responses.create(model=DEMO_MODEL, input="Hi", conversation=conversation.id, **asked)
        # Named where the openai package reads the field.
        assert refused.value.param == field
    assert list(sdk.conversations.items.list(conversation.id)) == []


def test_a_conversation_and_a_response_chain_go_on_after_the_web_server_the_worker_and_redis_restarted(
    private_stack,
):
    """Both ways to keep a conversation: the Conversations API's, and ``previous_response_id``'s chain
    (decision 0004, tests/test_continuations.py), one pair of stacks for both."""
    with private_stack("before-restart") as stack:
        sdk = sdk_for(stack.base, stack.token)
        conversation = sdk.conversations.create(items=[{"role": "user", "content": "Hello"}])
        one = sdk.responses.create(
            model=ENDLESS_MODEL, input="First question", conversation=conversation.id, max_output_tokens=FEW
        )
        asked = {"model": ENDLESS_MODEL, "max_output_tokens": FEW}
        first = sdk.responses.create(instructions=INSTRUCTIONS, input="First question", **asked)
        second = sdk.responses.create(input="Second question", previous_response_id=first.id, **asked)
    # Every process of the first stack is gone, its Redis too: only the database remembers the conversations.
    with private_stack("after-restart") as stack:
        sdk = sdk_for(stack.base, stack.token)
        two = sdk.responses.create(
            model=ENDLESS_MODEL, input="Second question", conversation=conversation.id, max_output_tokens=FEW
        )
        listed = texts(sdk, conversation.id)
        third = sdk.responses.create(input="Third question", previous_response_id=second.id, **asked)

    assert context_of(two.id) == [("user", "Hello"), ("user", "First question"), ("assistant", one.output_text)]
    assert listed[-2:] == [("user", "Second question"), ("assistant", two.output_text)]
    assert third.usage.input_tokens > second.usage.input_tokens > first.usage.input_tokens
    assert context_of(third.id) == [
        ("user", "First question"),
        ("assistant", first.output_text),
        ("user", "Second question"),
        ("assistant", second.output_text),
    ]
    # Instructions belong to the request that gives them: turn 1's reached neither later turn.
    assert INSTRUCTIONS not in json.dumps(Response.objects.get(pk=third.id).request)
    assert third.instructions is None


async def agents_with_a_session(base_url: str, token: str) -> tuple[list[Any], list[dict[str, Any]], str]:
    """Three turns of one agent over an ``OpenAIConversationsSession``, then a run on the conversation itself."""
    async with openai.AsyncOpenAI(base_url=base_url, api_key=token, max_retries=0) as client:
        agent = Agent(
            name="assistant",
            instructions="Be brief.",
            model=OpenAIResponsesModel(model=DEMO_MODEL, openai_client=client),
            model_settings=ModelSettings(max_tokens=TO_THE_END),
        )
        session = OpenAIConversationsSession(openai_client=client)
        runs = [await Runner.run(agent, question, session=session) for question in ("Hello", "And then?", "Bye")]
        history = await session.get_items()
        # The server-side way: the run names the conversation, the service reads and adds to it.
        on_conversation = await Runner.run(agent, "One more", conversation_id=session.session_id)
        return [*runs, on_conversation], history, session.session_id


# A client's protocol over the conversation services the tests above check on both databases (decision 0003).
@pytest.mark.sqlite_pass
def test_openai_agents_keeps_its_session_in_a_conversation_over_several_turns(api, web_server, running_worker):
    agents.set_tracing_disabled(True)
    runs, history, conversation_id = asyncio.run(agents_with_a_session(f"{web_server.base}/lmsp/v1", api.token))

    said = [(item["role"], item["content"][0]["text"]) for item in history]
    assert said == [
        ("user", "Hello"),
        ("assistant", runs[0].final_output),
        ("user", "And then?"),
        ("assistant", runs[1].final_output),
        ("user", "Bye"),
        ("assistant", runs[2].final_output),
    ]
    # Each turn was sent the session's history before its own question.
    third = Response.objects.get(pk=runs[2].last_response_id)
    assert [item["role"] for item in third.request["input"]] == ["user", "assistant", "user", "assistant", "user"]
    last = Response.objects.get(pk=runs[3].last_response_id)
    assert last.conversation_id == conversation_id
    assert context_of(last.pk) == said
    assert texts(sdk_for(web_server.base, api.token), conversation_id)[-2:] == [
        ("user", "One more"),
        ("assistant", runs[3].final_output),
    ]
