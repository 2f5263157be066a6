"""What each task should be, and what the database says it is, for the lifecycle's state machine test.

``tests/test_lifecycle_machine.py`` drives the real verbs and recoveries in
random orders; this module keeps its model of every task (:class:`Expected`)
and reads the database back (:func:`world_read`) so that every step can be
checked against both. The model is written from the spec, not from the code
under test: chapter 11.3's table is spelled out here again, so a wrong cell
in ``tasks_app.states`` would show up as a disagreement.
"""

from __future__ import annotations

import enum
import json
from collections import Counter
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from django.db.models import Count

from tasks_app import events
from tasks_app.events import EventType
from tasks_app.models import Client, IdempotencyKey, Response, Task, TaskEvent, TaskSnapshot, WebhookDelivery
from tasks_app.states import ResponseStatus, RestartPolicy, TaskStatus

S = TaskStatus
E = EventType
R = RestartPolicy
RS = ResponseStatus

# Chapter 11.3 (persistence.en.md), copied by hand: where a leftover task goes, by status found and policy.
SPEC_RECOVERY: dict[TaskStatus, dict[RestartPolicy, TaskStatus]] = {
    S.QUEUED: {R.FAIL: S.FAILED, R.RETRY: S.QUEUED, R.RESUME: S.QUEUED},
    S.LOADING: {R.FAIL: S.FAILED, R.RETRY: S.QUEUED, R.RESUME: S.QUEUED},
    S.RUNNING: {R.FAIL: S.FAILED, R.RETRY: S.QUEUED, R.RESUME: S.RUNNING},
    S.CANCELLING: {R.FAIL: S.CANCELLED, R.RETRY: S.CANCELLED, R.RESUME: S.CANCELLED},
}
UNFINISHED = frozenset(SPEC_RECOVERY)
FINISHED = frozenset({S.SUCCEEDED, S.FAILED, S.CANCELLED})
HELD = frozenset({S.LOADING, S.RUNNING, S.CANCELLING})
# Where the current attempt may have shown text: its end keeps what its deltas hold.
SHOWS_TEXT = frozenset({S.RUNNING, S.CANCELLING})
TERMINAL_EVENTS = frozenset(events.TERMINAL)

# The recovery summary's label for each move (tasks_app.services.recovery).
MOVED_LABEL: dict[TaskStatus, str] = {
    S.FAILED: "failed",
    S.CANCELLED: "cancelled",
    S.QUEUED: "queued",
    S.RUNNING: "running (to resume)",
}
LEFT_QUEUED = "left queued"
WAITING = "left waiting to resume"


class Beat(enum.Enum):
    """The task's ``heartbeat_at`` as time sees it."""

    NONE = "none"
    """Never held, or let go by recovery."""
    FRESH = "fresh"
    """Written by its holder just now."""
    STALE = "stale"
    """Older than the reaper's timeout: the holder stopped writing (or time was made to pass)."""


