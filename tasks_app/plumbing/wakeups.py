"""One Redis subscription per web process, fanned out to the streams and waits in it.

Every winning lifecycle commit publishes ``{"task_id", "status",
"last_sequence"}`` (or, for many tasks at once, ``{"changes": [[task_id, status,
last_sequence], ...]}``) on ``<prefix>:tasks`` after it commits (``notify``). The hub
listens on one connection for the whole process and pokes what watches that
task. A message carries no event: whoever is poked reads the database, so a
message lost (Redis down, restarted, slow) costs latency and never an event.

While the subscription is down, ``connected`` is false and watchers poll on a
short interval instead; the hub reconnects with backoff and pokes every
watcher once it is subscribed again, so a commit made during the outage is
read at once.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import weakref
from collections.abc import Callable, Collection
from dataclasses import dataclass

import redis
import redis.asyncio
from django.conf import settings
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff

from tasks_app.plumbing.notify import tasks_channel

logger = logging.getLogger(__name__)

# Reconnect backoff: doubles per failed attempt, reset once subscribed.
_RETRY_FIRST_S = 0.05
_RETRY_MAX_S = 2.0
# How long dropping a subscription's connections may take before they are left to the garbage collector.
_CLOSE_TIMEOUT_S = 1.0


@dataclass(frozen=True, slots=True)
class Change:
    """What a wake-up announced: the task's status and newest sequence number after the commit."""

    status: str
    last_sequence: int


# A poke gets the announced change, or None when the hub cannot know (it just
# (re)subscribed or lost its subscription, and anything may have happened).
Poke = Callable[[Change | None], None]


class WakeHub:
    """The process's subscription to task wake-ups, bound to one event loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.connected = False
        self._watchers: dict[str, set[Poke]] = {}
        self._listener: asyncio.Task | None = None

    def watch(self, task_id: str, poke: Poke) -> None:
        """Call ``poke`` for every wake-up of ``task_id`` until ``unwatch``.

        Starts the subscription if this is the first watcher; a caller must
        register before its first read of the task, so that a commit between
        the read and the wait is never missed.
        """
        self._watchers.setdefault(task_id, set()).add(poke)
        if self._listener is None or self._listener.done():
            self._listener = self.loop.create_task(self._listen(), name="lmsp-wakeups")

    def unwatch(self, task_id: str, poke: Poke) -> None:
        watchers = self._watchers.get(task_id)
        if watchers is not None:
            watchers.discard(poke)
            if not watchers:
                del self._watchers[task_id]

    @property
    def watched_tasks(self) -> int:
        return len(self._watchers)

    def poll_interval(self) -> float:
        """How long a watcher may wait before it reads the database anyway."""
        if self.connected:
            return settings.LMSP_STREAM_SAFETY_POLL_SECONDS
        return settings.LMSP_STREAM_FALLBACK_POLL_MS / 1000

    def _poke(self, task_id: str, change: Change | None) -> None:
        for poke in list(self._watchers.get(task_id, ())):
            poke(change)

    def _poke_all(self) -> None:
        for task_id in list(self._watchers):
            self._poke(task_id, None)

    def _on_message(self, data: bytes | str) -> None:
        try:
            message = json.loads(data)
            if "changes" in message:
                # Many tasks in one message (a page of recovery): [[task_id, status, last_sequence], ...].
                changes = [(str(t), Change(status=str(s), last_sequence=int(n))) for t, s, n in message["changes"]]
            else:
                change = Change(status=str(message["status"]), last_sequence=int(message["last_sequence"]))
                changes = [(str(message["task_id"]), change)]
        except (ValueError, KeyError, TypeError):
            logger.warning("ignored a malformed wake-up: %r", data[:200])
            return
        for task_id, change in changes:
            self._poke(task_id, change)

    def _set_connected(self, connected: bool) -> None:
        if connected != self.connected:
            self.connected = connected
            # Either way every watcher looks again: after a reconnect to read
            # what was committed while deaf, after a loss to start polling.
            self._poke_all()

    async def _listen(self) -> None:
        delay = _RETRY_FIRST_S
        reported = False
        while True:
            _raise_if_cancelled()
            client = _subscriber_client()
            pubsub = client.pubsub()
            try:
                await _subscribe(pubsub)
                self._set_connected(True)
                if reported:
                    logger.warning("wake-ups: subscribed to Redis again")
                delay, reported = _RETRY_FIRST_S, False
                await self._relay(pubsub)
            except asyncio.CancelledError:
                raise
            except (redis.RedisError, OSError) as exc:
                # One line per outage, not one per failed reconnect.
                if not reported:
                    logger.warning("wake-ups: Redis subscription lost (%s); streams poll the database", exc)
                    reported = True
            finally:
                self._set_connected(False)
                await _close_quietly(pubsub, client)
            _raise_if_cancelled()
            await asyncio.sleep(delay)
            delay = min(delay * 2, _RETRY_MAX_S)

    async def _relay(self, pubsub: redis.asyncio.client.PubSub) -> None:
        """Hand every wake-up to its watchers until the subscription fails."""
        while True:
            # Also before the read: a cancellation that redis-py swallowed while subscribing (the confirmation
            # read returns as if nothing happened) would otherwise wait out this read's 30 s.
            _raise_if_cancelled()
            message = await pubsub.get_message(ignore_subscribe_messages=True, timeout=30)
            _raise_if_cancelled()
            if message is not None and message["type"] == "message":
                self._on_message(message["data"])


def subscriber_name() -> str:
    """The name this process's subscription has in Redis (``CLIENT LIST``): who listens, at a glance."""
    return f"{settings.LMSP_REDIS_PREFIX}-wakeups-{os.getpid()}"


