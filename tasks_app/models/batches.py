"""Batches (OpenAI's Batch API, PROFILE.md 12.2): a batch, and one row per line of its input file.

The counts OpenAI shows (``request_counts``) are columns of the batch row,
changed in the transaction that ends each line's task (``core/batch_log``), so
a read is one row. A line becomes a task only when the feeder sends it
(``services/batches``): a 10,000-line file is 10,000 small rows at once, and
at most ``LMSP_BATCH_ACTIVE_LINES`` tasks at a time (docs/decisions/0017-batches.md).
"""

from __future__ import annotations

from django.db import models
from django.db.models import F, Q

from tasks_app.fields import JSONTextField
from tasks_app.models.clients import Client


class BatchStatus(models.TextChoices):
    VALIDATING = "validating", "validating"
    FAILED = "failed", "failed"
    """Its input file did not validate: ``errors`` says where."""
    IN_PROGRESS = "in_progress", "in_progress"
    FINALIZING = "finalizing", "finalizing"
    """Every line has ended (or the window did): the last results are going into the files."""
    COMPLETED = "completed", "completed"
    EXPIRED = "expired", "expired"
    CANCELLING = "cancelling", "cancelling"
    CANCELLED = "cancelled", "cancelled"


BATCH_ACTIVE = (BatchStatus.VALIDATING, BatchStatus.IN_PROGRESS, BatchStatus.FINALIZING, BatchStatus.CANCELLING)
# A cancel moves these to cancelling; these two it leaves as they are.
BATCH_CANCELABLE = (BatchStatus.VALIDATING, BatchStatus.IN_PROGRESS)
BATCH_CANCEL_UNDER_WAY = (BatchStatus.CANCELLING, BatchStatus.CANCELLED)


class BatchLineState(models.TextChoices):
    PENDING = "pending", "pending"
    """Not sent yet: no task."""
    SENT = "sent", "sent"
    """Its task exists and has not ended."""
    ENDED = "ended", "ended"
    """Its outcome is known; ``written`` says whether its result is in the file yet."""


class BatchLineOutcome(models.TextChoices):
    NONE = "", "(not ended)"
    COMPLETED = "completed", "completed"
    """Its response completed (or is incomplete): a line of the output file."""
    FAILED = "failed", "failed"
    """Its task failed, or its request was refused: a line of the error file."""
    CANCELLED = "cancelled", "cancelled"
    """The batch was cancelled before the line finished: a line of the error file."""
    EXPIRED = "expired", "expired"
    """The batch's window ended before the line finished: a line of the error file."""


class Batch(models.Model):
    """A batch of one client, its counts, and how far its output and error files were written."""

    id = models.CharField(max_length=32, primary_key=True)
    client = models.ForeignKey(Client, on_delete=models.CASCADE, related_name="batches")
    endpoint = models.CharField(max_length=40, help_text="The endpoint every line names, as the client spelt it")
    input_file_id = models.CharField(max_length=31)
    completion_window = models.CharField(max_length=10, default="24h")
    status = models.CharField(max_length=20, choices=BatchStatus.choices, default=BatchStatus.VALIDATING)
    metadata = JSONTextField(default=dict, blank=True)
    errors = JSONTextField(null=True, blank=True, help_text="Why validation failed: OpenAI's errors object")
    model = models.CharField(max_length=200, blank=True, default="")
    total = models.IntegerField(default=0)
    completed = models.IntegerField(default=0)
    failed = models.IntegerField(default=0)
    # The tokens of every line that ran (its task's usage, added in its terminal transaction).
    input_tokens = models.BigIntegerField(default=0)
    cached_tokens = models.BigIntegerField(default=0)
    output_tokens = models.BigIntegerField(default=0)
    output_file_id = models.CharField(max_length=31, blank=True, default="")
    error_file_id = models.CharField(max_length=31, blank=True, default="")
    # How much of each file the writer made durable: the bytes past these are not vouched for.
    output_bytes = models.BigIntegerField(default=0)
    output_lines = models.IntegerField(default=0)
    error_bytes = models.BigIntegerField(default=0)
    error_lines = models.IntegerField(default=0)
    # The writer's claim (compare-and-set), as a webhook delivery's: one process writes a batch's files at a time.
    lease_token = models.CharField(max_length=32, blank=True, default="")
    lease_expires_at = models.DateTimeField(null=True, blank=True)
    created_at = models.DateTimeField()
    in_progress_at = models.DateTimeField(null=True, blank=True)
    expires_at = models.DateTimeField()
    finalizing_at = models.DateTimeField(null=True, blank=True)
    completed_at = models.DateTimeField(null=True, blank=True)
    failed_at = models.DateTimeField(null=True, blank=True)
    expired_at = models.DateTimeField(null=True, blank=True)
    cancelling_at = models.DateTimeField(null=True, blank=True)
    cancelled_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        db_table = "batches"
        verbose_name_plural = "batches"
        constraints = [
            models.CheckConstraint(condition=Q(status__in=BatchStatus.values), name="batch_status_valid"),
            # request_counts are true at every moment: no line counted twice.
            models.CheckConstraint(
                condition=Q(completed__gte=0, failed__gte=0) & Q(total__gte=F("completed") + F("failed")),
                name="batch_counts_within_total",
            ),
        ]
        indexes = [
            models.Index(fields=["client", "-id"], name="batch_client_newest"),
            # The keeper's poll: the batches not finished (a plain index: SQLite reads a partial one only when the
            # query spells its condition out, tasks_app/plumbing/querying.py).
            models.Index(fields=["status", "id"], name="batch_status"),
        ]

    def __str__(self) -> str:
        return self.id


class BatchLine(models.Model):
    """One line of a batch's input file: its request translated, then its task, then its result's place."""

    id = models.BigAutoField(primary_key=True)
    # Indexed with the state below: rows are always read per batch.
    batch = models.ForeignKey(Batch, on_delete=models.CASCADE, related_name="lines", db_index=False)
    line = models.IntegerField(help_text="Its line number in the input file (1 for the first)")
    custom_id = models.CharField(max_length=512)
    request = JSONTextField(help_text="The response request to run (a chat line translated), or the body as sent")
    generation = JSONTextField(null=True, blank=True, help_text="Its generation spec; null when it was refused")
    error = JSONTextField(null=True, blank=True, help_text="The problem that refused it, or that it ended with")
    state = models.CharField(max_length=10, choices=BatchLineState.choices, default=BatchLineState.PENDING)
    outcome = models.CharField(max_length=10, choices=BatchLineOutcome.choices, blank=True, default="")
    # A plain column: the task is kept or cleaned up by its own retention, not the batch's.
    task_id = models.CharField(max_length=31, blank=True, default="")
    written = models.BooleanField(default=False, help_text="Its result is in the output or error file")

    class Meta:
        db_table = "batch_lines"
        constraints = [
            models.UniqueConstraint(fields=["batch", "line"], name="batch_line_unique"),
            models.UniqueConstraint(fields=["batch", "custom_id"], name="batch_line_custom_id_unique"),
            models.CheckConstraint(condition=Q(state__in=BatchLineState.values), name="batch_line_state_valid"),
            models.CheckConstraint(
                condition=Q(state=BatchLineState.ENDED) | Q(outcome=""), name="batch_line_outcome_when_ended"
            ),
        ]
        indexes = [
            # The feeder's (pending lines), the writer's (ended, not written) and the counts of sent lines.
            models.Index(fields=["batch", "state", "written", "line"], name="batch_line_state"),
            models.Index(fields=["task_id"], name="batch_line_task"),
        ]

    def __str__(self) -> str:
        return f"{self.batch_id}#{self.line}"
