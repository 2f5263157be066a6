"""A batch's output and error files, written as its lines end, resumably (docs/batches.md).

The lines whose task ended (``core/batch_log`` marks them in the task's
terminal transaction) and whose result is not in a file yet are appended to
the output file (succeeded) or the error file (the rest), the file is
fsynced, and only then does one transaction mark those lines written and
record each file's new length on the batch row. So the database never vouches
for bytes that are not on disk, and a crash between the two leaves bytes past
the recorded length: the next writer (``_reconcile``) keeps the complete lines
there and records them, cuts a partial last line off, and never writes a
line twice. One process writes a batch's files at a time: the caller holds
the batch's lease, and every record is fenced on it.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from django.db import transaction
from django.db.models import F

from tasks_app.core.wire import response_object
from tasks_app.exceptions import with_sdk_error
from tasks_app.ids import BATCH_REQUEST_PREFIX, new_ulid
from tasks_app.models import Batch, BatchLine, BatchLineOutcome, BatchLineState, Task
from tasks_app.services.files import files_dir

logger = logging.getLogger(__name__)

# The lines written per round trip: one append and one transaction each.
PAGE = 500
# A succeeded line's body in the protocol of the batch's endpoint: (endpoint, response object) -> body.
LineRender = Callable[[str, Mapping[str, Any]], Mapping[str, Any]]


class LeaseLost(Exception):
    """Another process took the batch over (this one's lease expired): it stops writing."""


@dataclass(frozen=True)
class Target:
    """One of a batch's two files, and the columns of the batch row that record how much of it is durable."""

    name: str
    bytes_column: str
    lines_column: str

    def path(self, batch_id: str) -> Path:
        return files_dir() / self.relative(batch_id)

    def relative(self, batch_id: str) -> str:
        return f"{batch_id}-{self.name}.jsonl"


OUTPUT = Target("output", "output_bytes", "output_lines")
ERRORS = Target("errors", "error_bytes", "error_lines")


def batch_files_write(*, batch_id: str, lease_token: str, render: LineRender) -> int:
    """Write every ended line of the batch not yet written; returns how many. The caller holds the lease."""
    for target in (OUTPUT, ERRORS):
        _reconcile(batch_id, target, lease_token)
    written = 0
    while True:
        batch = Batch.objects.get(pk=batch_id)
        lines = list(
            BatchLine.objects.filter(batch_id=batch_id, state=BatchLineState.ENDED, written=False).order_by("line")[
                :PAGE
            ]
        )
        if not lines:
            return written
        texts = _line_texts(batch, lines, render)
        columns: dict[str, Any] = {}
        for target, parts in texts.items():
            if parts:
                columns[target.bytes_column] = _append(target.path(batch_id), b"".join(parts))
                columns[target.lines_column] = F(target.lines_column) + len(parts)
        with transaction.atomic():
            BatchLine.objects.filter(pk__in=[line.pk for line in lines]).update(written=True)
            if not Batch.objects.filter(pk=batch_id, lease_token=lease_token).update(**columns):
                raise LeaseLost(batch_id)
        written += len(lines)


def _append(path: Path, data: bytes) -> int:
    """Append ``data`` durably; returns the file's new length."""
    created = not path.exists()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        os.fsync(fd)
        size = os.fstat(fd).st_size
    finally:
        os.close(fd)
    if created:
        _fsync_directory(path.parent)
    return size


def _fsync_directory(directory: Path) -> None:
    # A new file's name is durable only once its directory is.
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _reconcile(batch_id: str, target: Target, lease_token: str) -> None:
    """Make the file agree with the batch row: complete lines past the recorded length recorded, a partial
    one cut off; lines that are not ended-and-unwritten (never the case but after damage) cut off too."""
    path = target.path(batch_id)
    recorded = Batch.objects.filter(pk=batch_id).values_list(target.bytes_column, flat=True).get()
    size = path.stat().st_size if path.exists() else 0
    if size == recorded:
        return
    if size < recorded:
        logger.error(
            "batch %s: its %s file is %d bytes, shorter than the %d recorded", batch_id, target.name, size, recorded
        )
        return
    with path.open("rb") as handle:
        handle.seek(recorded)
        tail = handle.read()
    complete = tail[: tail.rfind(b"\n") + 1]
    custom_ids = [_custom_id(raw) for raw in complete.splitlines()]
    unwritten = set(
        BatchLine.objects.filter(
            batch_id=batch_id, state=BatchLineState.ENDED, written=False, custom_id__in=[c for c in custom_ids if c]
        ).values_list("custom_id", flat=True)
    )
    if None in custom_ids or len(set(custom_ids)) != len(custom_ids) or not set(custom_ids) <= unwritten:
        complete = b""
        custom_ids = []
    keep = recorded + len(complete)
    if keep < size:
        with path.open("r+b") as handle:
            handle.truncate(keep)
            handle.flush()
            os.fsync(handle.fileno())
        logger.warning(
            "batch %s: cut %d bytes off its %s file (a write a crash left)", batch_id, size - keep, target.name
        )
    if custom_ids:
        with transaction.atomic():
            BatchLine.objects.filter(batch_id=batch_id, custom_id__in=custom_ids).update(written=True)
            columns = {target.bytes_column: keep, target.lines_column: F(target.lines_column) + len(custom_ids)}
            if not Batch.objects.filter(pk=batch_id, lease_token=lease_token).update(**columns):
                raise LeaseLost(batch_id)
        logger.info(
            "batch %s: kept %d line(s) a crash left unrecorded in its %s file", batch_id, len(custom_ids), target.name
        )


def _custom_id(raw: bytes) -> str | None:
    try:
        value = json.loads(raw)
    except ValueError:
        return None
    custom_id = value.get("custom_id") if isinstance(value, dict) else None
    return custom_id if isinstance(custom_id, str) else None


def _line_texts(batch: Batch, lines: list[BatchLine], render: LineRender) -> dict[Target, list[bytes]]:
    tasks = Task.objects.select_related("response").in_bulk([line.task_id for line in lines if line.task_id])
    texts: dict[Target, list[bytes]] = {OUTPUT: [], ERRORS: []}
    for line in lines:
        target, record = _line_record(batch, line, tasks.get(line.task_id), render)
        text = json.dumps({"id": BATCH_REQUEST_PREFIX + new_ulid(), "custom_id": line.custom_id, **record})
        texts[target].append(text.encode() + b"\n")
    return texts


def _line_record(batch: Batch, line: BatchLine, task: Task | None, render: LineRender) -> tuple[Target, dict]:
    """Where a line's result goes, and its ``response`` and ``error`` members (OpenAI's output line)."""
    if line.outcome in (BatchLineOutcome.CANCELLED, BatchLineOutcome.EXPIRED):
        code = "batch_cancelled" if line.outcome == BatchLineOutcome.CANCELLED else "batch_expired"
        message = (
            "the batch was cancelled before this request finished"
            if code == "batch_cancelled"
            else "the batch's completion window ended before this request finished"
        )
        return ERRORS, {"response": None, "error": {"code": code, "message": message}}
    response = task.response if task is not None else None
    if line.outcome == BatchLineOutcome.COMPLETED and response is not None:
        body = render(batch.endpoint, response_object(response))
        return OUTPUT, {"response": {"status_code": 200, "request_id": response.id, "body": body}, "error": None}
    problem = dict(
        line.error or (response.error if response is not None else None) or (task.error if task else None) or {}
    )
    problem.setdefault("status", 500)
    problem.setdefault("code", "internal_error")
    problem.setdefault("detail", "the request failed")
    body = {"error": with_sdk_error(problem)["error"]}
    request_id = response.id if response is not None else None
    return ERRORS, {
        "response": {"status_code": problem["status"], "request_id": request_id, "body": body},
        "error": None,
    }
