"""A thread subscribed to one Redis channel that pokes a loop at each message (and each (re)subscription).

Loops that poll the database (the webhook deliverers, the batch keeper)
use it to act as soon as a commit elsewhere made work for them. Only
latency rides on it: each loop still polls, so while Redis is away the
work waits at most a poll, and a subscription made again pokes at once
(what committed meanwhile is due now).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

import redis

from tasks_app.plumbing.notify import redis_client

logger = logging.getLogger(__name__)

_RETRY_FIRST_S = 0.05
_RETRY_MAX_S = 2.0


class ChannelWakeups:
    """Subscribe to ``channel`` in a daemon thread named ``name``; call ``poke`` for each message until ``stop``.

    ``what`` names the loop in the log ("webhooks", "batch keeper"), whose
    polling every ``poll_seconds`` covers a Redis outage.
    """

    def __init__(
        self,
        *,
        channel: str,
        poke: Callable[[], None],
        stop: threading.Event,
        name: str,
        what: str,
        poll_seconds: float,
    ) -> None:
        self._channel, self._poke, self._stop = channel, poke, stop
        self._what, self._poll_seconds = what, poll_seconds
        threading.Thread(target=self._listen, daemon=True, name=name).start()

    def _listen(self) -> None:
        retry, down = _RETRY_FIRST_S, False
        while not self._stop.is_set():
            pubsub = redis_client().pubsub()
            try:
                pubsub.subscribe(self._channel)
                while not self._stop.is_set():
                    message = pubsub.get_message(timeout=0.5)
                    if message is None:
                        continue
                    if message["type"] == "subscribe":
                        retry = _RETRY_FIRST_S
                        if down:
                            logger.info("%s: wake-ups subscribed again", self._what)
                            down = False
                    self._poke()
            except redis.RedisError as error:
                if not down:
                    logger.warning(
                        "%s: wake-ups lost (%s); polling every %.1f s until Redis is back",
                        self._what,
                        error,
                        self._poll_seconds,
                    )
                    down = True
                self._stop.wait(retry)
                retry = min(2 * retry, _RETRY_MAX_S)
            finally:
                try:
                    pubsub.close()
                except redis.RedisError:
                    pass
