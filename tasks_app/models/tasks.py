"""Tasks, their responses, events, snapshots and attempts (chapters 7 and 11.1).

Status columns are only ever written by ``tasks_app.core``'s lifecycle; nothing here
overrides ``save()`` or reacts to signals. The statuses, their groups and the
event types are ``tasks_app.states`` and ``tasks_app.events``."""

from __future__ import annotations

from django.db import models
from django.db.models import F, Q

from tasks_app import events, states
from tasks_app.fields import EventPayloadField, JSONTextField
from tasks_app.models.clients import Client
from tasks_app.states import AttemptEnd, Protocol, ResponseStatus, RestartPolicy, TaskStatus


class TaskType(models.TextChoices):
    RESPONSE = "response", "response"
    """Runs one response request (the only task type of LMSP 1.0)."""


class Response(models.Model):
    """A response object (PROFILE.md section 3) and what produced it."""

    id = models.CharField(max_length=31, primary_key=True)
    client = models.ForeignKey(Client, on_delete=models.PROTECT, related_name="responses")
    model = models.CharField(max_length=200)
    status = models.CharField(max_length=20, choices=ResponseStatus.choices, default=ResponseStatus.QUEUED)
    protocol = models.CharField(
        max_length=20,
        choices=Protocol.choices,
        default=Protocol.LMSP,
        help_text="The protocol the request came in (the shape of request)",
    )
    request = JSONTextField(help_text="The validated response request, as its client sent it")
    generation = JSONTextField(
        null=True,
        blank=True,
        help_text="The generation spec the worker runs (tasks_app.generation.spec), translated from the request",
    )
    output = JSONTextField(default=list)
    usage = JSONTextField(null=True, blank=True)
    error = JSONTextField(null=True, blank=True)
    incomplete_details = JSONTextField(null=True, blank=True)
    stop_sequence = JSONTextField(
        null=True, blank=True, help_text="The request's stop string that ended the output (a string), if one did"
    )
    metadata = JSONTextField(default=dict, blank=True)
    # A plain column: deleting the conversation leaves its responses as they are.
    conversation_id = models.CharField(
        max_length=31,
        blank=True,
        default="",
        help_text="The conversation (conv_...) it reads its context from and adds its items to; empty: none",
    )
    # A plain column, as conversation_id: a batch line's task ends into its batch (core/batch_log).
    batch_id = models.CharField(
        max_length=32, blank=True, default="", help_text="The batch (batch_...) whose line it runs; empty: none"
    )
    created_at = models.DateTimeField()
    updated_at = models.DateTimeField()

    class Meta:
        db_table = "responses"
        constraints = [
            models.CheckConstraint(condition=Q(status__in=ResponseStatus.values), name="response_status_valid"),
            models.CheckConstraint(condition=Q(protocol__in=Protocol.values), name="response_protocol_valid"),
        ]
        indexes = [
            # Whether a conversation has a response running (PROFILE.md 12.1: the second is refused).
            models.Index(
                fields=["conversation_id", "status"], condition=~Q(conversation_id=""), name="response_conversation"
            ),
        ]

    def __str__(self) -> str:
        return self.id


class Task(models.Model):
    """A persisted asynchronous task (chapter 7)."""

    id = models.CharField(max_length=31, primary_key=True)
    client = models.ForeignKey(Client, on_delete=models.PROTECT, related_name="tasks")
    type = models.CharField(max_length=20, choices=TaskType.choices, default=TaskType.RESPONSE)
    status = models.CharField(max_length=20, choices=TaskStatus.choices, default=TaskStatus.QUEUED)
    on_restart = models.CharField(max_length=10, choices=RestartPolicy.choices, default=RestartPolicy.FAIL)
    response = models.OneToOneField(Response, on_delete=models.PROTECT, related_name="task")
    last_sequence = models.IntegerField(default=0, help_text="sequence_number of the newest event")
    attempts = models.IntegerField(default=0, help_text="How many times a worker started the task")
    attempt_after = models.IntegerField(
        default=0,
        help_text="sequence_number of the newest event when the current attempt was claimed: its events follow it",
    )
    output_tokens = models.IntegerField(default=0, help_text="Output tokens committed so far (this attempt)")
    cancel_requested_at = models.DateTimeField(
        null=True, blank=True, help_text="When a cancel moved the task to cancelling (for cancel latency)"
    )
    error = JSONTextField(null=True, blank=True)
    worker = models.CharField(
        max_length=200, blank=True, default="", help_text="The worker process (node/pid) of the current or last attempt"
    )
    heartbeat_at = models.DateTimeField(null=True, blank=True)
    attempt_started_at = models.DateTimeField(
        null=True, blank=True, help_text="When the current (or, once finished, the last) attempt was claimed"
    )
    first_token_at = models.DateTimeField(
        null=True, blank=True, help_text="When that attempt committed its first output"
    )
    finished_at = models.DateTimeField(null=True, blank=True, help_text="When the task reached its terminal status")
    rerun_of = models.ForeignKey(
        "self",
        null=True,
        blank=True,
        on_delete=models.SET_NULL,
        related_name="reruns",
        help_text="The task an operator ran again to make this one (same request)",
    )
    notify_webhooks = models.BooleanField(
        default=False,
        help_text="Whether the task's end is delivered to the client's webhook endpoints "
        "(POST /tasks and background responses; not a response its caller waits for)",
    )
    created_at = models.DateTimeField()
    updated_at = models.DateTimeField()

    class Meta:
        db_table = "tasks"
        constraints = [
            models.CheckConstraint(condition=Q(status__in=TaskStatus.values), name="task_status_valid"),
            models.CheckConstraint(condition=Q(on_restart__in=RestartPolicy.values), name="task_on_restart_valid"),
            models.CheckConstraint(condition=Q(type__in=TaskType.values), name="task_type_valid"),
            models.CheckConstraint(condition=Q(last_sequence__gte=0), name="task_last_sequence_non_negative"),
            models.CheckConstraint(condition=Q(output_tokens__gte=0), name="task_output_tokens_non_negative"),
            # An attempt begins inside the task's own log.
            models.CheckConstraint(
                condition=Q(attempt_after__gte=0) & Q(attempt_after__lte=F("last_sequence")),
                name="task_attempt_after_in_log",
            ),
            # A failed task always says why.
            models.CheckConstraint(
                condition=~Q(status=TaskStatus.FAILED) | Q(error__isnull=False), name="task_failed_has_error"
            ),
        ]
        indexes = [
            models.Index(fields=["client", "-id"], name="task_client_newest"),
            models.Index(fields=["client", "status", "-id"], name="task_client_status_newest"),
            # Recovery, sweeper and reaper scan only unfinished tasks.
            models.Index(
                fields=["status", "id"],
                condition=Q(status__in=states.in_declaration_order(states.ACTIVE)),
                name="task_active",
            ),
            # Retention cleanup finds finished tasks by the time they finished.
            models.Index(
                fields=["updated_at", "id"],
                condition=Q(status__in=states.in_declaration_order(states.TERMINAL)),
                name="task_finished",
            ),
        ]

    def __str__(self) -> str:
        return self.id

    @property
    def is_terminal(self) -> bool:
        return self.status in states.TERMINAL


