"""The one owner of task state: every move a task makes is a named verb here.

Each verb names its sources and target (``MOVES``, checked against chapter
7.2's table in ``tasks_app.states`` when ``tasks_app.core.transitions``
loads), sets its own columns and builds its own events
(``tasks_app.core.event_payloads``). All of them run through one
compare-and-set, ``tasks_app.core.transitions.write_apply`` (its docstring
has the steps): the row count says who won, so two writers racing (a cancel
and a completion, a recovery and a worker) can never both win, and only the
winner writes the response, the events, the snapshot rows and the wake-up.

Recovery (chapter 11.3) moves a page of tasks in one transaction,
:func:`tasks_recover` (``tasks_app.core.recovery_moves``): the same
compare-and-set, checked for every task under its lock, with the same
events, snapshots and wake-ups.

Callers learn the outcome from ``TransitionResult.won`` (``RecoveryBatch``);
nothing outside the lifecycle's modules (this one, ``transitions``,
``recovery_moves``, ``log_rows``) writes a task's status, sequence numbers or
events (``tests/test_architecture.py`` checks).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from django.db import transaction
from django.db.models import F
from django.utils import timezone

from tasks_app import events
from tasks_app.core import event_payloads, output_items
from tasks_app.core.log_rows import events_insert
from tasks_app.core.recovery_moves import RecoveryBatch, RecoveryMove, tasks_recover
from tasks_app.core.transitions import MOVES, TransitionResult, Write, write_apply, writes_apply
from tasks_app.core.wire import message_item
from tasks_app.events import Event
from tasks_app.exceptions import TransitionNotAllowed
from tasks_app.ids import new_response_id, new_task_id
from tasks_app.models import Client, Response, Task, TaskType
from tasks_app.states import Protocol, ResponseStatus, RestartPolicy, TaskStatus

# The lifecycle's names, whichever of its modules holds them: callers use ``lifecycle.<name>``.
__all__ = [
    "MOVES",
    "Partial",
    "ProgressBatch",
    "RecoveryBatch",
    "RecoveryMove",
    "TransitionResult",
    "task_adopt",
    "task_cancel_queued",
    "task_claim",
    "task_fail",
    "task_finish_cancel",
    "task_heartbeat",
    "task_insert",
    "task_progress",
    "task_request_cancel",
    "task_start",
    "task_succeed",
    "tasks_progress",
    "tasks_recover",
]

S = TaskStatus


@dataclass(frozen=True)
class Partial:
    """What a stopped attempt keeps: its output item with the text its committed deltas hold, and its usage.

    A run that may call tools passes its ``items`` (messages and calls as
    committed) instead: the open one is kept ``incomplete``.
    """

    item_id: str
    text: str
    usage: Mapping[str, Any] | None = None
    items: Sequence[output_items.OutputItem] | None = None

    def output(self) -> list[dict[str, Any]]:
        if self.items is not None:
            return output_items.stopped_output(self.items)
        return [message_item(self.item_id, self.text, "incomplete")] if self.text else []


# --------------------------------------------------------------------------- #
# Creation
# --------------------------------------------------------------------------- #


def task_insert(
    *,
    client: Client,
    request: Mapping[str, Any],
    generation: Mapping[str, Any],
    model: str,
    on_restart: RestartPolicy = RestartPolicy.FAIL,
    metadata: Mapping[str, str] | None = None,
    notify_webhooks: bool = False,
    protocol: Protocol = Protocol.LMSP,
    rerun_of: Task | None = None,
    conversation_id: str = "",
    batch_id: str = "",
) -> Task:
    """Create a queued task, its response and event 0 (``response.created``).

    ``request`` is kept as the client sent it (its echo, its replay), in
    ``protocol``'s shape; ``generation`` is the generation spec translated
    from it, all a worker reads.

    Runs in the caller's transaction when there is one, so that the caller can
    commit the idempotency record with it. ``notify_webhooks``: the task's end
    is delivered to its client's webhook endpoints (not for a response whose
    caller waits on the connection). ``rerun_of``: the task an operator ran again to make this one.
    ``conversation_id``: the conversation its response adds its items to when it ends (PROFILE.md 12.1).
    ``batch_id``: the batch whose line it runs; its end settles the line (``core/batch_log``).
    """
    now = timezone.now()
    # No savepoint: inside a caller's transaction a failure here must undo
    # the caller's writes too (the idempotency claim).
    with transaction.atomic(savepoint=False):
        response = Response.objects.create(
            id=new_response_id(),
            client=client,
            model=model,
            status=ResponseStatus.QUEUED,
            protocol=protocol,
            request=dict(request),
            generation=dict(generation),
            metadata=dict(metadata or {}),
            conversation_id=conversation_id,
            batch_id=batch_id,
            created_at=now,
            updated_at=now,
        )
        task = Task.objects.create(
            id=new_task_id(),
            client=client,
            type=TaskType.RESPONSE,
            status=S.QUEUED,
            on_restart=on_restart,
            response=response,
            last_sequence=0,
            notify_webhooks=notify_webhooks,
            rerun_of=rerun_of,
            created_at=now,
            updated_at=now,
        )
        events_insert(task, [events.encoded(event_payloads.created(response))], now)
    return task


# --------------------------------------------------------------------------- #
# A worker's verbs: claim or adopt, start, progress, heartbeat, end
# --------------------------------------------------------------------------- #

# Every commit a worker makes is also its heartbeat.
_BEAT = ("heartbeat_at",)
# A claim or an adoption opens an attempt (``tasks_app.core.attempt_log``).
_OPEN = ("heartbeat_at", "attempt_started_at")


def task_claim(*, task_id: str, worker: str) -> TransitionResult:
    """``queued -> loading`` for ``worker``: of several deliveries of one task, one wins.

    Counts the attempt, starts the output count over and marks where the
    attempt's events begin (a claim writes none): an earlier attempt's output
    item is never this one's, even while this one has opened none.
    """
    columns = {
        "worker": worker,
        "attempts": F("attempts") + 1,
        "output_tokens": 0,
        "attempt_after": F("last_sequence"),
        "first_token_at": None,
    }
    return write_apply(task_id, Write(MOVES["task_claim"], task=columns, stamped=_OPEN))


def task_adopt(*, task_id: str, worker: str) -> TransitionResult:
    """A worker takes over a task that recovery left ``running`` (or a cancel
    made ``cancelling``) without a worker, to resume it from its snapshot.

    A compare-and-set on an empty ``worker``: of several workers handed the
    same task, one wins. The attempt is counted like a claim's.
    """
    columns = {"worker": worker, "attempts": F("attempts") + 1, "first_token_at": None}
    return write_apply(task_id, Write(MOVES["task_adopt"], task=columns, stamped=_OPEN, holder=""))


def task_start(
    *,
    task_id: str,
    worker: str,
    item_id: str | None,
    snapshot: Mapping[str, Any] | None = None,
    deltas: Sequence[str] = (),
    output_tokens: int | None = None,
) -> TransitionResult:
    """``loading -> running``: ``response.in_progress`` and the empty output item and text part.

    ``snapshot`` is the run's first snapshot row (with the prompt ids). A run
    that may call tools passes no ``item_id``: its items open as the model
    writes them (``output_items``). A run whose first tokens came before it
    started passes their ``deltas`` and ``output_tokens`` (the snapshot then
    accounts for them): one commit instead of a start and a first batch.
    """
    if item_id is None:
        if deltas:
            raise ValueError("deltas need the message item they belong to")
        written: list[Event] = []
    else:
        written = [
            *event_payloads.message_opened(item_id, 0),
            *(event_payloads.message_delta(item_id, 0, text) for text in deltas),
        ]
    write = Write(
        MOVES["task_start"],
        task={} if output_tokens is None else {"output_tokens": output_tokens},
        stamped=_BEAT,
        events=written,
        opening=event_payloads.in_progress,
        snapshot=snapshot,
        holder=worker,
        output=bool(deltas) or bool(output_tokens),
    )
    return write_apply(task_id, write)


def task_progress(
    *,
    task_id: str,
    worker: str,
    item_id: str,
    deltas: Sequence[str],
    output_tokens: int,
    snapshot: Mapping[str, Any] | None = None,
    item_events: Sequence[Event] | None = None,
) -> TransitionResult:
    """A batch of text deltas while ``running``, with the snapshot row that accounts for them.

    Loses (``won`` False) once a cancel or another writer moved the task:
    that is how a worker learns of a cancel whose notification it missed.
    A run that may call tools passes ``item_events`` (``output_items``:
    items opened, text and argument deltas, items closed) instead of ``deltas``.
    """
    batch = ProgressBatch(task_id, worker, item_id, deltas, output_tokens, snapshot, item_events)
    return write_apply(task_id, _progress_write(batch))


@dataclass(frozen=True)
class ProgressBatch:
    """One task's share of :func:`tasks_progress`: what :func:`task_progress` takes."""

    task_id: str
    worker: str
    item_id: str
    deltas: Sequence[str]
    output_tokens: int
    snapshot: Mapping[str, Any] | None = None
    item_events: Sequence[Event] | None = None