def _subscriber_client() -> redis.asyncio.Redis:
    return redis.asyncio.Redis.from_url(
        settings.REDIS_URL,
        client_name=subscriber_name(),
        socket_connect_timeout=1,
        health_check_interval=10,
        # No silent reconnect inside redis-py: a loss must reach ``_listen``,
        # which pokes every watcher once subscribed again (messages published
        # while deaf are gone).
        retry=Retry(NoBackoff(), 0),
    )


async def _subscribe(pubsub: redis.asyncio.client.PubSub) -> None:
    """Subscribe and wait for Redis to confirm it, so ``connected`` never runs ahead of the subscription."""
    await pubsub.subscribe(tasks_channel())
    while True:
        _raise_if_cancelled()
        message = await pubsub.get_message(timeout=5)
        if message is None:
            raise redis.TimeoutError("no subscribe confirmation")
        if message["type"] == "subscribe":
            return


def _raise_if_cancelled() -> None:
    """Honour a cancellation that redis-py swallowed.

    Its connection code catches ``CancelledError`` in places (a read that is
    cancelled returns, a disconnect that is cancelled goes on), and the task's
    pending cancellation is all that is left of it. A listener that went on
    after it would resubscribe for ever, and the loop cancelling it (a test
    client's request loop at its end: the SQLite pass hung there for good,
    twice) would never finish.
    """
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError


async def _close_quietly(pubsub: redis.asyncio.client.PubSub, client: redis.asyncio.Redis) -> None:
    # The connection is being dropped anyway: a failing close must not stop the reconnect, and a hanging
    # one must not hold up the loop that cancels the listener as it shuts down. redis-py can wait forever
    # for a transport that a cancelled read still holds (redis/redis-py#3941). Each close has its own
    # bound: one that swallows its deadline's cancellation must not leave the next unbounded.
    for close in (pubsub.aclose, client.aclose):
        try:
            async with asyncio.timeout(_CLOSE_TIMEOUT_S):
                await close()
        except (redis.RedisError, OSError, TimeoutError):
            pass


_hubs: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, WakeHub] = weakref.WeakKeyDictionary()


def wake_hub() -> WakeHub:
    """The hub of the running event loop (uvicorn runs one loop per process)."""
    loop = asyncio.get_running_loop()
    hub = _hubs.get(loop)
    if hub is None:
        hub = _hubs[loop] = WakeHub(loop)
    return hub


class Watch:
    """Wake-ups of one task as an awaitable flag; use as a context manager.

    Enter it before the first read of the task, then alternate reads and
    ``wait``: a poke that arrives during a read makes the next ``wait``
    return at once. With ``statuses``, only changes to one of them (or an
    unknown change) wake it.
    """

    def __init__(self, task_id: str, statuses: Collection[str] | None = None) -> None:
        self.task_id = task_id
        self.statuses = frozenset(statuses) if statuses is not None else None
        self.hub = wake_hub()
        self._event = asyncio.Event()

    def _poke(self, change: Change | None) -> None:
        # ``statuses`` spares a waiter for the end of a task a read per batch.
        if change is None or self.statuses is None or change.status in self.statuses:
            self._event.set()

    def __enter__(self) -> Watch:
        self.hub.watch(self.task_id, self._poke)
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.hub.unwatch(self.task_id, self._poke)

    async def wait(self, timeout: float) -> bool:
        """Until poked (True) or ``timeout`` seconds passed (False)."""
        try:
            async with asyncio.timeout(timeout):
                await self._event.wait()
            return True
        except TimeoutError:
            return False
        finally:
            self._event.clear()
