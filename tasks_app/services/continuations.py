"""Durable conversation state: ``previous_response_id`` (PROFILE.md 10.2).

A response that continues another gets, at accept time, a copy of the whole
conversation before it: the previous response's own context (its chain,
already copied when it was accepted), its input and its output, in order.
``instructions`` are not carried over. The copy is the first turns of the
new task's generation spec (``GenerationSpec.continued``), so:

- resolving a chain of any depth is one query (the previous response's row);
- the worker renders it without reading the database;
- it survives restarts, and deleting a response later leaves the responses
  that continued it intact (docs/decisions/0004-conversations-copy-their-context.md).
"""

from __future__ import annotations

from dataclasses import dataclass

from tasks_app.core.output_items import output_turns
from tasks_app.exceptions import LmspError, ResponseNotFinished, ResponseNotFound
from tasks_app.generation.spec import GenerationSpec, Turn
from tasks_app.models import Client, Response
from tasks_app.states import ResponseStatus

FINISHED = (ResponseStatus.COMPLETED, ResponseStatus.INCOMPLETE, ResponseStatus.FAILED, ResponseStatus.CANCELLED)
PARAM = "previous_response_id"


@dataclass(frozen=True)
class Conversation:
    """What a response continuing another starts from."""

    context: list[Turn]
    worker: str
    """The worker (``<node>/<pid>``) that ran the previous response: its node holds the conversation's
    prefix cache (``tasks_app.plumbing.affinity``); "" when none ran it."""


def conversation_of(*, client: Client, previous_response_id: str | None) -> Conversation | None:
    """The conversation a request continues, or None when it continues none.

    Read before the accepting transaction: a finished response does not
    change, and one deleted meanwhile leaves the copy intact.
    """
    return None if not previous_response_id else _conversation(client=client, previous_response_id=previous_response_id)


@dataclass(frozen=True)
class Continuation:
    """The conversation a request continues, or why it cannot be continued, to be raised later."""

    context: list[Turn] | None = None
    refusal: LmspError | None = None
    worker: str = ""
    """The worker that ran the previous response (``Conversation.worker``)."""

    def context_or_refusal(self) -> list[Turn] | None:
        if self.refusal is not None:
            raise self.refusal
        return self.context


def conversation_continuation(*, client: Client, previous_response_id: str | None) -> Continuation:
    """``conversation_of``, with its refusal kept instead of raised.

    For an accept with an ``Idempotency-Key``: the retry of a request that was
    accepted gets its first answer again even when the response it continued
    has been deleted since (or, never, has stopped being finished), so the
    refusal may only be raised once the key had its say.
    """
    try:
        conversation = conversation_of(client=client, previous_response_id=previous_response_id)
    except (ResponseNotFound, ResponseNotFinished) as refusal:
        return Continuation(refusal=refusal)
    if conversation is None:
        return Continuation()
    return Continuation(context=conversation.context, worker=conversation.worker)


def conversation_context(*, client: Client, previous_response_id: str) -> list[Turn]:
    """The turns a response continuing ``previous_response_id`` starts from (one query).

    Unknown, another client's or an unstored (``store: false``) response is
    ``ResponseNotFound``; one that has not finished is ``ResponseNotFinished``.
    """
    return _conversation(client=client, previous_response_id=previous_response_id).context


def _conversation(*, client: Client, previous_response_id: str) -> Conversation:
    row = (
        Response.objects.filter(pk=previous_response_id, client=client)
        .values_list("request", "generation", "output", "status", "task__worker")
        .first()
    )
    if row is None or row[0].get("store") is False:
        raise ResponseNotFound(
            f"No stored response with id {previous_response_id!r} to continue",
            errors=[{"field": PARAM, "message": "no stored response of this client has this id"}],
        )
    _, generation, output, status, worker = row
    if status not in FINISHED:
        raise ResponseNotFinished(
            f"response {previous_response_id} has not finished ({status}); continue it once it has",
            errors=[{"field": PARAM, "message": "has not finished"}],
        )
    context = GenerationSpec.from_json(generation).conversation_turns(output_turns(output))
    return Conversation(context=context, worker=worker or "")
