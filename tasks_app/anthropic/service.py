"""Messages (PROFILE.md 11.1): a request accepted as a durable task, its prompt counted first.

``message_start`` counts the prompt as the worker will see it (the model's
own tokenizer and template, ``workers.prompt_counts``): a prompt over the
context is refused before anything is queued, in the words Claude Code reads
to offer compacting (``prompt is too long: N tokens > M maximum``), and the
count is the ``input_tokens`` of ``message_start``. Then it is a response
task like any other (``response_start``): listed by ``GET /tasks``,
recovered by its policy, its events the task's log.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from tasks_app.exceptions import ContextLengthExceeded, UnsupportedCapability
from tasks_app.generation.spec import GenerationSpec
from tasks_app.models import Client
from tasks_app.services.responses import ResponseStarted, response_start
from tasks_app.states import Protocol, RestartPolicy

logger = logging.getLogger(__name__)

# Idempotency keys of Messages requests are their own: a key used on /responses is another request.
MESSAGES_ENDPOINT = "messages"


@dataclass(frozen=True)
class MessageStarted:
    started: ResponseStarted
    input_tokens: int | None
    """The prompt's tokens as counted at accept (None where this host cannot read the model's files)."""


def message_prompt_tokens(*, spec: GenerationSpec) -> tuple[int, int] | None:
    """The prompt's tokens and the model's context; None where this host cannot read the model's files."""
    # Imported here: the counter loads the tokenizer library, which a web process needs only now.
    from workers.prompt_counts import PromptCountUnavailable, prompt_count

    try:
        count = prompt_count(spec)
    except PromptCountUnavailable as exc:
        logger.warning("prompt of model %s not counted on this host: %s", spec.model, exc)
        return None
    return count.tokens, count.context_length


def message_tokens_count(*, spec: GenerationSpec) -> int:
    """``count_tokens``: the prompt's tokens, as the model will read them."""
    counted = message_prompt_tokens(spec=spec)
    if counted is None:
        raise UnsupportedCapability(
            f"this web process cannot read model {spec.model!r}'s tokenizer (its folder under LMSP_MODELS_DIR): "
            "token counts need the model's files on the web host"
        )
    return counted[0]


def message_start(
    *,
    client: Client,
    request: Mapping[str, Any],
    spec: GenerationSpec,
    stream: bool,
    on_restart: RestartPolicy,
    idempotency_key: str | None,
    request_hash: str | None,
) -> MessageStarted:
    """Count, check and accept a Messages request as a response task, durable once this returns."""
    counted = message_prompt_tokens(spec=spec)
    if counted is not None:
        tokens, context = counted
        if tokens >= context:
            # The model needs a place for one token of output: the most a prompt may have is one less.
            raise ContextLengthExceeded(f"prompt is too long: {tokens} tokens > {context - 1} maximum")
    started = response_start(
        client=client,
        request=request,
        spec=spec,
        idempotency_key=idempotency_key,
        request_hash=request_hash,
        stream=stream,
        on_restart=on_restart,
        protocol=Protocol.ANTHROPIC,
        endpoint=MESSAGES_ENDPOINT,
    )
    return MessageStarted(started, counted[0] if counted is not None else None)
