"""The Redis namespace of this test run."""

from __future__ import annotations

import json
import os

# Every Redis key, queue and channel of this run carries its own prefix, so a
# test run never touches a running service's queue (or another run's).
REDIS_PREFIX = f"lmsp-test-{os.getpid()}"
# Tasks created by tests without a worker go to a queue nobody consumes.
IDLE_QUEUE = f"{REDIS_PREFIX}-idle"
# What every child process of the run inherits unless its test names another
# namespace (tests/conftest.py sets it for the whole session).
NAMESPACE_ENV = {"LMSP_REDIS_PREFIX": REDIS_PREFIX, "LMSP_TASK_QUEUE": IDLE_QUEUE}

# The settings' default prefix: an installation started without LMSP_REDIS_PREFIX.
DEFAULT_PREFIX = "lmsp"
# kombu keeps a queue's bindings under these names (plus the queue's name).
_KOMBU_BINDINGS = ("_kombu.binding.", "_kombu.binding_permanent.")
# Celery's queue of priority p is "<queue>\x06\x16<p>".
_PRIORITY_SEP = "\x06\x16"
# kombu's registry of messages delivered but not yet acknowledged, shared by
# every installation on the Redis: a worker killed in a test leaves its
# message there, and any later worker puts it back into the test's queue.
_UNACKED, _UNACKED_INDEX = "unacked", "unacked_index"


def _queue_of(key: str) -> str:
    for prefix in _KOMBU_BINDINGS:
        if key.startswith(prefix):
            return key[len(prefix) :]
    return key.split(_PRIORITY_SEP, 1)[0]


def is_default_namespace(key: str) -> bool:
    """A key of an installation without a prefix of its own: ``lmsp``, ``lmsp:...``, ``lmsp-maintenance``."""
    name = _queue_of(key)
    return name in (DEFAULT_PREFIX, f"{DEFAULT_PREFIX}-maintenance") or name.startswith(f"{DEFAULT_PREFIX}:")


def default_namespace_keys() -> list[str]:
    """The keys of the default namespace now on the test Redis."""
    from tasks_app.plumbing.notify import redis_client

    keys = (key.decode(errors="replace") for key in redis_client().scan_iter(match=f"*{DEFAULT_PREFIX}*", count=1000))
    return sorted(key for key in keys if is_default_namespace(key))


def namespace_cleanup() -> list[str]:
    """Delete the run's keys and its unacknowledged messages; returns the keys that came back meanwhile."""
    from tasks_app.plumbing.notify import redis_client

    client = redis_client()
    for key in client.scan_iter(match=f"*{REDIS_PREFIX}*", count=1000):
        client.delete(key)
    for tag, raw in client.hscan_iter(_UNACKED):
        if _is_ours(raw):
            client.hdel(_UNACKED, tag)
            client.zrem(_UNACKED_INDEX, tag)
    return sorted(key.decode() for key in client.scan_iter(match=f"*{REDIS_PREFIX}*", count=1000))


def _is_ours(raw: bytes) -> bool:
    # An entry is [message, exchange, routing key]; the routing key is the queue.
    try:
        _, exchange, routing_key = json.loads(raw)
    except (ValueError, TypeError):
        return False
    return REDIS_PREFIX in f"{exchange} {routing_key}"
