"""Durable conversations: ``previous_response_id`` read from the database (PROFILE.md 10.2).

A response that continues another stores a copy of the conversation before
it (docs/decisions/0004-conversations-copy-their-context.md), so a
conversation goes on after every process and Redis restarted (tests/test_conversations.py), continues
background and task responses alike, resolves in one query however long it
is, and survives the deletion of its earlier turns. The refusals name the
field the way the ``openai`` package reads it.
"""

from __future__ import annotations

import uuid
from typing import Any

import openai
import pytest

from tasks_app.generation.spec import GenerationSpec, Turn
from tasks_app.models import Response, Task
from tasks_app.services.continuations import conversation_context
from tasks_app.states import TaskStatus
from tests.support.demo import ENDLESS_MODEL
from tests.support.moves import move
from tests.support.waiting import wait_until

# The endless model's turns are cut at this many tokens: a conversation of a known size, fast.
FEW = 8
INSTRUCTIONS = "Answer in French."
UNKNOWN_ID = "resp_01J8M8R5X4B9D2F6H1K3N7Q0ZW"


def sdk_for(base: str, token: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base}/lmsp/v1", api_key=token, max_retries=0, timeout=60)


def final(sdk: openai.OpenAI, response_id: str) -> Any:
    """``retrieve`` until the response has ended."""

    def probe() -> Any:
        response = sdk.responses.retrieve(response_id)
        return response if response.status not in {"queued", "in_progress"} else None

    return wait_until(probe, what=f"response {response_id} did not end", timeout=120)


def turns(context: list[Turn]) -> list[tuple[str, str]]:
    """A stored context as (role, text) pairs."""
    return [(turn.role, turn.text) for turn in context]


def context_of(response_id: str) -> list[Turn]:
    """The turns a response's spec copied from the conversation it continues."""
    spec = GenerationSpec.from_json(Response.objects.get(pk=response_id).generation)
    return list(spec.turns[: spec.context_turns])


# --------------------------------------------------------------------------- #
# Live: real servers and workers
# --------------------------------------------------------------------------- #


def test_a_background_response_is_continued_in_the_foreground_and_by_a_task(api, web_server, running_worker):
    sdk = sdk_for(web_server.base, api.token)
    created = sdk.responses.create(model=ENDLESS_MODEL, input="Start", max_output_tokens=FEW, background=True)
    started = final(sdk, created.id)

    foreground = sdk.responses.create(
        model=ENDLESS_MODEL, input="Go on", previous_response_id=created.id, max_output_tokens=FEW
    )
    accepted = sdk.post(
        "/tasks",
        body={
            "type": "response",
            "input": {
                "model": ENDLESS_MODEL,
                "input": "Go on",
                "previous_response_id": created.id,
                "max_output_tokens": FEW,
            },
        },
        cast_to=object,
    )

    def task_ended() -> dict[str, Any] | None:
        task = sdk.get(f"/tasks/{accepted['id']}", cast_to=object)
        return task if task["status"] in {"succeeded", "failed", "cancelled"} else None

    by_task = wait_until(task_ended, what="the task continuing a background response did not end")
    assert (started.status, foreground.status, by_task["status"]) == ("incomplete", "incomplete", "succeeded")
    # Both carry the same conversation and the same new input: the same prompt.
    assert by_task["response"]["usage"]["input_tokens"] == foreground.usage.input_tokens
    assert foreground.usage.input_tokens > started.usage.input_tokens + FEW // 2
    expected = [("user", "Start"), ("assistant", started.output_text)]
    assert turns(context_of(foreground.id)) == turns(context_of(by_task["response_id"])) == expected


