"""Real processes crash; what a client was told still holds.

1. The web process is SIGKILLed while many task creations are in flight: every
   task whose 202 reached its client exists and runs, nothing is half-written,
   and a client retrying its unanswered requests with their Idempotency-Keys
   ends up with exactly one task per request.
2. Redis restarts without persistence while tasks wait in its queue: their
   messages are lost, the sweeper sends them again, and they run.
"""

from __future__ import annotations

import base64
import json
import re

import redis
from django.db.models import Exists, OuterRef

from tasks_app import states
from tasks_app.models import IdempotencyKey, IdempotencyState, Response, Task, TaskEvent
from tasks_app.plumbing.broker import RUN_TASK
from tasks_app.plumbing.notify import key
from tasks_app.states import TaskStatus
from tests.support.crash import post_json, post_until_killed
from tests.support.demo import ENDLESS_MODEL
from tests.support.server import uvicorn_process
from tests.support.sse import call
from tests.support.waiting import wait_until

# The sweeper as test_broker_outage runs it: every second, no grace period.
SWEEPER = {"LMSP_SWEEP_INTERVAL_SECONDS": "1", "LMSP_SWEEP_GRACE_SECONDS": "0"}
# With a grace period, a sweep never races the dispatch that follows a
# creation, so what it sends is only what a dead web process never dispatched.
SWEEPER_AFTER_GRACE = {"LMSP_SWEEP_INTERVAL_SECONDS": "1", "LMSP_SWEEP_GRACE_SECONDS": "2"}
THREADS = 8
PER_THREAD = 10
KILL_AFTER = 8
LONG_TOKENS = 2000
SMALL_TOKENS = 4


def small_task(idempotency_key: str) -> dict:
    return {
        "type": "response",
        "input": {"model": "demo", "input": f"request {idempotency_key}", "max_output_tokens": SMALL_TOKENS},
    }


def half_written() -> dict[str, list]:
    """Rows a crash left without their partners, by kind; empty when everything is whole."""
    event_zero = TaskEvent.objects.filter(task=OuterRef("pk"), sequence_number=0, type="response.created")
    owned = Task.objects.filter(response=OuterRef("pk"))
    found = {
        "tasks without response.created as event 0": list(
            Task.objects.exclude(Exists(event_zero)).values_list("id", flat=True)
        ),
        "responses without a task": list(Response.objects.exclude(Exists(owned)).values_list("id", flat=True)),
        "idempotency keys left in progress": list(
            IdempotencyKey.objects.filter(state=IdempotencyState.IN_PROGRESS).values_list("key", flat=True)
        ),
    }
    return {kind: rows for kind, rows in found.items() if rows}


def active_tasks() -> list[tuple[str, str]]:
    return list(Task.objects.filter(status__in=states.ACTIVE).values_list("id", "status"))


def swept_ids(log: str) -> set[str]:
    found: set[str] = set()
    for match in re.finditer(r"sweeper re-dispatched \d+ \w+ task\(s\): (.+)", log):
        found.update(part.strip() for part in match.group(1).split(","))
    return found


def test_every_task_whose_202_reached_the_client_survives_a_killed_web_process(private_stack):
    with private_stack("webkill", SWEEPER_AFTER_GRACE, beat=True, web=False) as stack:
        with uvicorn_process(stack.env["DATABASE_URL"], stack.env) as first:
            barrage = post_until_killed(
                base=first.base,
                pid=first.pid,
                token=stack.token,
                threads=THREADS,
                per_thread=PER_THREAD,
                kill_after=KILL_AFTER,
                body_for=small_task,
            )
        # Leaving the block reaped the SIGKILLed server without raising.

        assert barrage.killed.is_set()
        assert len(barrage.outcomes) == THREADS * PER_THREAD
        answered_otherwise = [
            (o.key, o.status, o.body) for o in barrage.outcomes if o.error is None and o.status != 202
        ]
        assert answered_otherwise == []
        accepted = {o.key: o.body["id"] for o in barrage.accepted}
        assert len(accepted) >= KILL_AFTER
        cut_off = [o.key for o in barrage.unanswered if not isinstance(o.error, ConnectionRefusedError)]
        assert cut_off, "no request was in flight when the server died"
        assert all(o.body["status"] == "queued" for o in barrage.accepted)

        # What the dead process committed is whole; what it did not commit is gone.
        assert half_written() == {}
        assert set(accepted.values()) <= set(Task.objects.values_list("id", flat=True))
        left_by_the_dead = set(Task.objects.values_list("id", flat=True))

        with uvicorn_process(stack.env["DATABASE_URL"], stack.env) as second:
            # A client retries what got no answer, with the same Idempotency-Key:
            # a task committed before the kill is replayed, one that was not is created now.
            retried = {}
            for outcome in barrage.unanswered:
                status, body = post_json(
                    second.base,
                    "/lmsp/v1/tasks",
                    token=stack.token,
                    body=small_task(outcome.key),
                    headers={"Idempotency-Key": outcome.key},
                )
                assert status == 202, (outcome.key, status, body)
                retried[outcome.key] = body["id"]
            by_key = {**accepted, **retried}
            assert len(by_key) == THREADS * PER_THREAD
            assert len(set(by_key.values())) == len(by_key), "two requests share one task"
            assert set(Task.objects.values_list("id", flat=True)) == set(by_key.values()), "a task nobody asked for"

            wait_until(
                lambda: not active_tasks(),
                what=lambda: f"tasks never ended: {active_tasks()}\n{stack.worker.log()[-3000:]}",
                timeout=60,
            )
            for task_id in accepted.values():
                status, current = call(second.base, "GET", f"/lmsp/v1/tasks/{task_id}", token=stack.token)
                assert status == 200, (task_id, status, current)
                assert current["status"] == "succeeded", current
                assert current["response"]["usage"]["output_tokens"] == SMALL_TOKENS

        log = stack.worker.log()

    # Even the tasks committed just before the kill, with no 202 and maybe no
    # dispatch, ran (the sweeper sends those). A web process sends after the
    # 202, so some answered ones may be among them too; a live process's
    # tasks (the second's) all went out from its own sender.
    ended = dict(Task.objects.values_list("id", "status"))
    assert set(ended.values()) == {TaskStatus.SUCCEEDED}, ended
    assert swept_ids(log) <= left_by_the_dead, log[-4000:]
    assert set(Task.objects.values_list("attempts", flat=True)) == {1}
    assert half_written() == {}