@dataclass
class Expected:
    """What one task should be; the machine changes it only when the database should have changed."""

    name: str
    id: str
    response_id: str
    policy: RestartPolicy
    notify: bool = False
    """Its end goes to the client's webhook endpoints (an outbox row per subscribed endpoint, with the end)."""
    status: TaskStatus = S.QUEUED
    worker: str = ""
    beat: Beat = Beat.NONE
    attempts: int = 0
    item_id: str | None = None
    """The current attempt's output item; None until the attempt starts."""
    text: str = ""
    """The text the current attempt's committed deltas hold."""
    events: list[str] = field(default_factory=lambda: [str(E.CREATED)])
    snapshots: int = 0
    response_status: ResponseStatus = RS.QUEUED
    output_text: str = ""
    """The text of the response's stored output (always empty before the end)."""
    output_item: str | None = None
    """The id of the response's stored output item (None: it stores none)."""
    error_code: str | None = None
    deleted: bool = False
    earlier: tuple[str, str] | None = None
    """The newest earlier attempt that opened an item: its item and text (the log still holds them)."""

    # ------------------------------------------------------------------ #
    # The effects of the moves that won
    # ------------------------------------------------------------------ #

    def claimed(self, worker: str) -> None:
        self.status, self.worker, self.beat = S.LOADING, worker, Beat.FRESH
        self.attempts += 1
        self.item_id, self.text = None, ""

    def adopted(self, worker: str) -> None:
        self.worker, self.beat = worker, Beat.FRESH
        self.attempts += 1

    def started(self, item_id: str) -> None:
        self.status, self.beat, self.item_id, self.text = S.RUNNING, Beat.FRESH, item_id, ""
        self.events += [E.IN_PROGRESS, E.OUTPUT_ITEM_ADDED, E.CONTENT_PART_ADDED]
        self.snapshots = 1
        self.response_status = RS.IN_PROGRESS

    def progressed(self, deltas: list[str], snapshot: bool) -> None:
        self.beat = Beat.FRESH
        self.text += "".join(deltas)
        self.events += [E.OUTPUT_TEXT_DELTA] * len(deltas)
        self.snapshots += snapshot

    def succeeded(self, deltas: list[str], incomplete: bool) -> None:
        self.progressed(deltas, snapshot=False)
        end = E.INCOMPLETE if incomplete else E.COMPLETED
        self.events += [E.OUTPUT_TEXT_DONE, E.CONTENT_PART_DONE, E.OUTPUT_ITEM_DONE, end]
        self.response_status = RS.INCOMPLETE if incomplete else RS.COMPLETED
        self._ended(S.SUCCEEDED, self.text)
        # A success stores its item even when it holds no text.
        self.output_item = self.item_id

    def failed(self, code: str, text: str) -> None:
        self.events.append(E.FAILED)
        self.response_status, self.error_code = RS.FAILED, code
        self._ended(S.FAILED, text)

    def cancel_requested(self) -> None:
        self.status = S.CANCELLING

    def cancelled(self, text: str) -> None:
        self.events.append(E.CANCELLED)
        self.response_status = RS.CANCELLED
        self._ended(S.CANCELLED, text)

    def requeued(self) -> None:
        if self.item_id is not None:
            self.earlier = (self.item_id, self.text)
        self.status, self.worker, self.beat = S.QUEUED, "", Beat.NONE
        self.item_id, self.text, self.snapshots = None, "", 0
        self.response_status = RS.QUEUED
        # The log says the attempt's output is dropped: a rerun's events rebuild it.
        self.events.append("response.queued")

    def let_go(self) -> None:
        """Recovery keeps it running without a worker, for another to adopt and resume."""
        self.worker, self.beat = "", Beat.NONE

    def _ended(self, status: TaskStatus, text: str) -> None:
        # A stop keeps its item only if it holds text (``Partial.output``).
        self.status, self.output_text, self.snapshots = status, text, 0
        self.output_item = self.item_id if text else None

    def recovered(self, to: TaskStatus) -> None:
        """Chapter 11.3's move; what an ending keeps is the current attempt's text, if it showed any."""
        shown = self.text if self.status in SHOWS_TEXT else ""
        if to == S.FAILED:
            self.failed("server_restarted", shown)
        elif to == S.CANCELLED:
            self.cancelled(shown)
        elif to == S.QUEUED:
            self.requeued()
        else:
            self.let_go()


def recovery_plan(task: Expected, *, max_attempts: int) -> TaskStatus | None:
    """Where recovery sends ``task`` (None: it stays as it is, only sent to the workers again).

    A task that would run again after ``max_attempts`` starts fails instead,
    except a cancelling one (its cancel wins); a task already waiting to be
    adopted (running without a worker) only waits on.
    """
    target = SPEC_RECOVERY[task.status][task.policy]
    runs_again = target in (S.QUEUED, S.RUNNING) and task.status != S.QUEUED
    if runs_again and task.attempts >= max_attempts:
        return S.FAILED
    if task.status == target == S.QUEUED or (task.status == target == S.RUNNING and task.worker == ""):
        return None
    return target


