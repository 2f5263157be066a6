"""Tables of chapter 11.1 and the invariants the database itself can hold.

Status columns are only ever written by ``tasks_app.core.lifecycle``; nothing here
overrides ``save()`` or reacts to signals. The statuses, their groups and the
event types are ``tasks_app.states`` and ``tasks_app.events``.
"""

from __future__ import annotations

from django.db import models
from django.db.models import F, Q

from tasks_app import events, states
from tasks_app.fields import EventPayloadField, JSONTextField
from tasks_app.model_layouts import LAYOUT_GENAI, LAYOUT_ONNX_COMMUNITY, LAYOUT_OPTIMUM, LAYOUT_OPTIMUM_MERGED
from tasks_app.states import AttemptEnd, Protocol, ResponseStatus, RestartPolicy, TaskStatus


class TaskType(models.TextChoices):
    RESPONSE = "response", "response"
    """Runs one response request (the only task type of LMSP 1.0)."""


class IdempotencyState(models.TextChoices):
    IN_PROGRESS = "in_progress", "in_progress"
    """The first request with this key is still being served."""
    COMPLETED = "completed", "completed"
    """The reply is stored and is replayed for the same body."""


class ModelLayout(models.TextChoices):
    """How a model folder is laid out (``tasks_app.model_layouts`` reads it from the file names)."""

    OPTIMUM = LAYOUT_OPTIMUM, "optimum"
    """``model.onnx`` (or ``model_<variant>.onnx``) beside the configs, as ``optimum-cli export onnx`` writes it."""
    ONNX_COMMUNITY = LAYOUT_ONNX_COMMUNITY, "onnx-community"
    """``onnx/model.onnx`` and its variants ``onnx/model_<variant>.onnx``; configs and tokenizer one folder up."""
    GENAI = LAYOUT_GENAI, "genai"
    """An onnxruntime-genai builder folder: ``genai_config.json`` names the decoder graph."""
    OPTIMUM_MERGED = LAYOUT_OPTIMUM_MERGED, "optimum-merged"
    """A legacy Optimum export: ``decoder_model_merged.onnx`` with its ``use_cache_branch`` input."""


class ServiceConfig(models.Model):
    """Service identity and configuration, one row per key."""

    key = models.CharField(max_length=100, primary_key=True)
    value = models.JSONField()
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        db_table = "service_config"

    def __str__(self) -> str:
        return self.key


class Client(models.Model):
    """A paired client: token hash (never the token) and scopes."""

    name = models.CharField(max_length=100)
    token_hash = models.CharField(max_length=64, unique=True, help_text="SHA-256 of the token, hex")
    scopes = models.JSONField(default=list)
    created_at = models.DateTimeField(auto_now_add=True)
    last_used_at = models.DateTimeField(null=True, blank=True)
    revoked_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        db_table = "clients"
        constraints = [
            # Names identify clients in `lmsp_client revoke NAME`; a revoked
            # client's name may be reused.
            models.UniqueConstraint(
                fields=["name"], condition=Q(revoked_at__isnull=True), name="client_name_unique_when_active"
            ),
        ]

    def __str__(self) -> str:
        return self.name

    # DRF treats the authenticated principal like a user.
    @property
    def is_authenticated(self) -> bool:
        return True

    def has_scope(self, scope: str) -> bool:
        return scope in self.scopes or "admin" in self.scopes


class PairingCode(models.Model):
    """A one-time code that a new client trades for a token."""

    code_hash = models.CharField(max_length=64, unique=True)
    scopes = models.JSONField(default=list)
    created_at = models.DateTimeField(auto_now_add=True)
    expires_at = models.DateTimeField()
    used_at = models.DateTimeField(null=True, blank=True)
    client = models.ForeignKey(Client, null=True, blank=True, on_delete=models.SET_NULL, related_name="+")
    # A wrong code does not name the code it missed, so each one counts
    # against every pending code; a code that reached the limit is locked.
    failed_attempts = models.PositiveIntegerField(
        default=0, help_text="Wrong codes tried while this one was pending (it locks at LMSP_PAIRING_MAX_FAILURES)"
    )

    class Meta:
        db_table = "pairing_codes"

    def __str__(self) -> str:
        return f"pairing code {self.pk}"


