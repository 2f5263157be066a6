"""A continued conversation goes to the worker that holds its prefix cache (``tasks_app.plumbing.affinity``).

First the routing decision alone (a real Redis, no worker): where the run
message of a response that continues another lands, for each state of the
previous worker's presence. Then two real workers: a conversation's turns
stay on the node that ran the first one, reading their start from its
cache, and move to the other node once that one stopped.
"""

from __future__ import annotations

from contextlib import ExitStack
from itertools import pairwise
from typing import Any

import pytest

from tasks_app.core import lifecycle
from tasks_app.models import Task
from tasks_app.plumbing.affinity import (
    affinity_announce,
    affinity_queue,
    affinity_queue_for,
    affinity_remember,
    affinity_withdraw,
    node_of,
)
from tasks_app.plumbing.notify import redis_client
from tests.support.demo import ENDLESS_MODEL
from tests.support.namespace import REDIS_PREFIX
from tests.support.queues import queued_ids
from tests.support.specs import spec_of
from tests.support.waiting import wait_until
from tests.support.worker import stop_process_group

LEFT = "left@host"
NAMES = ("left", "right")


def conversation_key(request: dict[str, Any]) -> str:
    """The key a request's conversation is routed by, as its accepted spec computes it."""
    return spec_of(request).conversation_key()


def finished_response(api: Any, worker: str) -> str:
    """A background response that ``worker`` claimed, ran and finished (as its lifecycle verbs record it)."""
    reply = api.post("/lmsp/v1/responses", {"model": "demo", "input": "Hi", "background": True})
    assert reply.status_code == 200, reply.content
    response_id = reply.json()["id"]
    task_id = Task.objects.get(response_id=response_id).pk
    assert lifecycle.task_claim(task_id=task_id, worker=worker).won
    assert lifecycle.task_start(task_id=task_id, worker=worker, item_id="msg_1").won
    assert lifecycle.task_succeed(
        task_id=task_id, worker=worker, item_id="msg_1", text="Hello", usage=None, output_tokens=1
    ).won
    return response_id


def continued(api: Any, previous: str) -> str:
    reply = api.post(
        "/lmsp/v1/responses",
        {"model": "demo", "input": "And then?", "background": True, "previous_response_id": previous},
    )
    assert reply.status_code == 200, reply.content
    return Task.objects.get(response_id=reply.json()["id"]).pk


@pytest.fixture
def left_queue(queue: str) -> Any:
    """The node ``LEFT``'s own queue; it and the node's presence are gone after the test."""
    name = affinity_queue(LEFT)
    redis_client().delete(name)
    yield name
    affinity_withdraw(node=LEFT)
    redis_client().delete(name)


def test_a_continued_response_goes_to_its_previous_workers_node_only_while_that_node_has_room(api, queue, left_queue):
    previous = finished_response(api, f"{LEFT}/4242")

    # No presence (the node stopped, or never announced): the shared queue.
    nowhere = continued(api, previous)
    affinity_announce(node=LEFT, room=0)  # alive, but full
    full = continued(api, previous)
    affinity_announce(node="right@host", room=3)  # another node's room is not this one's
    other = continued(api, previous)
    affinity_announce(node=LEFT, room=2)
    routed = continued(api, previous)
    # A task that continues nothing, and a new conversation, go where they always went.
    plain = api.create_task("Hello").json()["id"]
    affinity_withdraw(node="right@host")

    first = Task.objects.get(response_id=previous).pk
    assert queued_ids(queue) == [first, nowhere, full, other, plain]
    assert queued_ids(left_queue) == [routed]


def test_with_routing_off_a_continued_response_goes_to_the_shared_queue(api, queue, left_queue, settings):
    previous = finished_response(api, f"{LEFT}/4242")
    affinity_announce(node=LEFT, room=2)
    settings.LMSP_AFFINITY = False

    shared = continued(api, previous)

    assert queued_ids(queue)[-1] == shared
    assert queued_ids(left_queue) == []


def test_an_echoed_conversation_goes_to_the_node_that_last_ran_its_beginning(api, queue, left_queue):
    turn_one = {"model": "demo", "input": "Hi", "instructions": "Be brief."}
    affinity_remember(conversation=conversation_key(turn_one), worker=f"{LEFT}/4242")
    affinity_announce(node=LEFT, room=1)
    history = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello"},
        {"role": "user", "content": "And then?"},
    ]

    def echoed(**changes: Any) -> str:
        reply = api.post("/lmsp/v1/responses", {**turn_one, "input": history, "background": True, **changes})
        assert reply.status_code == 200, reply.content
        return Task.objects.get(response_id=reply.json()["id"]).pk

    routed = echoed()
    elsewhere = echoed(instructions="Be long.")  # another beginning: another conversation
    first_turn_again = echoed(input="Hi")  # the same beginning, but no turn before it: not a continuation

    assert queued_ids(left_queue) == [routed]
    assert queued_ids(queue) == [elsewhere, first_turn_again]
    redis_client().delete(f"{REDIS_PREFIX}:affinity-conversation:{queue}:{conversation_key(turn_one)}")


