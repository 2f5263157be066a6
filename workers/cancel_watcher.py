"""Cancel requests reach the decode loop without a database read per step.

One thread per worker process subscribes to the lifecycle's after-commit
notifications (``<prefix>:tasks``) and sets a flag when a task this process
runs turns ``cancelling``; the generating loop checks that flag before each
decode step. The flag is only a shortcut: every batch commit is also a
compare-and-set on ``running``, so a lost message (Redis down, thread not yet
subscribed) delays a cancel by one batch, never loses it.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time

import redis
from django.conf import settings

from tasks_app.plumbing.notify import tasks_channel
from tasks_app.states import TaskStatus

logger = logging.getLogger(__name__)


def _subscriber() -> redis.Redis:
    # No read timeout: a quiet channel is normal. The health check pings a
    # silent connection, so a Redis that vanished is noticed.
    return redis.Redis.from_url(
        settings.REDIS_URL, socket_connect_timeout=2, socket_keepalive=True, health_check_interval=15
    )


class CancelWatcher:
    def __init__(self) -> None:
        self._flags: dict[str, threading.Event] = {}
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._pid = 0
        self.subscribed = threading.Event()

    def watch(self, task_id: str) -> threading.Event:
        """A flag that is set once ``task_id`` is seen turning ``cancelling``."""
        self._ensure_thread()
        flag = threading.Event()
        with self._lock:
            self._flags[task_id] = flag
        return flag

    def unwatch(self, task_id: str) -> None:
        with self._lock:
            self._flags.pop(task_id, None)

    def _ensure_thread(self) -> None:
        # After a fork the parent's thread does not exist in the child.
        if self._thread is not None and self._thread.is_alive() and self._pid == os.getpid():
            return
        self._pid = os.getpid()
        self.subscribed.clear()
        self._thread = threading.Thread(target=self._run, name="lmsp-cancel-watcher", daemon=True)
        self._thread.start()

    def _deliver(self, raw: bytes) -> None:
        try:
            message = json.loads(raw)
        except ValueError:
            return
        if message.get("status") != TaskStatus.CANCELLING:
            return
        with self._lock:
            flag = self._flags.get(message.get("task_id"))
        if flag is not None:
            flag.set()

    def _run(self) -> None:
        backoff = 0.5
        while True:
            pubsub = None
            try:
                pubsub = _subscriber().pubsub(ignore_subscribe_messages=True)
                pubsub.subscribe(tasks_channel())
                self.subscribed.set()
                backoff = 0.5
                while True:
                    item = pubsub.get_message(timeout=5.0)
                    if item is not None and item.get("type") == "message":
                        self._deliver(item["data"])
            except (redis.RedisError, OSError) as exc:
                self.subscribed.clear()
                logger.warning("cancel watcher lost Redis (%s); batches still check the database", exc)
                time.sleep(backoff)
                backoff = min(backoff * 2, 10.0)
            finally:
                if pubsub is not None:
                    try:
                        pubsub.close()
                    except (redis.RedisError, OSError):
                        pass


cancel_watcher = CancelWatcher()