def test_a_continued_conversation_starts_from_the_prefix_cache_and_its_usage_says_how_much(
    api, web_server, running_worker
):
    """The next turn, chained or echoed (openai-agents without ``previous_response_id``) or as a chat
    completion, skips what the worker computed for the turn before: its usage says how many tokens, and
    the same prompt gives the same text from the cache."""
    sdk = sdk_for(web_server.base, api.token)
    # A beginning of its own: no other test's prompt starts like it.
    instructions = f"{INSTRUCTIONS} This is conversation {uuid.uuid4().hex}."
    asked = {"model": ENDLESS_MODEL, "instructions": instructions, "max_output_tokens": FEW, "temperature": 0}
    one = sdk.responses.create(input="First question", **asked)
    chained = sdk.responses.create(input="Second question", previous_response_id=one.id, **asked)
    history = [
        {"role": "user", "content": "First question"},
        {"role": "assistant", "content": one.output_text},
        {"role": "user", "content": "Second question"},
    ]
    echoed = sdk.responses.create(input=history, **asked)
    chat = sdk.chat.completions.create(
        model=ENDLESS_MODEL,
        messages=[{"role": "system", "content": instructions}, *history],
        max_tokens=FEW,
        temperature=0,
    )

    first, second = one.usage, chained.usage
    # Only the chat template's first few tokens were seen before this conversation.
    assert first.input_tokens_details.cached_tokens < first.input_tokens // 2
    # All of the first turn's prompt (and of its answer, as far as the next prompt spells it the same).
    assert second.input_tokens_details.cached_tokens >= first.input_tokens
    assert second.input_tokens > second.input_tokens_details.cached_tokens
    # The same prompt again: all but its last token (whose logits are the first sample) came from the cache.
    assert echoed.usage.input_tokens == chat.usage.prompt_tokens == second.input_tokens
    assert echoed.usage.input_tokens_details.cached_tokens == second.input_tokens - 1
    assert chat.usage.prompt_tokens_details.cached_tokens == second.input_tokens - 1
    assert echoed.output_text == chat.choices[0].message.content == chained.output_text
    # What the worker stored says the same.
    stored = Response.objects.get(pk=echoed.id).usage
    assert stored["input_tokens_details"]["cached_tokens"] == second.input_tokens - 1


def test_deleting_a_response_leaves_the_ones_that_continued_it_readable_and_continuable(
    api, web_server, running_worker
):
    sdk = sdk_for(web_server.base, api.token)
    one = sdk.responses.create(model=ENDLESS_MODEL, input="First", max_output_tokens=FEW)
    two = sdk.responses.create(model=ENDLESS_MODEL, input="Second", previous_response_id=one.id, max_output_tokens=FEW)

    sdk.responses.delete(one.id)
    three = sdk.responses.create(model=ENDLESS_MODEL, input="Third", previous_response_id=two.id, max_output_tokens=FEW)

    assert sdk.responses.retrieve(two.id).output_text == two.output_text
    assert three.status == "incomplete"
    assert three.usage.input_tokens > two.usage.input_tokens
    # The deleted turn is still part of the conversation: the later responses kept their own copies.
    assert turns(context_of(three.id))[:2] == [("user", "First"), ("assistant", one.output_text)]
    with pytest.raises(openai.NotFoundError) as gone:
        sdk.responses.create(model=ENDLESS_MODEL, input="Again", previous_response_id=one.id, max_output_tokens=FEW)
    assert (gone.value.code, gone.value.param) == ("response_not_found", "previous_response_id")


# --------------------------------------------------------------------------- #
# In process: refusals and the cost of a chain
# --------------------------------------------------------------------------- #


def finish(task_id: str, text: str = "Bonjour") -> None:
    """End a task as a worker would: claimed, started, succeeded with ``text``."""
    for status in (TaskStatus.LOADING, TaskStatus.RUNNING):
        assert move(task_id, status).won
    usage = {"input_tokens": 5, "output_tokens": 1, "total_tokens": 6}
    assert move(task_id, TaskStatus.SUCCEEDED, text=text, usage=usage, output_tokens=1).won


def continue_task(api, previous_response_id: str, **request: Any) -> dict[str, Any]:
    """A queued task continuing ``previous_response_id`` (nobody consumes the test's queue)."""
    body = {"model": "demo", "input": "Go on", "previous_response_id": previous_response_id, **request}
    reply = api.post("/lmsp/v1/tasks", {"type": "response", "input": body})
    assert reply.status_code == 202, reply.content
    return reply.json()


