"""The batch keeper's thread in a web process, and how a finished line reads in its endpoint's protocol.

``services.batches.batch_keeper_run`` does the work (feeds lines, writes
results, ends batches); this adapter gives it ``batch_line_body``, the one
thing it cannot know: a chat line's result is a ``chat.completion``, a
Responses line's the response object.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from typing import Any

from tasks_app.openai.batches.lines import CHAT, ENDPOINTS
from tasks_app.openai.chat_completions.translate import chat_completion_object
from tasks_app.services.batches import batch_keeper_run

_started: threading.Thread | None = None
_stop = threading.Event()


def batch_line_body(endpoint: str, response: Mapping[str, Any]) -> Mapping[str, Any]:
    """A succeeded line's ``response.body``: what ``POST <endpoint>`` would have answered."""
    if ENDPOINTS.get(endpoint) == CHAT:
        return chat_completion_object(response)
    return response


def batch_keeper_start() -> None:
    """Start this process's keeper thread (once)."""
    global _started
    if _started is not None:
        return
    _started = threading.Thread(
        target=batch_keeper_run, kwargs={"render": batch_line_body, "stop": _stop}, name="lmsp-batches", daemon=True
    )
    _started.start()
