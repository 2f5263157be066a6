"""What the messages of a task queue in the main Redis carry."""

from __future__ import annotations

import base64
import json

from tasks_app.notify import redis_client


def queued_ids(name: str) -> list[str]:
    """Task ids in the queue's messages, oldest first."""
    out = []
    for raw in reversed(redis_client().lrange(name, 0, -1)):
        message = json.loads(raw)
        body = json.loads(base64.b64decode(message["body"]))
        out.append(body[0][0])
    return out