def test_a_prompt_cache_key_routes_its_requests_to_the_node_that_last_ran_one(api, queue, left_queue):
    """Codex CLI names its session in ``prompt_cache_key``, its history changing each turn: the key routes."""
    keyed = {"model": "demo", "input": "Hi", "prompt_cache_key": "session-7"}
    affinity_remember(conversation=conversation_key(keyed), worker=f"{LEFT}/4242")
    affinity_announce(node=LEFT, room=1)

    def sent(**changes: Any) -> str:
        reply = api.post("/lmsp/v1/responses", {**keyed, "background": True, **changes})
        assert reply.status_code == 200, reply.content
        return Task.objects.get(response_id=reply.json()["id"]).pk

    routed = sent(instructions="Another beginning, the same session.")
    other_key = sent(prompt_cache_key="session-8")

    assert queued_ids(left_queue) == [routed]
    assert queued_ids(queue) == [other_key]
    redis_client().delete(f"{REDIS_PREFIX}:affinity-conversation:{queue}:{conversation_key(keyed)}")


def test_every_way_of_sending_a_conversation_has_the_key_of_its_first_turn():
    first = {"model": "demo", "instructions": "Be brief.", "input": "Hi"}
    key = conversation_key(first)
    later = [
        {**first, "input": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]},
        {**first, "input": [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Hi"}]}]},
        # A chained turn: its stored request copies the conversation before it.
        {**first, "input": "And?", "context": [{"type": "message", "role": "user", "content": "Hi"}]},
    ]
    other = [
        {**first, "instructions": "Be long."},
        {**first, "model": "demo:base"},
        {**first, "tools": [{"type": "function", "name": "f", "parameters": {}}]},
        {**first, "input": "Hello"},
    ]
    assert key and all(conversation_key(request) == key for request in later)
    assert all(conversation_key(request) != key for request in other)
    assert conversation_key({"model": "demo", "input": []}) == ""


def test_the_node_of_a_worker_is_its_name_before_the_pid():
    assert node_of("left@host/4242") == "left@host"
    assert node_of("left@host") == "left@host"


@pytest.mark.slow
def test_a_conversation_stays_on_the_worker_that_holds_its_cache_and_moves_when_that_worker_stops(lab):
    """Two threads-pool workers on one queue: each turn after the first runs where the one before it ran
    (six turns: by chance alone they would all land there once in 64 runs) and starts from that
    worker's prefix cache; once that worker stopped, the next turn runs on the other one."""
    request = {"model": ENDLESS_MODEL, "max_output_tokens": 8, "temperature": 0, "background": True}

    def turn(previous: str | None, text: str | list[dict[str, str]]) -> dict[str, Any]:
        body = {**request, "input": text, **({"previous_response_id": previous} if previous else {})}
        reply = lab.api.post("/lmsp/v1/responses", body)
        assert reply.status_code == 200, reply.content
        response_id = reply.json()["id"]

        def ended() -> dict[str, Any] | None:
            answer = lab.api.get(f"/lmsp/v1/responses/{response_id}").json()
            return answer if answer["status"] not in {"queued", "in_progress"} else None

        answer = wait_until(ended, what=f"response {response_id} did not end", timeout=120)
        answer["worker"] = Task.objects.get(response_id=response_id).worker
        return answer

    with ExitStack() as stack:
        workers = {name: stack.enter_context(lab.worker(name, pool="threads", concurrency=2)) for name in NAMES}
        turns = [turn(None, "Tell me about the sea.")]
        for n in range(6):
            turns.append(turn(turns[-1]["id"], f"And then, part {n}?"))
        home = node_of(turns[0]["worker"])
        assert [node_of(t["worker"]) for t in turns] == [home] * 7
        for before, after in pairwise(turns):
            # All of the turn before (and its answer, as far as this prompt spells it alike) came from the cache.
            assert after["usage"]["input_tokens_details"]["cached_tokens"] >= before["usage"]["input_tokens"]
        # The same conversation echoed back by the client (no previous_response_id) goes there too.
        history = [{"role": "user", "content": "Tell me about the sea."}]
        for n, answer in enumerate(turns):
            history.append({"role": "assistant", "content": answer["output"][0]["content"][0]["text"]})
            history.append({"role": "user", "content": f"And then, part {n}?" if n < 6 else "Echoed?"})
        echoed = turn(None, history)
        assert node_of(echoed["worker"]) == home
        assert echoed["usage"]["input_tokens_details"]["cached_tokens"] >= turns[-1]["usage"]["input_tokens"]

        stop_process_group(workers[home.partition("@")[0]].proc)
        # A stopped node takes its presence with it: nothing more is routed to it.
        assert affinity_queue_for(worker=turns[-1]["worker"]) is None
        moved = turn(turns[-1]["id"], "One more thing?")
    assert node_of(moved["worker"]) != home and moved["status"] == "incomplete"
    # The other worker never saw this conversation: at most the chat template's start was cached there.
    assert moved["usage"]["input_tokens_details"]["cached_tokens"] < turns[0]["usage"]["input_tokens"]
