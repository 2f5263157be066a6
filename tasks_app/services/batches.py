"""Batches (OpenAI's Batch API, PROFILE.md 12.2; docs/batches.md): create, cancel, and the keeper that runs them.

``batch_create`` stores a batch and one row per line of its input file, as
translated by the adapter (``tasks_app.openai.batches.lines``): a file with a
bad line fails validation as a whole, as OpenAI's does; a line whose request
the adapter refused is a failed line of the error file.

A line becomes a task only when the keeper (``batches_advance``) sends it,
oldest batch first, while the engines have free rows (``_room``: the online
workers' rows less one each, kept for interactive requests, less the tasks
queued or running; or a fixed ``LMSP_BATCH_ACTIVE_LINES``), so batches fill
the engine's rows that interactive requests leave free and a 10,000-line
batch is 10,000 rows, not 10,000 messages (docs/decisions/0017-batches.md). Each round the keeper also writes
the ended lines' results (``services/batch_output``), winds a cancelled or
expired batch down, and ends a batch whose every line is written, with its
webhook event, in one transaction.
"""

from __future__ import annotations

import logging
import secrets
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from django.conf import settings
from django.db import DatabaseError, close_old_connections, transaction
from django.db.models import Q
from django.utils import timezone

from tasks_app import states
from tasks_app.core import lifecycle
from tasks_app.core.batch_log import batch_line_sent, batch_lines_end
from tasks_app.core.webhook_outbox import BatchEnd, webhook_deliveries_enqueue
from tasks_app.exceptions import BatchNotCancelable, LmspError
from tasks_app.ids import new_batch_id
from tasks_app.models import Batch, BatchLine, BatchLineOutcome, BatchLineState, BatchStatus, Client, File, Task
from tasks_app.models.batches import BATCH_ACTIVE, BATCH_CANCEL_UNDER_WAY, BATCH_CANCELABLE
from tasks_app.plumbing.channel_wakeups import ChannelWakeups
from tasks_app.plumbing.notify import batches_channel
from tasks_app.plumbing.querying import status_in
from tasks_app.selectors.tasks import model_get_by_name
from tasks_app.selectors.workers import worker_rows_online
from tasks_app.services.batch_output import ERRORS, OUTPUT, LeaseLost, LineRender, batch_files_write
from tasks_app.services.dispatch import task_dispatch_on_commit
from tasks_app.services.files import file_output_create, file_staging_sweep
from tasks_app.services.tasks import task_cancel
from tasks_app.states import RestartPolicy

logger = logging.getLogger(__name__)

B = BatchStatus
COMPLETION_WINDOWS = {"24h": timedelta(hours=24)}
# How long a keeper holds a batch: far longer than one round, so that only a dead keeper loses it.
LEASE_SECONDS = 60
INSERT_PAGE = 1000
# Lines at once while no worker reports its rows (LMSP_WORKER_REPORT_SECONDS 0, or none started yet).
_UNREPORTED_WINDOW = 8
# The statuses a batch ends in, from the status it ends from, with the webhook event of each.
_ENDS = {B.IN_PROGRESS: B.COMPLETED, B.CANCELLING: B.CANCELLED, B.FINALIZING: B.EXPIRED}
_END_COLUMN = {B.COMPLETED: "completed_at", B.CANCELLED: "cancelled_at", B.EXPIRED: "expired_at"}


@dataclass(frozen=True)
class LineIn:
    """A line of an input file as the adapter translated it: a request to run, or the problem refusing it."""

    line: int
    custom_id: str
    request: Mapping[str, Any]
    generation: Mapping[str, Any] | None = None
    error: Mapping[str, Any] | None = None