def tasks_progress(*, batches: Sequence[ProgressBatch]) -> list[TransitionResult | None]:
    """:func:`task_progress` for many running tasks in one transaction (a worker's run loop).

    Each task's compare-and-set is checked on its own: one that lost (a
    cancel, another writer) writes nothing and gets ``won`` False, the
    others commit. A task that does not exist gets None. Results come in the
    order of ``batches``; a task appears at most once.
    """
    if len({batch.task_id for batch in batches}) != len(batches):
        raise ValueError("a task appears twice in one group of progress batches")
    return writes_apply([(batch.task_id, _progress_write(batch)) for batch in batches])


def _progress_write(batch: ProgressBatch) -> Write:
    written = (
        list(batch.item_events)
        if batch.item_events is not None
        else [event_payloads.message_delta(batch.item_id, 0, text) for text in batch.deltas]
    )
    return Write(
        MOVES["task_progress"],
        task={"output_tokens": batch.output_tokens},
        stamped=_BEAT,
        events=written,
        snapshot=batch.snapshot,
        holder=batch.worker,
        output=batch.output_tokens > 0,
    )


def task_heartbeat(*, task_id: str, worker: str) -> TransitionResult:
    """``worker`` still holds the task (while loading, or in a long prefill without batches)."""
    return write_apply(task_id, Write(MOVES["task_heartbeat"], stamped=_BEAT, holder=worker))


