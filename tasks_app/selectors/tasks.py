"""Reads. Visibility rules (a client sees its own rows, `admin` sees all) live here."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from django.db.models import Count, F, Q, QuerySet
from django.utils import timezone

from tasks_app import states
from tasks_app.core import output_items
from tasks_app.core.output_items import task_output_items, task_outputs_items
from tasks_app.core.wire import Live
from tasks_app.events import EventType
from tasks_app.exceptions import (
    EventHistoryExpired,
    InvalidRequest,
    ModelNotFound,
    ModelNotRegistered,
    ResponseNotFound,
    TaskNotFound,
)
from tasks_app.generation.spec import GenerationSpec
from tasks_app.models import Client, ModelRecord, Response, Task, TaskAttempt, TaskEvent, TaskSnapshot
from tasks_app.plumbing.querying import status_in
from tasks_app.states import TaskStatus


def _sees_all(client: Client) -> bool:
    return "admin" in client.scopes


def task_get_visible(*, client: Client, task_id: str) -> Task:
    """The task if this client may see it; otherwise 404, never 403."""
    qs = Task.objects.select_related("response").filter(pk=task_id)
    if not _sees_all(client):
        qs = qs.filter(client=client)
    task = qs.first()
    if task is None:
        raise TaskNotFound(f"No task with id {task_id!r}")
    return task


def response_get_visible(*, client: Client, response_id: str) -> Response:
    qs = Response.objects.filter(pk=response_id)
    if not _sees_all(client):
        qs = qs.filter(client=client)
    response = qs.first()
    if response is None:
        raise ResponseNotFound(f"No response with id {response_id!r}")
    return response


@dataclass(frozen=True)
class ResponseRead:
    """A response as a read shows it: the row, and what is live about it (``wire.Live``)."""

    response: Response
    live: Live


def response_read_visible(*, client: Client, response_id: str) -> ResponseRead:
    """The response with its place in the line (queued) or its output so far (running); else 404.

    One query for the response and its task, then one count on the index of
    unfinished tasks (queued), or two reads of the event log (running).
    """
    qs = Response.objects.select_related("task").filter(pk=response_id)
    if not _sees_all(client):
        qs = qs.filter(client=client)
    response = qs.first()
    if response is None:
        raise ResponseNotFound(f"No response with id {response_id!r}")
    return ResponseRead(response, response_live(response=response))


def response_read(*, response_id: str) -> ResponseRead:
    """:func:`response_read_visible` of a response the caller was already allowed to see."""
    response = Response.objects.select_related("task").get(pk=response_id)
    return ResponseRead(response, response_live(response=response))


def response_live(*, response: Response) -> Live:
    """What a read shows of ``response`` beyond its row (``response.task`` loaded)."""
    task = response.task
    if task.status == TaskStatus.QUEUED:
        return Live(queue_position=task_queue_positions(task_ids=[task.id]).get(task.id))
    if task.status in states.MAY_HAVE_OUTPUT:
        items = task_output_items(task_id=task.id)
        return Live(output=[item.wire("in_progress") for item in items])
    return Live()


def task_queue_positions(*, task_ids: Sequence[str]) -> dict[str, int]:
    """Each task's place in the line of queued tasks (1 = next to start), in one query.

    The line is the order of acceptance (ids are ULIDs), which is the order
    tasks are dispatched in. Counted over the partial index of unfinished
    tasks, up to the last of ``task_ids``: the cost grows with the line
    ahead (bounded by ``LMSP_MAX_QUEUED_TASKS``), not with every task kept.
    Ids of tasks no longer queued get the place they would have had.
    """
    if not task_ids:
        return {}
    ordered = sorted(set(task_ids))
    ahead = {f"ahead_{index}": Count("id", filter=Q(id__lt=task_id)) for index, task_id in enumerate(ordered)}
    counts = Task.objects.filter(status_in([TaskStatus.QUEUED]), id__lt=ordered[-1]).aggregate(**ahead)
    return {task_id: counts[f"ahead_{index}"] + 1 for index, task_id in enumerate(ordered)}


@dataclass(frozen=True)
class StreamReader:
    """Who reads an event stream: a client (bearer or stream token) or a staff session."""

    client: Client | None = None
    # A stream token grants one task only.
    only_task_id: str | None = None
    staff: bool = False


def task_get_streamable(*, reader: StreamReader, task_id: str | None = None, response_id: str | None = None) -> Task:
    """The task whose events ``reader`` may stream, by task or response id; else 404."""
    qs = Task.objects.filter(pk=task_id) if task_id is not None else Task.objects.filter(response_id=response_id)
    if reader.only_task_id is not None:
        qs = qs.filter(pk=reader.only_task_id)
    if reader.client is not None and not _sees_all(reader.client):
        qs = qs.filter(client=reader.client)
    task = qs.only("id", "status", "last_sequence", "response_id").first()
    if task is None:
        if task_id is not None:
            raise TaskNotFound(f"No task with id {task_id!r}")
        raise ResponseNotFound(f"No response with id {response_id!r}")
    return task


def task_stream_task(*, task_id: str) -> Task:
    """A task known to exist and be visible (an idempotency key's own task)."""
    return Task.objects.only("id", "status", "last_sequence", "response_id").get(pk=task_id)


@dataclass(frozen=True)
class StreamStart:
    """Where a stream starts: after ``after``; ``finished`` when nothing is left to send."""

    after: int
    finished: bool = False


def task_stream_start(*, task: Task, after: int | None, cursor_field: str = "starting_after") -> StreamStart:
    """Check a stream cursor against the task's log (PROFILE.md section 4).

    ``after`` None means from the start (``response.created``). A cursor past
    the newest event is a client error; one before the oldest retained event
    is ``410 event_history_expired``; one at the terminal event means the
    client has everything (the view answers 204, so browsers stop).
    """
    cursor = -1 if after is None else after
    if cursor > task.last_sequence:
        raise InvalidRequest(
            f"{cursor_field} {cursor} is past the newest event of this task ({task.last_sequence})",
            errors=[{"field": cursor_field, "message": f"must be at most {task.last_sequence}"}],
        )
    if task.is_terminal and cursor == task.last_sequence:
        return StreamStart(after=cursor, finished=True)
    oldest = (
        TaskEvent.objects.filter(task_id=task.pk)
        .order_by("sequence_number")
        .values_list("sequence_number", flat=True)
        .first()
    )
    if oldest is None or cursor + 1 < oldest:
        raise EventHistoryExpired(
            f"Events of task {task.pk} before {oldest if oldest is not None else task.last_sequence + 1} "
            "are no longer kept; read the task or response object instead"
        )
    return StreamStart(after=cursor)


@dataclass(frozen=True)
class Page:
    items: list
    has_more: bool


def task_list_visible(*, client: Client, statuses: list[str] | None, after: str | None, limit: int) -> Page:
    """Newest first; ``after`` is the id of the last task of the previous page."""
    qs: QuerySet[Task] = Task.objects.all()
    if not _sees_all(client):
        qs = qs.filter(client=client)
    if statuses:
        qs = qs.filter(status_in(statuses))
    if after:
        # Ids are ULIDs: id order is creation order.
        qs = qs.filter(id__lt=after)
    rows = list(qs.order_by("-id")[: limit + 1])
    items = rows[:limit]
    _attach_succeeded_responses(items)
    return Page(items=items, has_more=len(rows) > limit)


def _attach_succeeded_responses(tasks: list[Task]) -> None:
    """Load, in one query, the responses the task objects show (only succeeded
    tasks show theirs); the others' prompts and outputs stay in the database."""
    wanted = {task.response_id: task for task in tasks if task.status == TaskStatus.SUCCEEDED}
    if wanted:
        for response in Response.objects.filter(pk__in=wanted):
            wanted[response.pk].response = response


def _name_candidates(name: str) -> list[str]:
    # `name` and `name:latest` are the same model, as in Ollama.
    if name.endswith(":latest"):
        return [name, name[: -len(":latest")]]
    if ":" not in name:
        return [name, f"{name}:latest"]
    return [name]


def model_find_by_name(name: str) -> ModelRecord | None:
    """The registered model ``name`` (``name`` and ``name:latest`` are one), or None."""
    rows = {m.name: m for m in ModelRecord.objects.filter(name__in=_name_candidates(name))}
    return next((rows[candidate] for candidate in _name_candidates(name) if candidate in rows), None)


def model_get_by_name(name: str) -> ModelRecord:
    """The registered model ``name``; ``ModelNotFound`` (a 400 naming the request's ``model``) otherwise."""
    model = model_find_by_name(name)
    if model is not None:
        return model
    raise ModelNotFound(
        f"Model {name!r} is not registered",
        errors=[{"field": "model", "message": f"unknown model {name!r}"}],
    )


def model_get(*, model_id: str) -> ModelRecord:
    """The model ``GET /models/{id}`` names (``name:latest`` is ``name``); ``ModelNotRegistered`` (a 404) otherwise."""
    model = model_find_by_name(model_id)
    if model is None:
        raise ModelNotRegistered(f"Model {model_id!r} is not registered")
    return model


def model_list(*, after: str | None, limit: int) -> Page:
    """Models newest first; ``after`` is the name of the last model of the previous page."""
    qs = ModelRecord.objects.order_by("-created_at", "-id")
    if after:
        anchor = ModelRecord.objects.filter(name=after).values_list("created_at", "id").first()
        if anchor is None:
            return Page(items=[], has_more=False)
        created_at, pk = anchor
        qs = qs.filter(Q(created_at__lt=created_at) | Q(created_at=created_at, id__lt=pk))
    rows = list(qs[: limit + 1])
    return Page(items=rows[:limit], has_more=len(rows) > limit)


@dataclass(frozen=True)
class StoredSnapshot:
    """A running task's snapshot rows put back together (see ``TaskSnapshot``)."""

    first_state: dict[str, Any]
    last_state: dict[str, Any]
    token_ids: list[int]
    sequence_number: int
    rows: int
    raw_text: str = ""
    """A run that may call tools: the model's own text as its rows hold it (``raw`` of each)."""


def task_snapshot_get(*, task_id: str) -> StoredSnapshot | None:
    """The task's snapshot as of its newest row, or None when it has none."""
    rows = list(
        TaskSnapshot.objects.filter(task_id=task_id).order_by("id").values_list("token_ids", "state", "sequence_number")
    )
    if not rows:
        return None
    return StoredSnapshot(
        first_state=rows[0][1],
        last_state=rows[-1][1],
        token_ids=[token for ids, _, _ in rows for token in ids],
        sequence_number=rows[-1][2],
        rows=len(rows),
        raw_text="".join(state.get("raw", "") for _, state, _ in rows),
    )


def task_run_spec(*, task_id: str) -> GenerationSpec:
    """The generation spec that a worker runs for the task."""
    response = Response.objects.only("id", "generation").get(task__id=task_id)
    return GenerationSpec.from_json(response.generation)


def task_outcome_get(*, task_id: str) -> dict[str, Any] | None:
    """What became of a task, for a log line: its status, policy, worker and error (None: no such task)."""
    return Task.objects.filter(pk=task_id).values("status", "on_restart", "worker", "error").first()


def task_output_text(*, task_id: str) -> tuple[str | None, str]:
    """The id of the current attempt's output message and the text its committed deltas hold.

    The event log is what clients saw, so this is what a task that stops
    early keeps as its output, and what a resumed generation continues.
    (A run that may call tools has several items: :func:`task_output_items`.)
    """
    items = task_outputs_items(task_ids=[task_id]).get(task_id, [])
    message = next((item for item in items if item.type == output_items.MESSAGE), None)
    return (message.id, message.text) if message is not None else (None, "")


def task_outputs_text(*, task_ids: Sequence[str]) -> dict[str, tuple[str, str]]:
    """:func:`task_output_text` of many tasks: ``{task id: (item id, text)}``."""
    found = {}
    for task_id, items in task_outputs_items(task_ids=task_ids).items():
        message = next((item for item in items if item.type == output_items.MESSAGE), None)
        if message is not None:
            found[task_id] = (message.id, message.text)
    return found


# --------------------------------------------------------------------------- #
# The admin's reads
# --------------------------------------------------------------------------- #


def _held_by(workers: Sequence[str]) -> QuerySet[Task]:
    """Tasks held by these worker processes: read through the partial index ``task_active``, never the history."""
    return Task.objects.filter(status_in(states.HELD), worker__in=workers).order_by("id")


def task_batch_peers(*, task: Task) -> list[Task]:
    """The other tasks in ``task``'s batch, oldest first: held by its worker process, for its model.

    A worker process runs one batch engine per model, so tasks held with the
    same ``worker`` (``<node>/<pid>``) and model step together. One query;
    the task's response must be loaded (for its model). A task no worker
    holds shares nothing.
    """
    if task.status not in states.HELD or not task.worker:
        return []
    peers = _held_by([task.worker]).filter(response__model=task.response.model).exclude(pk=task.pk)
    return list(peers.only("id", "status", "worker"))


def task_batch_peer_ids(*, tasks: Sequence[Task]) -> dict[str, list[str]]:
    """:func:`task_batch_peers` of a page of tasks in one query (none when no task is held): ``{task id: peer ids}``.

    Only held tasks are keys; their responses must be loaded.
    """
    held = [task for task in tasks if task.status in states.HELD and task.worker]
    if not held:
        return {}
    batches: dict[tuple[str, str], list[str]] = {}
    rows = _held_by(sorted({task.worker for task in held})).values_list("id", "worker", "response__model")
    for task_id, worker, model in rows:
        batches.setdefault((worker, model), []).append(task_id)
    return {
        task.pk: [peer for peer in batches.get((task.worker, task.response.model), []) if peer != task.pk]
        for task in held
    }


def model_names() -> list[str]:
    """Registered model names, for the admin's model filters (the models table is small;
    a DISTINCT over tasks or responses would read all of them)."""
    return list(ModelRecord.objects.order_by("name").values_list("name", flat=True))


def response_output_text(*, response: Response) -> str:
    """The text of a response's output items (and its calls, ``output_items.shown_text``), as the admin shows it."""
    return output_items.shown_text(response.output)


def task_output_text_until(*, task_id: str, last_sequence: int) -> str:
    """The current attempt's committed output as of event ``last_sequence``, as the admin's page shows it
    (``output_items.shown_text``: the text, and any calls).

    Bounded by the cursor, so a page that shows this text and then follows
    the stream from ``last_sequence`` neither repeats nor skips a delta, even
    while the worker keeps committing.
    """
    opened = (
        TaskEvent.objects.filter(
            task_id=task_id,
            type=EventType.OUTPUT_ITEM_ADDED,
            sequence_number__gt=F("task__attempt_after"),
            sequence_number__lte=last_sequence,
        )
        .order_by("sequence_number")
        .values_list("sequence_number", flat=True)
        .first()
    )
    if opened is None:
        return ""
    rows = TaskEvent.objects.filter(
        task_id=task_id,
        type__in=output_items.FOLDED,
        sequence_number__gte=opened,
        sequence_number__lte=last_sequence,
    ).order_by("sequence_number")
    items = output_items.fold(rows.values_list("payload", flat=True).iterator())
    return output_items.shown_text([item.wire("in_progress") for item in items])


@dataclass(frozen=True)
class TaskAdminDetail:
    """What the admin's task page shows beside the row itself.

    ``text`` is the output as of event ``cursor`` (the task's ``last_sequence``
    when it was read); the page's live pane follows the stream after it.
    """

    text: str
    cursor: int
    lifecycle_events: list[TaskEvent]
    """The newest events other than output deltas (``task_lifecycle_events``)."""
    snapshot: StoredSnapshot | None


def task_admin_detail(*, task: Task, events: int = 20) -> TaskAdminDetail:
    """Output text, newest lifecycle events and snapshot of a task whose row (with its response) is loaded."""
    cursor = task.last_sequence
    if task.is_terminal:
        # A finished task's response holds its final text, also after its events expired.
        text = response_output_text(response=task.response)
    else:
        text = task_output_text_until(task_id=task.pk, last_sequence=cursor)
    return TaskAdminDetail(
        text=text,
        cursor=cursor,
        lifecycle_events=task_lifecycle_events(task_id=task.pk, last_sequence=cursor, limit=events),
        snapshot=task_snapshot_get(task_id=task.pk),
    )


# --------------------------------------------------------------------------- #
# The admin's task page: attempts, timings, lifecycle events
# --------------------------------------------------------------------------- #

# Events that carry a piece of output: the task page lists the others (the lifecycle) apart from them.
DELTA_EVENT_TYPES = (EventType.OUTPUT_TEXT_DELTA, EventType.FUNCTION_CALL_ARGUMENTS_DELTA)


@dataclass(frozen=True)
class AttemptRead:
    """One attempt as the admin shows it: a row of the attempt log, or the open attempt on the task row."""

    number: int
    worker: str
    started_at: datetime
    first_token_at: datetime | None
    ended_at: datetime | None
    end: str
    """``AttemptEnd``'s label, or "running" for the open attempt."""
    reason: str
    output_tokens: int

    @property
    def first_token_ms(self) -> float | None:
        """From its claim to its first output."""
        return _ms(self.started_at, self.first_token_at)

    @property
    def duration_ms(self) -> float | None:
        return _ms(self.started_at, self.ended_at)

    @property
    def tokens_per_second(self) -> float | None:
        """Its output tokens over the time from its first output to its end."""
        seconds = (_ms(self.first_token_at, self.ended_at) or 0) / 1000
        return self.output_tokens / seconds if seconds > 0 and self.output_tokens > 1 else None


def _ms(start: datetime | None, end: datetime | None) -> float | None:
    return None if start is None or end is None else (end - start).total_seconds() * 1000


def task_attempts(*, task: Task) -> list[AttemptRead]:
    """Every attempt of ``task``, oldest first: the ended ones (one query) and the open one from its row."""
    rows = [
        AttemptRead(
            row.number,
            row.worker,
            row.started_at,
            row.first_token_at,
            row.ended_at,
            row.get_end_display(),
            row.reason,
            row.output_tokens,
        )
        for row in TaskAttempt.objects.filter(task_id=task.pk).order_by("number")
    ]
    if task.status in states.HELD and task.attempt_started_at is not None:
        rows.append(
            AttemptRead(
                task.attempts,
                task.worker,
                task.attempt_started_at,
                task.first_token_at,
                None,
                "running" if task.status != TaskStatus.CANCELLING else "cancelling",
                "",
                task.output_tokens,
            )
        )
    return rows


@dataclass(frozen=True)
class TaskTimings:
    """A task's times as its client felt them, from its creation (milliseconds; None: not yet)."""

    queue_wait_ms: float | None
    """To its first claim."""
    first_token_ms: float | None
    """To the first output of the attempt that answered (or runs now)."""
    generation_ms: float | None
    """From that first output to the end."""
    duration_ms: float | None
    """To its terminal status."""
    tokens_per_second: float | None


def task_timings(*, task: Task, attempts: Sequence[AttemptRead]) -> TaskTimings:
    last = attempts[-1] if attempts else None
    first_token = last.first_token_at if last is not None else None
    generation = _ms(first_token, task.finished_at)
    tokens = task.output_tokens
    return TaskTimings(
        queue_wait_ms=_ms(task.created_at, attempts[0].started_at) if attempts else None,
        first_token_ms=_ms(task.created_at, first_token),
        generation_ms=generation,
        duration_ms=_ms(task.created_at, task.finished_at),
        tokens_per_second=tokens / (generation / 1000) if generation and tokens > 1 else None,
    )


def task_lifecycle_events(*, task_id: str, last_sequence: int, limit: int) -> list[TaskEvent]:
    """The newest ``limit`` events up to ``last_sequence`` that are not output deltas, oldest first."""
    rows = list(
        TaskEvent.objects.filter(task_id=task_id, sequence_number__lte=last_sequence)
        .exclude(type__in=DELTA_EVENT_TYPES)
        .order_by("-sequence_number")[:limit]
    )
    rows.reverse()
    return rows


def task_heartbeat_age_seconds(*, task: Task, now: datetime | None = None) -> float | None:
    """How long ago its worker wrote the heartbeat ``task`` was read with (None: no heartbeat).

    On this process's clock: on PostgreSQL heartbeats carry the database's, which NTP keeps
    within milliseconds of the web's on a normal install (an age is shown to a tenth of a second).
    """
    if task.heartbeat_at is None:
        return None
    return max(0.0, ((now or timezone.now()) - task.heartbeat_at).total_seconds())
