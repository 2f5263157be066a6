"""The web process's one Redis subscription: fan-out, reconnects, and the shared per-task feed."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from pathlib import Path

import redis.asyncio.client

from tasks_app.plumbing.event_feeds import Frame, TaskFeed
from tasks_app.plumbing.notify import publish, redis_client, tasks_channel
from tasks_app.plumbing.wakeups import Watch, subscriber_name, wake_hub
from tests.support.worker import private_redis


async def eventually(probe: Callable[[], bool], what: str, timeout: float = 20) -> None:
    """Hang guard for async tests: wait until ``probe()`` holds, else TimeoutError."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not probe():
        if loop.time() > deadline:
            raise TimeoutError(what)
        await asyncio.sleep(0.02)


async def connected(*watches: Watch) -> None:
    """Wait for the subscription, then forget the poke every watcher gets when it starts."""
    await eventually(lambda: watches[0].hub.connected, "the hub never subscribed")
    for watch in watches:
        await watch.wait(0)


def change(task_id: str, status: str = "running", last_sequence: int = 5) -> dict:
    return {"task_id": task_id, "status": status, "last_sequence": last_sequence}


def test_a_wake_up_reaches_the_watchers_of_its_task_only():
    async def scenario() -> tuple[bool, bool]:
        with Watch("task_a") as a, Watch("task_b") as b:
            await connected(a, b)
            publish(tasks_channel(), change("task_a"))
            return await a.wait(10), await b.wait(0.3)

    assert asyncio.run(scenario()) == (True, False)


def test_one_message_for_a_page_of_recovered_tasks_wakes_each_task_s_watchers():
    """Recovery commits hundreds of tasks at once and tells them in one message (``tasks_changed_on_commit``)."""

    async def scenario() -> tuple[bool, bool, bool]:
        with Watch("task_p", statuses={"failed"}) as p, Watch("task_q") as q, Watch("task_r") as r:
            await connected(p, q, r)
            publish(tasks_channel(), {"changes": [["task_p", "failed", 3], ["task_q", "queued", 0]]})
            return await p.wait(10), await q.wait(10), await r.wait(0.3)

    assert asyncio.run(scenario()) == (True, True, False)


def test_a_status_filter_ignores_other_changes():
    async def scenario() -> tuple[bool, bool]:
        with Watch("task_c", statuses={"succeeded"}) as watch:
            await connected(watch)
            publish(tasks_channel(), change("task_c", "running"))
            ignored = await watch.wait(0.3)
            publish(tasks_channel(), change("task_c", "succeeded"))
            return ignored, await watch.wait(10)

    assert asyncio.run(scenario()) == (False, True)


def own_subscriptions() -> list[int]:
    """The channel counts of this process's connections to Redis (by their name): other
    processes of the run (a worker, a web server) come and go meanwhile, and are not counted."""
    return [int(c["sub"]) for c in redis_client().client_list() if c.get("name") == subscriber_name()]


def test_one_subscription_serves_every_watcher_of_the_process():
    async def scenario() -> list[int]:
        watches = [Watch(f"task_{n % 7}") for n in range(50)]
        for watch in watches:
            watch.__enter__()
        try:
            await eventually(lambda: wake_hub().connected, "the hub never subscribed")
            return own_subscriptions()
        finally:
            for watch in watches:
                watch.__exit__(None, None, None)

    # Fifty watchers, one connection subscribed to one channel.
    assert asyncio.run(scenario()) == [1]


def test_a_redis_restart_turns_watchers_to_polling_then_resubscribes(tmp_path: Path, settings):
    with private_redis(tmp_path) as redis_server:
        settings.REDIS_URL = redis_server.url

        async def scenario() -> list[str]:
            seen: list[str] = []
            loop = asyncio.get_running_loop()
            with Watch("task_r") as watch:
                hub = watch.hub
                await connected(watch)
                fast = hub.poll_interval()
                await loop.run_in_executor(None, redis_server.stop)
                await eventually(lambda: not hub.connected, "the hub did not notice Redis going away")
                # The loss pokes every watcher, so it reads the database now.
                seen.append(f"poked on loss: {await watch.wait(1)}")
                seen.append(f"polls faster while down: {hub.poll_interval() < fast}")
                await loop.run_in_executor(None, redis_server.start)
                await eventually(lambda: hub.connected, "the hub did not resubscribe")
                seen.append(f"poked on reconnect: {await watch.wait(1)}")
                await watch.wait(0)
                publish(tasks_channel(), change("task_r"))
                seen.append(f"woken after restart: {await watch.wait(10)}")
            return seen

        assert asyncio.run(scenario()) == [
            "poked on loss: True",
            "polls faster while down: True",
            "poked on reconnect: True",
            "woken after restart: True",
        ]