def batch_create(
    *,
    client: Client,
    input_file: File,
    endpoint: str,
    completion_window: str,
    metadata: Mapping[str, str],
    lines: Sequence[LineIn],
    errors: Sequence[Mapping[str, Any]],
) -> Batch:
    """A batch of ``lines`` (``in_progress``), or (``errors``: the file did not validate) a ``failed`` one.

    The batch, its lines and (failed) its webhook event commit together.
    """
    now = timezone.now()
    models = sorted({str(line.request.get("model")) for line in lines if line.generation is not None})
    batch = Batch(
        id=new_batch_id(),
        client=client,
        endpoint=endpoint,
        input_file_id=input_file.id,
        completion_window=completion_window,
        metadata=dict(metadata),
        model=models[0] if len(models) == 1 else "",
        created_at=now,
        expires_at=now + COMPLETION_WINDOWS[completion_window],
    )
    with transaction.atomic():
        if errors:
            batch.status, batch.failed_at = B.FAILED, now
            batch.errors = {"object": "list", "data": [dict(error) for error in errors]}
            batch.save(force_insert=True)
            webhook_deliveries_enqueue(ends=[BatchEnd(batch.id, client.pk, "batch.failed")], now=now)
            return batch
        refused = sum(1 for line in lines if line.generation is None)
        batch.status, batch.in_progress_at = B.IN_PROGRESS, now
        batch.total, batch.failed = len(lines), refused
        batch.save(force_insert=True)
        rows = (
            BatchLine(
                batch=batch,
                line=line.line,
                custom_id=line.custom_id,
                request=dict(line.request),
                generation=dict(line.generation) if line.generation is not None else None,
                error=dict(line.error) if line.error is not None else None,
                state=BatchLineState.PENDING if line.generation is not None else BatchLineState.ENDED,
                outcome="" if line.generation is not None else BatchLineOutcome.FAILED,
            )
            for line in lines
        )
        BatchLine.objects.bulk_create(rows, batch_size=INSERT_PAGE)
    batch_keeper_wake()
    return batch


def batch_cancel(*, batch: Batch) -> Batch:
    """``cancelling`` at once; the keeper ends the lines not sent, cancels the queued ones, lets the running ones
    finish (as OpenAI does), then ``cancelled``. An ended batch refuses (``BatchNotCancelable``)."""
    if batch.status in BATCH_CANCEL_UNDER_WAY:
        return batch
    now = timezone.now()
    moved = Batch.objects.filter(pk=batch.pk, status__in=list(BATCH_CANCELABLE)).update(
        status=B.CANCELLING, cancelling_at=now
    )
    batch.refresh_from_db()
    if not moved and batch.status not in BATCH_CANCEL_UNDER_WAY:
        raise BatchNotCancelable(f"batch {batch.id} already {batch.status}")
    batch_keeper_wake()
    return batch


# --------------------------------------------------------------------------- #
# The keeper: one round over the unfinished batches
# --------------------------------------------------------------------------- #


def batches_advance(*, render: LineRender) -> int:
    """One round of the keeper over every unfinished batch, oldest first; returns the lines it wrote or sent.

    Batches another keeper holds (its lease in force) are left to it.
    """
    ids = list(
        Batch.objects.filter(status__in=[str(s) for s in BATCH_ACTIVE]).order_by("id").values_list("id", flat=True)
    )
    if not ids:
        return 0
    room = _room(BatchLine.objects.filter(batch_id__in=ids, state=BatchLineState.SENT).count())
    done = 0
    for batch_id in ids:
        token = _lease(batch_id)
        if token is None:
            continue
        try:
            moved, fed = _batch_advance(batch_id, token, render, room)
            room -= fed
            done += moved + fed
        except LeaseLost:
            logger.warning("batch %s: another keeper took it over", batch_id)
        finally:
            Batch.objects.filter(pk=batch_id, lease_token=token).update(lease_token="", lease_expires_at=None)
    return done