def task_succeed(
    *,
    task_id: str,
    worker: str,
    item_id: str,
    text: str,
    usage: Mapping[str, Any] | None,
    output_tokens: int,
    deltas: Sequence[str] = (),
    incomplete: bool = False,
    items: output_items.OutputItems | None = None,
    item_events: Sequence[Event] = (),
    stop_sequence: str | None = None,
) -> TransitionResult:
    """``running -> succeeded``: the last deltas, the three ``*.done`` events and the terminal one.

    ``text`` is the whole output (the committed deltas and ``deltas``);
    ``incomplete`` means the run stopped at ``max_output_tokens``; ``stop_sequence``
    is the request's stop string that ended it, if one did. A run that
    may call tools passes its ``items`` (all closed) and the ``item_events``
    not yet committed instead of ``text`` and ``deltas``.
    """
    status = ResponseStatus.INCOMPLETE if incomplete else ResponseStatus.COMPLETED
    item_status = "incomplete" if incomplete else "completed"
    if items is None:
        output = [message_item(item_id, text, item_status)]
        written = [
            *(event_payloads.message_delta(item_id, 0, delta) for delta in deltas),
            *event_payloads.message_closed(item_id, 0, text, item_status),
        ]
    else:
        output, written = items.output(), list(item_events)
    response = {
        "status": status,
        "output": output,
        "usage": dict(usage) if usage is not None else None,
        "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
        "stop_sequence": stop_sequence,
    }
    write = Write(
        MOVES["task_succeed"],
        task={"output_tokens": output_tokens},
        stamped=_BEAT,
        response=response,
        events=written,
        closing=event_payloads.finished,
        holder=worker,
        output=output_tokens > 0,
    )
    return write_apply(task_id, write)


def task_fail(
    *,
    task_id: str,
    error: Mapping[str, Any] | None,
    worker: str | None = None,
    sources: Iterable[TaskStatus] | None = None,
    partial: Partial | None = None,
) -> TransitionResult:
    """``queued|loading|running -> failed`` with ``error`` (a problem object) on task and response.

    A worker passes its name (fencing), the statuses it may fail the task
    from, and what the attempt showed (``partial``), which the response keeps.
    """
    if not error:
        raise TransitionNotAllowed("a move to failed needs an error")
    response: dict[str, Any] = {"error": dict(error)}
    if partial is not None:
        response |= {"output": partial.output(), "usage": partial.usage}
    write = Write(
        MOVES["task_fail"].narrowed(sources),
        task={"error": dict(error)},
        response=response,
        closing=event_payloads.finished,
        holder=worker,
    )
    return write_apply(task_id, write)


def task_finish_cancel(*, task_id: str, worker: str, partial: Partial | None = None) -> TransitionResult:
    """``cancelling -> cancelled`` by the worker that stopped generating; the response keeps ``partial``."""
    response = {} if partial is None else {"output": partial.output(), "usage": partial.usage}
    write = Write(MOVES["task_finish_cancel"], response=response, closing=event_payloads.finished, holder=worker)
    return write_apply(task_id, write)


# --------------------------------------------------------------------------- #
# Cancel (chapter 7.3): the service picks the verb by the status it read
# --------------------------------------------------------------------------- #


def task_cancel_queued(*, task_id: str) -> TransitionResult:
    """``queued -> cancelled`` at once: nothing runs yet."""
    return write_apply(task_id, Write(MOVES["task_cancel_queued"], closing=event_payloads.finished))


def task_request_cancel(*, task_id: str, sources: Iterable[TaskStatus] | None = None) -> TransitionResult:
    """``loading|running -> cancelling``; the worker stops and finishes the move.

    Stamps ``cancel_requested_at``, from which the worker measures its cancel latency.
    """
    write = Write(MOVES["task_request_cancel"].narrowed(sources), stamped=("cancel_requested_at",))
    return write_apply(task_id, write)