def summary_expected(plans: dict[str, tuple[TaskStatus, TaskStatus | None]]) -> dict[str, list[str]]:
    """The recovery summary's ``task_ids`` for ``{task id: (found, plan)}``: per label, in id order."""
    labels: dict[str, list[str]] = {}
    for task_id in sorted(plans):
        found, to = plans[task_id]
        label = MOVED_LABEL[to] if to is not None else (LEFT_QUEUED if found == S.QUEUED else WAITING)
        labels.setdefault(label, []).append(task_id)
    return labels


# --------------------------------------------------------------------------- #
# The database's side
# --------------------------------------------------------------------------- #


@dataclass(frozen=True)
class TaskView:
    """One task as the database holds it: the row, its response row, its events and how many snapshot rows."""

    row: dict[str, Any]
    response: dict[str, Any] | None
    events: tuple[tuple[int, str, str], ...]
    snapshots: int

    @property
    def status(self) -> str:
        return self.row["status"]

    def payloads(self) -> list[dict[str, Any]]:
        return [json.loads(payload) for _, _, payload in self.events]


def world_reset() -> None:
    """Delete every row a previous example left (the examples of one test share its database)."""
    TaskSnapshot.objects.all().delete()
    TaskEvent.objects.all().delete()
    WebhookDelivery.objects.all().delete()
    IdempotencyKey.objects.all().delete()
    Task.objects.all().delete()
    Response.objects.all().delete()
    Client.objects.all().delete()


def world_read(task_ids: list[str] | None = None) -> dict[str, TaskView]:
    """Every task (or those of ``task_ids``) as the database holds it, in four queries."""
    tasks = Task.objects.all() if task_ids is None else Task.objects.filter(pk__in=task_ids)
    rows = {row["id"]: row for row in tasks.values()}
    responses = {
        row["id"]: row for row in Response.objects.filter(pk__in=[r["response_id"] for r in rows.values()]).values()
    }
    logged: dict[str, list[tuple[int, str, str]]] = {task_id: [] for task_id in rows}
    for task_id, sequence, kind, payload in (
        TaskEvent.objects.filter(task_id__in=list(rows))
        .order_by("task_id", "sequence_number")
        .values_list("task_id", "sequence_number", "type", "payload")
    ):
        logged[task_id].append((sequence, kind, payload))
    kept = Counter(
        dict(
            TaskSnapshot.objects.filter(task_id__in=list(rows))
            .values("task_id")
            .annotate(n=Count("id"))
            .values_list("task_id", "n")
        )
    )
    return {
        task_id: TaskView(row, responses.get(row["response_id"]), tuple(logged[task_id]), kept[task_id])
        for task_id, row in rows.items()
    }


def orphan_rows() -> dict[str, int]:
    """Rows that outlived their task (or response): none may exist."""
    return {
        "responses without a task": Response.objects.filter(task__isnull=True).count(),
        "events without a task": TaskEvent.objects.exclude(task_id__in=Task.objects.values("id")).count(),
        "snapshots without a task": TaskSnapshot.objects.exclude(task_id__in=Task.objects.values("id")).count(),
    }


def beat_of(heartbeat_at: datetime | None, *, now: datetime, timeout_seconds: int) -> Beat:
    if heartbeat_at is None:
        return Beat.NONE
    return Beat.FRESH if heartbeat_at >= now - timedelta(seconds=timeout_seconds) else Beat.STALE


def webhook_deliveries() -> list[tuple[str, str, str]]:
    """The outbox: (task id, response id, event type) of every delivery, in order."""
    return sorted(WebhookDelivery.objects.values_list("task_id", "response_id", "event_type"))


def text_after(view: TaskView, item_id: str) -> str:
    """The text of the deltas the log holds after ``item_id`` opened (the attempt that opened it)."""
    deltas: list[str] | None = None
    for _, kind, payload in view.events:
        if kind == E.OUTPUT_ITEM_ADDED:
            deltas = [] if events.opened_item_id(payload) == item_id else None
        elif kind == E.OUTPUT_TEXT_DELTA and deltas is not None:
            deltas.append(payload)
    return events.delta_text(deltas or [])


