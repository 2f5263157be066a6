"""What the messages of a task queue in the main Redis carry."""

from __future__ import annotations

import base64
import json

from tasks_app.plumbing.notify import redis_client


def queued_ids(name: str) -> list[str]:
    """Task ids in the queue's messages, oldest first."""
    out = []
    for raw in reversed(redis_client().lrange(name, 0, -1)):
        message = json.loads(raw)
        body = json.loads(base64.b64decode(message["body"]))
        out.append(body[0][0])
    return out


def drop_messages(name: str, task_ids: list[str]) -> None:
    """Remove the messages of ``task_ids`` from the queue, as a broker that lost them would."""
    client = redis_client()
    for raw in client.lrange(name, 0, -1):
        body = json.loads(base64.b64decode(json.loads(raw)["body"]))
        if body[0][0] in task_ids:
            client.lrem(name, 0, raw)
