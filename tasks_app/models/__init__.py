"""The tables (chapter 11.1 and the extensions) and the invariants the database itself can hold, one module per
feature; every model is importable from here, as Django's app registry and the rest of the code expect."""

from tasks_app.models.batches import Batch, BatchLine, BatchLineOutcome, BatchLineState, BatchStatus
from tasks_app.models.clients import Client, PairingCode, ServiceConfig
from tasks_app.models.conversations import Conversation, ConversationItem, ConversationItemState
from tasks_app.models.files import File, FilePurpose
from tasks_app.models.idempotency import IdempotencyKey, IdempotencyState
from tasks_app.models.model_records import ModelLayout, ModelRecord
from tasks_app.models.tasks import Response, Task, TaskAttempt, TaskEvent, TaskSnapshot, TaskType
from tasks_app.models.webhooks import WebhookDelivery, WebhookDeliveryStatus, WebhookEndpoint
from tasks_app.models.workers import WorkerNode, WorkerNodeState

__all__ = [
    "Batch",
    "BatchLine",
    "BatchLineOutcome",
    "BatchLineState",
    "BatchStatus",
    "Client",
    "Conversation",
    "ConversationItem",
    "ConversationItemState",
    "File",
    "FilePurpose",
    "IdempotencyKey",
    "IdempotencyState",
    "ModelLayout",
    "ModelRecord",
    "PairingCode",
    "Response",
    "ServiceConfig",
    "Task",
    "TaskAttempt",
    "TaskEvent",
    "TaskSnapshot",
    "TaskType",
    "WebhookDelivery",
    "WebhookDeliveryStatus",
    "WebhookEndpoint",
    "WorkerNode",
    "WorkerNodeState",
]