class ModelRecord(models.Model):
    """Metadata and content digests of a model folder; files stay on disk."""

    name = models.CharField(max_length=200, unique=True, help_text="`name` or `name:tag`")
    path = models.CharField(max_length=1000, help_text="Folder relative to LMSP_MODELS_DIR (the side files)")
    graph = models.CharField(
        max_length=1000, default="model.onnx", help_text="The decoder graph's path relative to the folder"
    )
    layout = models.CharField(max_length=20, choices=ModelLayout.choices, default=ModelLayout.OPTIMUM)
    backend = models.CharField(max_length=50)
    size_bytes = models.BigIntegerField()
    digest = models.CharField(max_length=71, help_text="sha256:<hex> over the per-file digests")
    files = models.JSONField(default=dict, help_text="{path relative to the folder: {size, mtime_ns, sha256}}")
    capabilities = JSONTextField(default=dict)
    config = models.JSONField(default=dict, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        db_table = "models"
        verbose_name = "model"
        constraints = [
            models.CheckConstraint(condition=Q(size_bytes__gte=0), name="model_size_non_negative"),
            models.CheckConstraint(condition=Q(layout__in=ModelLayout.values), name="model_layout_valid"),
        ]

    def __str__(self) -> str:
        return self.name

    @property
    def resumable(self) -> bool:
        return bool(self.capabilities.get("resumable_snapshots"))


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
    created_at = models.DateTimeField()
    updated_at = models.DateTimeField()

    class Meta:
        db_table = "responses"
        constraints = [
            models.CheckConstraint(condition=Q(status__in=ResponseStatus.values), name="response_status_valid"),
            models.CheckConstraint(condition=Q(protocol__in=Protocol.values), name="response_protocol_valid"),
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


class WorkerNodeState(models.TextChoices):
    ONLINE = "online", "online"
    DRAINING = "draining", "draining (shutting down)"
    STOPPED = "stopped", "stopped"


class WorkerNode(models.Model):
    """A worker node's own report of itself, refreshed every ``LMSP_WORKER_REPORT_SECONDS`` (``workers.node_report``).

    What the admin's workers page shows: a node whose report stopped is silent
    (frozen, cut off or killed) even before the reaper's heartbeat timeout.
    """

    name = models.CharField(max_length=200, primary_key=True, help_text="Celery's node name")
    hostname = models.CharField(max_length=200)
    pid = models.IntegerField()
    version = models.CharField(max_length=50)
    pool = models.CharField(max_length=50, help_text="Celery's pool (threads: one process runs every row)")
    state = models.CharField(max_length=20, choices=WorkerNodeState.choices, default=WorkerNodeState.ONLINE)
    started_at = models.DateTimeField()
    reported_at = models.DateTimeField(help_text="Its newest report, on the clock heartbeats are written with")
    max_rows = models.IntegerField(default=0, help_text="Rows it runs at once")
    engines = JSONTextField(default=list, help_text="Per loaded model: device, rows, waiting, tokens/s")

    class Meta:
        db_table = "worker_nodes"
        constraints = [
            models.CheckConstraint(condition=Q(state__in=WorkerNodeState.values), name="worker_node_state_valid"),
        ]

    def __str__(self) -> str:
        return self.name


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


class IdempotencyKey(models.Model):
    """An Idempotency-Key with its request digest and stored reply."""

    client = models.ForeignKey(Client, on_delete=models.CASCADE, related_name="+")
    endpoint = models.CharField(max_length=50)
    key = models.CharField(max_length=255)
    request_hash = models.CharField(max_length=64)
    state = models.CharField(max_length=20, choices=IdempotencyState.choices)
    response_status = models.IntegerField(null=True, blank=True)
    response_body = JSONTextField(null=True, blank=True)
    response_headers = JSONTextField(default=dict, blank=True)
    # The task a still-unanswered request started (POST /responses): if the
    # process that waited on it died, a retry with the key can still be
    # answered once the task has ended.
    task = models.ForeignKey("Task", null=True, blank=True, on_delete=models.SET_NULL, related_name="+")
    created_at = models.DateTimeField()
    expires_at = models.DateTimeField()

    class Meta:
        db_table = "idempotency_keys"
        constraints = [
            # Concurrent first uses are resolved here, not by a read-then-write.
            models.UniqueConstraint(fields=["client", "endpoint", "key"], name="idempotency_key_unique"),
            models.CheckConstraint(condition=Q(state__in=IdempotencyState.values), name="idempotency_state_valid"),
            models.CheckConstraint(
                condition=Q(state=IdempotencyState.IN_PROGRESS) | Q(response_status__isnull=False),
                name="idempotency_completed_has_reply",
            ),
        ]
        indexes = [models.Index(fields=["expires_at"], name="idempotency_expiry")]

    def __str__(self) -> str:
        return f"{self.endpoint}:{self.key}"


class WebhookDeliveryStatus(models.TextChoices):
    PENDING = "pending", "pending"
    """Not delivered yet: attempted (again) once ``next_attempt_at`` has come."""
    DELIVERED = "delivered", "delivered"
    """The receiver answered an attempt with a 2xx."""
    FAILED = "failed", "failed"
    """Given up: no attempt succeeded within LMSP_WEBHOOK_MAX_AGE_SECONDS of the event."""


class WebhookEndpoint(models.Model):
    """A client's webhook endpoint (docs/webhooks.md): where its tasks' terminal events are POSTed."""

    id = models.CharField(max_length=31, primary_key=True)
    client = models.ForeignKey(Client, on_delete=models.CASCADE, related_name="webhook_endpoints")
    name = models.CharField(max_length=200)
    url = models.CharField(max_length=2048)
    event_types = models.JSONField(default=list, help_text="The event types delivered here")
    # Kept (HMAC needs it), shown only in the replies of create and rotate; never in the admin.
    secret = models.CharField(max_length=64)
    # After a rotation that keeps it for 24 hours, deliveries are signed with both.
    previous_secret = models.CharField(max_length=64, blank=True, default="")
    previous_secret_expires_at = models.DateTimeField(null=True, blank=True)
    created_at = models.DateTimeField()
    updated_at = models.DateTimeField()

    class Meta:
        db_table = "webhook_endpoints"
        constraints = [
            models.CheckConstraint(condition=Q(secret__startswith="whsec_"), name="webhook_endpoint_secret_whsec"),
        ]
        indexes = [models.Index(fields=["client", "-id"], name="webhook_endpoint_client_newest")]

    def __str__(self) -> str:
        return self.id


class WebhookDelivery(models.Model):
    """One event for one endpoint: the outbox row the deliverer sends until it is delivered or given up.

    Written in the transaction that ends the task (``tasks_app.core.lifecycle``),
    so an event is delivered exactly when its task's end was committed.
    ``response_id`` and ``task_id`` are plain columns: deleting a response
    does not take its pending delivery with it.
    """

    id = models.CharField(max_length=32, primary_key=True, help_text="The webhook-id header, the same on every attempt")
    # Indexed with the id below (an endpoint's deliveries, newest first).
    endpoint = models.ForeignKey(WebhookEndpoint, on_delete=models.CASCADE, related_name="deliveries", db_index=False)
    event_id = models.CharField(max_length=31, help_text="The event's id (evt_...), the payload's id")
    event_type = models.CharField(max_length=64)
    payload = models.TextField(help_text="The exact bytes signed and sent (UTF-8 JSON)")
    response_id = models.CharField(max_length=31)
    task_id = models.CharField(max_length=31)
    status = models.CharField(
        max_length=20, choices=WebhookDeliveryStatus.choices, default=WebhookDeliveryStatus.PENDING
    )
    attempts = models.IntegerField(default=0)
    next_attempt_at = models.DateTimeField()
    last_attempt_at = models.DateTimeField(null=True, blank=True)
    last_status_code = models.IntegerField(null=True, blank=True, help_text="The HTTP status of the last attempt")
    last_error = models.TextField(blank=True, default="")
    delivered_at = models.DateTimeField(null=True, blank=True)
    # The claim (compare-and-set): a deliverer owns the row while its lease runs; one that died with
    # it simply leaves it to the next claim once the lease expired (at least once).
    lease_token = models.CharField(max_length=32, blank=True, default="")
    lease_expires_at = models.DateTimeField(null=True, blank=True)
    created_at = models.DateTimeField()

    class Meta:
        db_table = "webhook_deliveries"
        verbose_name_plural = "webhook deliveries"
        constraints = [
            models.CheckConstraint(
                condition=Q(status__in=WebhookDeliveryStatus.values), name="webhook_delivery_status_valid"
            ),
            models.CheckConstraint(condition=Q(attempts__gte=0), name="webhook_delivery_attempts_non_negative"),
            # Delivered means an attempt succeeded, and says when.
            models.CheckConstraint(
                condition=~Q(status=WebhookDeliveryStatus.DELIVERED) | Q(delivered_at__isnull=False, attempts__gte=1),
                name="webhook_delivery_delivered_has_time",
            ),
        ]
        indexes = [
            # The deliverer's poll: the due pending rows, however many delivered ones are kept.
            models.Index(
                fields=["next_attempt_at"],
                condition=Q(status=WebhookDeliveryStatus.PENDING),
                name="webhook_delivery_due",
            ),
            models.Index(fields=["endpoint", "-id"], name="webhook_delivery_endpoint"),
            # Retention cleanup finds delivered and given-up rows by their last attempt.
            models.Index(fields=["last_attempt_at"], name="webhook_delivery_last_attempt"),
        ]

    def __str__(self) -> str:
        return self.id