class TaskAttempt(models.Model):
    """An attempt that ended: a worker's claim (or adoption) of a task, to the move that let go of it.

    Written by the lifecycle in the transaction of that move (``tasks_app.core``),
    from the task row's attempt columns; the open attempt is the task row itself,
    so a claim and a batch of deltas write nothing here.
    """

    id = models.BigAutoField(primary_key=True)
    # Indexed with the number below: rows are always read per task, in order.
    task = models.ForeignKey(Task, on_delete=models.CASCADE, related_name="attempt_log", db_index=False)
    number = models.IntegerField(help_text="1 for the first claim; an adoption to resume counts as one too")
    worker = models.CharField(max_length=200, help_text="The worker process (node/pid) that held it")
    started_at = models.DateTimeField()
    first_token_at = models.DateTimeField(null=True, blank=True)
    ended_at = models.DateTimeField()
    end = models.CharField(max_length=20, choices=AttemptEnd.choices)
    reason = models.TextField(blank=True, default="", help_text="Why it ended, as the mover said")
    output_tokens = models.IntegerField(default=0, help_text="Output tokens committed when it ended")

    class Meta:
        db_table = "task_attempts"
        constraints = [
            models.UniqueConstraint(fields=["task", "number"], name="task_attempt_number_unique"),
            models.CheckConstraint(condition=Q(end__in=AttemptEnd.values), name="task_attempt_end_valid"),
            models.CheckConstraint(condition=Q(ended_at__gte=F("started_at")), name="task_attempt_ends_after_start"),
        ]

    def __str__(self) -> str:
        return f"{self.task_id} attempt {self.number}"


class TaskSnapshot(models.Model):
    """One batch's share of a running task's resumable state.

    Every batch of events appends one row in its own transaction: the token
    ids generated since the previous row, and the small state (sampler RNG,
    detokeniser offsets, held-back text) as of the batch's last event; the
    first row of an attempt also holds the prompt ids. Rewriting the whole
    state with each batch would write O(n²) bytes over a long generation;
    appending writes each token id once. The rows go when the task ends or
    starts over (``tasks_app.core.lifecycle``); ``selectors.task_snapshot_get``
    puts them back together.
    """

    id = models.BigAutoField(primary_key=True)
    # Indexed with the id below: rows are always read per task, in order.
    task = models.ForeignKey(Task, on_delete=models.CASCADE, related_name="snapshots", db_index=False)
    sequence_number = models.IntegerField(help_text="The last event this row accounts for")
    token_ids = JSONTextField(default=list, help_text="Token ids generated since the previous row")
    state = JSONTextField(help_text="The generation's small state as of this row")
    created_at = models.DateTimeField()

    class Meta:
        db_table = "task_snapshots"
        indexes = [models.Index(fields=["task", "id"], name="task_snapshot_order")]

    def __str__(self) -> str:
        return f"{self.task_id}@{self.sequence_number}"


class TaskEvent(models.Model):
    """One event of a task's log; ``payload`` is the exact JSON sent to clients."""

    task = models.ForeignKey(Task, on_delete=models.CASCADE, related_name="events")
    sequence_number = models.IntegerField()
    type = models.CharField(max_length=64)
    # Stored as text so a stream replays the very bytes written (JSONB would
    # reorder keys on PostgreSQL) and never re-encodes per client.
    payload = EventPayloadField()
    created_at = models.DateTimeField()

    class Meta:
        db_table = "task_events"
        ordering = ["task", "sequence_number"]
        constraints = [
            models.UniqueConstraint(fields=["task", "sequence_number"], name="task_event_sequence_unique"),
            models.UniqueConstraint(
                fields=["task"], condition=Q(type__in=events.TERMINAL), name="task_event_one_terminal"
            ),
            models.CheckConstraint(condition=Q(sequence_number__gte=0), name="task_event_sequence_non_negative"),
        ]

    def __str__(self) -> str:
        return f"{self.task_id}#{self.sequence_number} {self.type}"