def refusal(api, previous_response_id: str) -> list[tuple[int, str, str, str]]:
    """What ``POST /responses`` and ``POST /tasks`` answer to continuing ``previous_response_id``."""
    body = {"model": "demo", "input": "Go on", "previous_response_id": previous_response_id}
    answers = [
        api.post("/lmsp/v1/responses", body),
        api.post("/lmsp/v1/tasks", {"type": "response", "input": body}),
    ]
    found = []
    for answer in answers:
        problem = answer.json()
        assert problem["error"]["code"] == problem["code"]
        # The field, as RFC 9457 ``errors`` name it and where the ``openai`` package reads ``exc.param``
        # (a top-level ``param`` is unsupported_parameter's alone, PROFILE.md section 2).
        found.append((answer.status_code, problem["code"], problem["errors"][0]["field"], problem["error"]["param"]))
    return found


def test_continuing_what_the_client_cannot_continue_is_refused_and_names_the_field(api, other_api, queue):
    theirs = other_api.create_task("Theirs").json()
    finish(theirs["id"])
    unstored = api.post(
        "/lmsp/v1/tasks", {"type": "response", "input": {"model": "demo", "input": "x", "store": False}}
    )
    finish(unstored.json()["id"])
    waiting = api.create_task("Still waiting").json()
    before = Task.objects.count()

    not_found = [
        (404, "response_not_found", "previous_response_id", "previous_response_id"),
        (404, "response_not_found", "input.previous_response_id", "input.previous_response_id"),
    ]
    assert refusal(api, UNKNOWN_ID) == not_found
    assert refusal(api, theirs["response_id"]) == not_found
    assert refusal(api, unstored.json()["response_id"]) == not_found
    assert refusal(api, waiting["response_id"]) == [
        (409, "response_not_finished", "previous_response_id", "previous_response_id"),
        (409, "response_not_finished", "input.previous_response_id", "input.previous_response_id"),
    ]
    assert Task.objects.count() == before
    # Once it has finished, the same response is continued.
    finish(waiting["id"])
    assert continue_task(api, waiting["response_id"])["status"] == "queued"


@pytest.mark.parametrize("endpoint", ["tasks", "responses"])
def test_a_keyed_retry_gets_its_first_answer_after_the_response_it_continued_was_deleted(api, queue, endpoint):
    first = api.create_task("Turn 1").json()
    finish(first["id"])
    body = {"model": "demo", "input": "Go on", "previous_response_id": first["response_id"]}
    path, sent = (
        ("/lmsp/v1/tasks", {"type": "response", "input": body})
        if endpoint == "tasks"
        else ("/lmsp/v1/responses", {**body, "background": True})
    )
    key = {"Idempotency-Key": f"continue-{endpoint}"}
    accepted = api.post(path, sent, headers=key)
    assert accepted.status_code in {200, 202}, accepted.content

    deleted = api.http.delete(f"/lmsp/v1/responses/{first['response_id']}", headers=api._headers(None))
    assert deleted.status_code == 200, deleted.content
    tasks = Task.objects.count()
    again = api.post(path, sent, headers=key)

    # The client whose answer was lost learns of the task it started, not of the deletion.
    assert (again.status_code, again.json()) == (accepted.status_code, accepted.json())
    assert Task.objects.count() == tasks
    # A new request (no key, or another) is refused: there is nothing left to continue.
    refused = api.post(path, sent, headers={"Idempotency-Key": f"other-{endpoint}"})
    assert (refused.status_code, refused.json()["code"]) == (404, "response_not_found")


def test_resolving_a_chain_costs_one_query_whatever_its_depth(api, queue, django_assert_num_queries):
    tips: dict[int, str] = {}
    previous = api.create_task("Turn 1").json()
    finish(previous["id"], "Answer 1")
    tips[1] = previous["response_id"]
    for depth in range(2, 31):
        previous = continue_task(api, tips[depth - 1], input=f"Turn {depth}")
        finish(previous["id"], f"Answer {depth}")
        tips[depth] = previous["response_id"]

    for depth in (1, 10, 30):
        with django_assert_num_queries(1):
            context = conversation_context(client=api.client, previous_response_id=tips[depth])
        assert turns(context) == [
            pair for n in range(1, depth + 1) for pair in (("user", f"Turn {n}"), ("assistant", f"Answer {n}"))
        ]