def frames(*numbers: int, terminal: int | None = None) -> list[Frame]:
    return [Frame(n, n == terminal, f"id: {n}\n\n".encode()) for n in numbers]


def feed_after(after: int) -> TaskFeed:
    return TaskFeed(hub=None, task_id="task_f", after=after)  # type: ignore[arg-type]


def test_a_feed_hands_each_follower_exactly_what_follows_its_cursor(settings):
    feed = feed_after(3)
    assert feed.frames_after(3) == []
    assert feed.frames_after(1) is None  # before the window: read the database

    feed._extend(frames(4, 5, 6, 7))
    feed.last_sequence = 7

    assert [f.sequence_number for f in feed.frames_after(3)] == [4, 5, 6, 7]
    assert [f.sequence_number for f in feed.frames_after(5)] == [6, 7]
    assert feed.frames_after(7) == []
    assert feed.frames_after(2) is None


def test_a_feed_window_is_bounded_and_stays_contiguous(settings):
    settings.LMSP_STREAM_FEED_WINDOW = 4
    feed = feed_after(-1)
    feed._extend(frames(0, 1, 2, 3, 4, 5))
    feed.last_sequence = 5
    assert [f.sequence_number for f in feed.frames_after(1)] == [2, 3, 4, 5]
    assert feed.frames_after(0) is None

    # A gap (events deleted under the feed) restarts the window after it.
    feed._extend(frames(9, 10))
    feed.last_sequence = 10
    assert [f.sequence_number for f in feed.frames_after(8)] == [9, 10]
    assert feed.frames_after(5) is None


def a_request_loop_that_watched_ends(timeout: float = 20) -> bool:
    """A loop of its own (as a test client's request has) watches a task, then returns; whether it ended.

    At its end asyncio.run cancels the hub's listener, whose cleanup closes the subscription."""

    async def watch_then_return() -> None:
        with Watch("task_a") as a:
            await connected(a)

    ended = threading.Event()

    def run_a_request_loop() -> None:
        asyncio.run(watch_then_return())
        ended.set()

    threading.Thread(target=run_a_request_loop, daemon=True).start()
    return ended.wait(timeout=timeout)


def test_a_loop_that_closes_while_watching_is_not_held_up_by_a_connection_that_never_closes(monkeypatch):
    """The fault (a close that never returns, as redis-py's can) is injected: it cannot be made real."""

    async def never_returns(self) -> None:
        await asyncio.Event().wait()

    monkeypatch.setattr(redis.asyncio.client.PubSub, "aclose", never_returns)

    assert a_request_loop_that_watched_ends(), "the loop never finished closing"


def test_a_loop_that_closes_while_watching_ends_even_when_the_redis_client_swallows_the_cancellation(monkeypatch):
    """redis-py catches ``CancelledError`` in places; a listener that went on after it resubscribed for ever,
    and the request loop cancelling it never finished (a CI run's SQLite pass, twice). Injected: it cannot be
    made real on demand."""
    original = redis.asyncio.client.PubSub.get_message

    async def swallows_its_cancellation(self, *args, **kwargs):
        try:
            return await original(self, *args, **kwargs)
        except asyncio.CancelledError:
            return None

    monkeypatch.setattr(redis.asyncio.client.PubSub, "get_message", swallows_its_cancellation)

    assert a_request_loop_that_watched_ends(), "the loop never finished: the listener outlived its cancellation"


def test_a_loop_that_closes_while_the_hub_subscribes_ends_even_when_the_confirmation_read_swallows_its_cancellation(
    monkeypatch,
):
    """The read of the subscription's confirmation, cancelled, may still return the confirmation as if nothing
    happened; the listener then waited out its next read (30 s) before it saw the cancellation: a test
    client's request held up that long, three times in one parallel run. Injected: the moment cannot be
    hit on demand."""
    original = redis.asyncio.client.PubSub.get_message
    confirming = threading.Event()

    async def the_confirmation_read_swallows_its_cancellation(self, *args, **kwargs):
        if kwargs.get("ignore_subscribe_messages"):
            return await original(self, *args, **kwargs)
        confirming.set()
        try:
            await asyncio.sleep(5)  # the read in progress as the loop ends
        except asyncio.CancelledError:
            pass
        return await original(self, *args, **kwargs)

    monkeypatch.setattr(redis.asyncio.client.PubSub, "get_message", the_confirmation_read_swallows_its_cancellation)

    async def watch_until_the_hub_confirms_then_return() -> None:
        with Watch("task_a"):
            await eventually(confirming.is_set, "the hub never read a confirmation")

    ended = threading.Event()

    def run_a_request_loop() -> None:
        asyncio.run(watch_until_the_hub_confirms_then_return())
        ended.set()

    threading.Thread(target=run_a_request_loop, daemon=True).start()
    assert ended.wait(timeout=20), "the loop never finished: the listener read on after its cancellation"