def _room(sent: int) -> int:
    """How many more lines may become tasks now, ``sent`` being the lines that are tasks not yet ended.

    A fixed ``LMSP_BATCH_ACTIVE_LINES`` bounds the lines alone. Otherwise the lines take the engines' free
    rows: the online workers' rows less one each, which an interactive request then always finds free (its
    first token waits for the step under way, not for a line to end), less every task queued or running
    (the lines' own included). A single row still runs one line at a time, so a batch always moves.
    """
    if settings.LMSP_BATCH_ACTIVE_LINES:
        return max(0, settings.LMSP_BATCH_ACTIVE_LINES - sent)
    rows, workers = worker_rows_online()
    if not workers:
        return max(0, _UNREPORTED_WINDOW - sent)
    active = Task.objects.filter(status_in(states.ACTIVE)).count()
    return max(0, max(1, rows - workers) - active, 1 - sent)


def _lease(batch_id: str) -> str | None:
    now = timezone.now()
    token = secrets.token_hex(16)
    free = Q(lease_expires_at__isnull=True) | Q(lease_expires_at__lt=now)
    until = now + timedelta(seconds=LEASE_SECONDS)
    taken = Batch.objects.filter(free, pk=batch_id).update(lease_token=token, lease_expires_at=until)
    return token if taken else None


def _batch_advance(batch_id: str, token: str, render: LineRender, room: int) -> tuple[int, int]:
    batch = Batch.objects.get(pk=batch_id)
    now = timezone.now()
    if batch.status == B.VALIDATING:
        # Made by an earlier release's create that died before it stored the lines: nothing to run.
        Batch.objects.filter(pk=batch_id, status=B.VALIDATING).update(status=B.IN_PROGRESS, in_progress_at=now)
        batch.refresh_from_db()
    if batch.status == B.IN_PROGRESS and now >= batch.expires_at:
        # The window ended: what has not finished is cancelled; "finalizing" until the last line is written.
        Batch.objects.filter(pk=batch_id, status=B.IN_PROGRESS).update(status=B.FINALIZING, finalizing_at=now)
        batch.refresh_from_db()
    if batch.status in (B.CANCELLING, B.FINALIZING):
        _wind_down(batch)
    moved = batch_files_write(batch_id=batch_id, lease_token=token, render=render)
    fed = _feed(batch, room) if batch.status == B.IN_PROGRESS and room > 0 else 0
    _end_if_done(batch_id, token)
    return moved, fed


def _wind_down(batch: Batch) -> None:
    """End the lines not sent; cancel the sent ones still queued (a cancel) or all of them (the window's end)."""
    outcome = BatchLineOutcome.CANCELLED if batch.status == B.CANCELLING else BatchLineOutcome.EXPIRED
    while pending := list(
        BatchLine.objects.filter(batch_id=batch.id, state=BatchLineState.PENDING).values_list("pk", flat=True)[
            :INSERT_PAGE
        ]
    ):
        with transaction.atomic():
            batch_lines_end(batch_id=batch.id, line_ids=pending, outcome=outcome)
    sent = BatchLine.objects.filter(batch_id=batch.id, state=BatchLineState.SENT).values_list("task_id", flat=True)
    stoppable = states.CANCELABLE_AT_ONCE if outcome == BatchLineOutcome.CANCELLED else states.ACTIVE
    for task in Task.objects.filter(pk__in=list(sent), status__in=list(stoppable)):
        if task.status in states.CANCEL_UNDER_WAY:
            continue
        try:
            task_cancel(task=task)
        except LmspError as error:
            logger.info("batch %s: task %s not cancelled: %s", batch.id, task.pk, error)


def _feed(batch: Batch, room: int) -> int:
    """Send up to ``room`` pending lines of ``batch`` as tasks, in line order; returns how many were sent."""
    sent = 0
    for line in BatchLine.objects.filter(batch_id=batch.id, state=BatchLineState.PENDING).order_by("line")[:room]:
        try:
            model = model_get_by_name(str(line.request.get("model")))
        except LmspError as error:
            # The model went away after the batch was accepted: this line fails, the others go on.
            with transaction.atomic():
                batch_lines_end(
                    batch_id=batch.id, line_ids=[line.pk], outcome=BatchLineOutcome.FAILED, error=error.to_problem()
                )
            continue
        # A line is run once to its end: resumed from its snapshot, or started over, never failed by a restart.
        policy = RestartPolicy.RESUME if model.resumable else RestartPolicy.RETRY
        with transaction.atomic():
            task = lifecycle.task_insert(
                client=batch.client,
                request={**line.request, "model": model.name},
                generation={**(line.generation or {}), "model": model.name},
                model=model.name,
                on_restart=policy,
                metadata=line.request.get("metadata") or {},
                batch_id=batch.id,
            )
            if not batch_line_sent(line_id=line.pk, task_id=task.id):
                # Another keeper sent it meanwhile: this task must not exist either.
                transaction.set_rollback(True)
                continue
            task_dispatch_on_commit(task_id=task.id)
            sent += 1
    return sent