def waiting_run_messages(broker: redis.Redis, queue: str) -> list[str]:
    """Task ids of the ``lmsp.run_task`` messages waiting in the queue's Redis list."""
    ids = []
    for raw in broker.lrange(queue, 0, -1):
        message = json.loads(raw)
        if message["headers"]["task"] != RUN_TASK:
            continue
        body = message["body"]
        if message["properties"].get("body_encoding") == "base64":
            body = base64.b64decode(body)
        args, _kwargs, _embed = json.loads(body)
        ids.extend(args)
    return ids


def test_queued_tasks_whose_messages_a_redis_restart_lost_still_run(private_stack):
    # A slowed device (tasks_app.faults): 2,000 tokens at 5 ms a model call keep the worker's one process
    # busy for at least 10 s, however fast the machine, while Redis goes down and comes back.
    with private_stack("redis-restart", {**SWEEPER, "LMSP_FAULT_MODEL_CALL_SECONDS": "0.005"}, beat=True) as stack:
        long_body = {
            "type": "response",
            "input": {"model": ENDLESS_MODEL, "input": "Keep going", "max_output_tokens": LONG_TOKENS},
        }
        status, long_task = call(stack.base, "POST", "/lmsp/v1/tasks", token=stack.token, body=long_body)
        assert status == 202
        # The worker's only process is now busy: it will take no message for a while.
        wait_until(
            lambda: Task.objects.get(pk=long_task["id"]).status == TaskStatus.RUNNING,
            what=lambda: f"the long task never ran:\n{stack.worker.log()[-3000:]}",
        )

        queued = []
        for index in range(3):
            status, task = call(stack.base, "POST", "/lmsp/v1/tasks", token=stack.token, body=small_task(f"q{index}"))
            assert status == 202
            queued.append(task["id"])

        broker = redis.Redis(port=stack.redis.port)
        # The web process's sender publishes after the 202, so the last message can trail its answer. A sweep
        # (no grace here) that ran between the long task's commit and its dispatch sent it twice: that second
        # message waits too, for a claim that will drop it (a clean CI run had one).
        wait_until(
            lambda: set(queued) <= set(waiting_run_messages(broker, stack.worker.queue)) <= {*queued, long_task["id"]},
            what=lambda: f"waiting: {waiting_run_messages(broker, stack.worker.queue)}, queued: {queued}",
            timeout=10,
        )
        assert [broker.exists(key("dispatched", task_id)) for task_id in queued] == [1, 1, 1]

        stack.redis.stop()
        # Nobody took those messages before they were lost with Redis: the
        # worker's one process was still generating.
        statuses = dict(Task.objects.filter(pk__in=[long_task["id"], *queued]).values_list("id", "status"))
        assert statuses == {long_task["id"]: TaskStatus.RUNNING, **dict.fromkeys(queued, TaskStatus.QUEUED)}
        stack.redis.start()  # empty: it kept nothing on disk

        def finished() -> dict[str, dict] | None:
            current = {}
            for task_id in [long_task["id"], *queued]:
                _, body = call(stack.base, "GET", f"/lmsp/v1/tasks/{task_id}", token=stack.token)
                if body["status"] not in {"succeeded", "failed", "cancelled"}:
                    return None
                current[task_id] = body
            return current

        ended = wait_until(finished, what=lambda: f"the tasks never ended:\n{stack.worker.log()[-4000:]}", timeout=90)
        log = stack.worker.log()

    # The generation never needed Redis: the long task ends as if nothing happened.
    long_end = ended.pop(long_task["id"])
    assert long_end["status"] == "succeeded", long_end
    assert long_end["response"]["status"] == "incomplete"
    assert long_end["response"]["usage"]["output_tokens"] == LONG_TOKENS
    stored = Task.objects.get(pk=long_task["id"])
    sequence = list(
        TaskEvent.objects.filter(task=stored).order_by("sequence_number").values_list("sequence_number", flat=True)
    )
    assert sequence == list(range(stored.last_sequence + 1))

    # The three queued tasks ran, because the sweeper sent them again.
    assert {task_id: body["status"] for task_id, body in ended.items()} == dict.fromkeys(queued, "succeeded")
    assert all(body["response"]["usage"]["output_tokens"] == SMALL_TOKENS for body in ended.values())
    assert set(queued) <= swept_ids(log), log[-4000:]
    # Each of the four ran exactly once, whatever duplicates the sweeper sent.
    attempts = dict(Task.objects.filter(pk__in=[long_task["id"], *queued]).values_list("id", "attempts"))
    assert attempts == dict.fromkeys([long_task["id"], *queued], 1)
