"""Durable conversation state: ``previous_response_id`` (PROFILE.md 10.2).

A response that continues another gets, at accept time, a copy of the whole
conversation before it: the previous response's own context (its chain,
already copied when it was accepted), its input and its output, in order.
``instructions`` are not carried over. The copy is stored in the new
task's request (``context``), so:

- resolving a chain of any depth is one query (the previous response's row);
- the worker renders it without reading the database;
- it survives restarts, and deleting a response later leaves the responses
  that continued it intact (docs/decisions/0004-conversations-copy-their-context.md).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from tasks_app.exceptions import LmspError, ResponseNotFinished, ResponseNotFound
from tasks_app.models import Client, Response
from tasks_app.states import ResponseStatus

FINISHED = (ResponseStatus.COMPLETED, ResponseStatus.INCOMPLETE, ResponseStatus.FAILED, ResponseStatus.CANCELLED)
PARAM = "previous_response_id"


@dataclass(frozen=True)
class Conversation:
    """What a response continuing another starts from."""

    context: list[dict[str, Any]]
    worker: str
    """The worker (``<node>/<pid>``) that ran the previous response: its node holds the conversation's
    prefix cache (``tasks_app.plumbing.affinity``); "" when none ran it."""


def conversation_of(*, client: Client, request: Mapping[str, Any]) -> Conversation | None:
    """The conversation ``request`` continues, or None when it names no ``previous_response_id``.

    Read before the accepting transaction: a finished response does not
    change, and one deleted meanwhile leaves the copy intact.
    """
    previous = request.get(PARAM)
    return None if not previous else _conversation(client=client, previous_response_id=previous)


@dataclass(frozen=True)
class Continuation:
    """The conversation a request continues, or why it cannot be continued, to be raised later."""

    context: list[dict[str, Any]] | None = None
    refusal: LmspError | None = None
    worker: str = ""
    """The worker that ran the previous response (``Conversation.worker``)."""

    def context_or_refusal(self) -> list[dict[str, Any]] | None:
        if self.refusal is not None:
            raise self.refusal
        return self.context


def conversation_continuation(*, client: Client, request: Mapping[str, Any]) -> Continuation:
    """``conversation_of``, with its refusal kept instead of raised.

    For an accept with an ``Idempotency-Key``: the retry of a request that was
    accepted gets its first answer again even when the response it continued
    has been deleted since (or, never, has stopped being finished), so the
    refusal may only be raised once the key had its say.
    """
    try:
        conversation = conversation_of(client=client, request=request)
    except (ResponseNotFound, ResponseNotFinished) as refusal:
        return Continuation(refusal=refusal)
    if conversation is None:
        return Continuation()
    return Continuation(context=conversation.context, worker=conversation.worker)


def conversation_context(*, client: Client, previous_response_id: str) -> list[dict[str, Any]]:
    """The items a response continuing ``previous_response_id`` starts from (one query).

    Unknown, another client's or an unstored (``store: false``) response is
    ``ResponseNotFound``; one that has not finished is ``ResponseNotFinished``.
    """
    return _conversation(client=client, previous_response_id=previous_response_id).context


def _conversation(*, client: Client, previous_response_id: str) -> Conversation:
    row = (
        Response.objects.filter(pk=previous_response_id, client=client)
        .values_list("request", "output", "status", "task__worker")
        .first()
    )
    if row is None or row[0].get("store") is False:
        raise ResponseNotFound(
            f"No stored response with id {previous_response_id!r} to continue",
            errors=[{"field": PARAM, "message": "no stored response of this client has this id"}],
        )
    request, output, status, worker = row
    if status not in FINISHED:
        raise ResponseNotFinished(
            f"response {previous_response_id} has not finished ({status}); continue it once it has",
            errors=[{"field": PARAM, "message": "has not finished"}],
        )
    context = [*request.get("context", ()), *input_items(request.get("input")), *output_input_items(output)]
    return Conversation(context=context, worker=worker or "")


def input_items(given: str | list[Mapping[str, Any]] | None) -> list[dict[str, Any]]:
    """A request's ``input`` as a list of items (a string is one user message)."""
    if given is None:
        return []
    if isinstance(given, str):
        return [{"type": "message", "role": "user", "content": given}]
    return [dict(item) for item in given]


def output_input_items(output: list[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """A response's output items as the input items a client would echo back."""
    items: list[dict[str, Any]] = []
    for item in output or ():
        if item.get("type") == "message":
            parts = item.get("content", ())
            text = "".join(part.get("text", "") for part in parts if part.get("type") == "output_text")
            items.append({"type": "message", "role": "assistant", "content": text})
        elif item.get("type") == "function_call":
            items.append({key: item[key] for key in ("type", "call_id", "name", "arguments")})
    return items
