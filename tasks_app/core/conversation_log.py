"""A conversation's items from the responses that use it (PROFILE.md 12.1), settled when each one ends.

A response accepted with ``conversation`` adds its input items at once as
``pending`` rows (``services.conversations``): listed by no one, read by no
other response. Its end, in the transaction of its terminal event:

- ``completed`` or ``incomplete``: the pending items become ``added`` and its
  output items follow them, so a later response reads this one's question
  and answer; the conversation remembers the worker for routing;
- ``failed`` or ``cancelled``: the pending items are dropped; the conversation
  is as it was before the request, which can simply be sent again.

A conversation deleted meanwhile has taken its pending items with it; the
response then adds nothing. Deleting the response later leaves its items.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime

from tasks_app.core.output_items import output_turn
from tasks_app.models import Conversation, ConversationItem, ConversationItemState, Response
from tasks_app.states import ResponseStatus

# The response statuses whose items join the conversation: it answered, whole or cut at a limit.
ANSWERED = frozenset({ResponseStatus.COMPLETED, ResponseStatus.INCOMPLETE})


def conversation_items_settle(*, ends: Sequence[tuple[Response, str]], now: datetime) -> None:
    """Each ended response's pending items added with its output, or dropped (module docstring).

    ``ends``: the responses as they end (status and output final), each with the worker that ran it ("" none).
    """
    dropped = [response.pk for response, _ in ends if response.status not in ANSWERED]
    if dropped:
        ConversationItem.objects.filter(response_id__in=dropped, state=ConversationItemState.PENDING).delete()
    for response, worker in ends:
        if response.status in ANSWERED:
            _answered(response, worker, now)


def _answered(response: Response, worker: str, now: datetime) -> None:
    columns = {"updated_at": now, **({"last_worker": worker} if worker else {})}
    if not Conversation.objects.filter(pk=response.conversation_id).update(**columns):
        return  # deleted while the response ran: its pending items went with it
    ConversationItem.objects.filter(response_id=response.pk, state=ConversationItemState.PENDING).update(
        state=ConversationItemState.ADDED
    )
    rows = []
    for item in response.output or ():
        turn = output_turn(item)
        rows.append(
            ConversationItem(
                conversation_id=response.conversation_id,
                item_id=item["id"],
                item=item,
                turn=None if turn is None else turn.to_json(),
                state=ConversationItemState.ADDED,
                response_id=response.pk,
                created_at=now,
            )
        )
    ConversationItem.objects.bulk_create(rows)