def check_task(task: Expected, view: TaskView, *, now: datetime, timeout_seconds: int) -> None:
    """Everything the database holds of ``task`` agrees with the model, and with itself."""
    row, where = view.row, f"{task.name} ({task.id})"
    assert (row["status"], row["on_restart"], row["worker"], row["attempts"]) == (
        task.status,
        task.policy,
        task.worker,
        task.attempts,
    ), f"{where}: row {row} but expected {task}"
    assert beat_of(row["heartbeat_at"], now=now, timeout_seconds=timeout_seconds) == task.beat, where
    # The log: contiguous from 0, last_sequence is its newest, and the event types the moves wrote.
    numbers = [sequence for sequence, _, _ in view.events]
    assert numbers == list(range(len(numbers))), f"{where}: sequence numbers {numbers}"
    assert row["last_sequence"] == len(numbers) - 1, f"{where}: last_sequence {row['last_sequence']}, log {numbers}"
    kinds = [kind for _, kind, _ in view.events]
    assert kinds == task.events, f"{where}: log {kinds}, expected {task.events}"
    payloads = view.payloads()
    assert [(p["type"], p["sequence_number"]) for p in payloads] == list(zip(kinds, numbers, strict=True)), where
    ends = [kind for kind in kinds if kind in TERMINAL_EVENTS]
    if task.status in FINISHED:
        assert len(ends) == 1 and kinds[-1] in TERMINAL_EVENTS, f"{where}: finished with {kinds}"
    else:
        assert ends == [], f"{where}: unfinished with {kinds}"
    assert view.snapshots == task.snapshots, f"{where}: {view.snapshots} snapshot rows, expected {task.snapshots}"
    if task.item_id is not None and task.status in UNFINISHED:
        assert text_after(view, task.item_id) == task.text, f"{where}: committed text"
    check_response(task, view, payloads)


def stored_problem(shown: dict[str, Any] | None, where: str) -> dict[str, Any] | None:
    """A problem as a task or response shows it, as stored: the wire adds OpenAI's ``message`` (``code: detail``)."""
    if shown is None:
        return None
    stored = dict(shown)
    assert stored.pop("message") == f"{stored['code']}: {stored['detail']}", f"{where}: error shown as {shown}"
    return stored


def check_response(task: Expected, view: TaskView, payloads: list[dict[str, Any]]) -> None:
    """The response row agrees with the task row, the model and (finished) the terminal event."""
    response, row, where = view.response, view.row, f"{task.name} ({task.id})"
    assert response is not None, f"{where}: its response row is gone"
    assert response["status"] == task.response_status, f"{where}: response {response['status']}, expected {task}"
    implied = {S.QUEUED: RS.QUEUED, S.RUNNING: RS.IN_PROGRESS, S.FAILED: RS.FAILED, S.CANCELLED: RS.CANCELLED}
    if row["status"] in implied:
        assert response["status"] == implied[row["status"]], where
    if row["status"] == S.SUCCEEDED:
        assert response["status"] in (RS.COMPLETED, RS.INCOMPLETE), where
    if task.status not in FINISHED:
        assert response["output"] == [], f"{where}: an unfinished response stores output {response['output']}"
        return
    items = [item["id"] for item in response["output"]]
    assert items == ([task.output_item] if task.output_item else []), f"{where}: output items {items}"
    assert events.output_text(response["output"]) == task.output_text, (
        f"{where}: the response keeps {events.output_text(response['output'])!r}, "
        f"the attempt's committed text was {task.output_text!r}"
    )
    shown = payloads[-1]["response"]
    assert (shown["status"], shown["output"], stored_problem(shown["error"], where)) == (
        response["status"],
        response["output"],
        response["error"],
    ), f"{where}: the terminal event shows {shown}, the row is {response}"
    if task.status == S.FAILED:
        assert row["error"] == response["error"] and row["error"]["code"] == task.error_code, where