def _end_if_done(batch_id: str, token: str) -> None:
    """End the batch once every line has ended and is written: its files, its status and its event, together."""
    batch = Batch.objects.get(pk=batch_id)
    final = _ENDS.get(B(batch.status))
    ended = batch.completed + batch.failed == batch.total
    if final is None or not ended or batch.output_lines + batch.error_lines != batch.total:
        return
    now = timezone.now()
    with transaction.atomic():
        columns: dict[str, Any] = {"status": final, _END_COLUMN[final]: now}
        if final == B.COMPLETED:
            columns["finalizing_at"] = now
        for target, column in ((OUTPUT, "output_file_id"), (ERRORS, "error_file_id")):
            if getattr(batch, target.lines_column):
                file = file_output_create(
                    client_id=batch.client_id, batch_id=batch.id, name=target.name, path=target.relative(batch.id)
                )
                columns[column] = file.id
        if not Batch.objects.filter(pk=batch_id, lease_token=token, status=batch.status).update(**columns):
            raise LeaseLost(batch_id)
        webhook_deliveries_enqueue(ends=[BatchEnd(batch.id, batch.client_id, f"batch.{final}")], now=now)


# --------------------------------------------------------------------------- #
# The keeper's thread (one per web process; docs/batches.md)
# --------------------------------------------------------------------------- #

_wake = threading.Event()
# How long a woken keeper waits for the rest of a burst of line ends before its round.
_COALESCE_SECONDS = 0.05
# Staging files a killed upload left are swept this often.
_SWEEP_STAGING_EVERY_S = 3600.0


def batch_keeper_wake() -> None:
    """Run the keeper's next round now (a batch was created or cancelled in this process)."""
    transaction.on_commit(_wake.set)


def batch_keeper_run(*, render: LineRender, stop: threading.Event, poll_seconds: float | None = None) -> None:
    """Advance the unfinished batches every ``LMSP_BATCH_POLL_SECONDS`` until ``stop`` is set.

    A database that is away costs a round, never the thread.
    """
    poll = settings.LMSP_BATCH_POLL_SECONDS if poll_seconds is None else poll_seconds
    # A line's end (published after its terminal commit, in any worker) wakes the round at once: the freed row
    # is filled and the result written then, not a poll later (issue 45: a poll's wait was most of a line's
    # time on a fast model). The poll stays, for the window's end and for a Redis that is away.
    ChannelWakeups(
        channel=batches_channel(),
        poke=_wake.set,
        stop=stop,
        name="lmsp-batch-wakeups",
        what="batch keeper",
        poll_seconds=poll,
    )
    swept_at = 0.0
    while not stop.is_set():
        close_old_connections()
        try:
            batches_advance(render=render)
            if (now := timezone.now().timestamp()) - swept_at > _SWEEP_STAGING_EVERY_S:
                file_staging_sweep()
                swept_at = now
        except DatabaseError as error:
            logger.warning("batch keeper: the database is unavailable (%s); next round in %.1f s", error, poll)
        except Exception:
            logger.exception("batch keeper: a round failed")
        if _wake.wait(poll):
            # Lines end in bursts (a batch's rows started together): a moment's wait lets one round serve a
            # burst, instead of a round for each end competing with the engine for the host's cores.
            stop.wait(_COALESCE_SECONDS)
        _wake.clear()
