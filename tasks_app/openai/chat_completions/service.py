"""Chat completions (PROFILE.md 10.3): a response request under another shape.

``chat_completion_start`` accepts the translated request as a response
(``response_start``: the same task, workers and engine); a chat client
that leaves before the end cancels it (``services.tasks.task_abandon``),
since a chat completion cannot be followed again.
"""

from __future__ import annotations

from tasks_app.models import Client
from tasks_app.openai.chat_completions.translate import ChatRequest
from tasks_app.openai.responses.translate import accepted_spec
from tasks_app.services.responses import ResponseStarted, response_start


def chat_completion_start(*, client: Client, chat: ChatRequest) -> ResponseStarted:
    """Accept a translated chat request as a response task, durable once this returns."""
    return response_start(
        client=client,
        request=chat.response_request,
        spec=accepted_spec(chat.response_request),
        idempotency_key=None,
        request_hash=None,
        stream=chat.stream,
    )
