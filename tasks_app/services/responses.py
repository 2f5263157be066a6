"""``POST /responses`` without streaming: a task like any other, answered when it ends.

The request becomes a task (policy ``fail``) through the same path as ``POST
/tasks``, so workers, cancel and recovery treat both alike, and the task is
visible in ``GET /tasks``. The idempotency key stays ``in_progress`` until the
task ended and the reply was stored, so a second request with the key meanwhile
gets ``409 idempotency_key_in_use`` and a later one the same response again,
even if the process that waited for the first answer died meanwhile.

With ``stream: true`` the reply is the task's event stream. Its key is
answered at once, with a reference to the task: a retry with the key gets
the same events again (from its ``Last-Event-ID``), never a second run.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from django.db import transaction

from tasks_app import states
from tasks_app.models import Client, IdempotencyKey, IdempotencyState, Task
from tasks_app.services.idempotency import idempotency_claim_if_keyed, idempotency_complete
from tasks_app.services.tasks import Reply, task_accept
from tasks_app.states import RestartPolicy
from tasks_app.wire import response_object

RESPONSES_ENDPOINT = "responses"
# The stored reply of a streamed request names the task whose events it was.
EVENT_STREAM_CONTENT_TYPE = "text/event-stream"


@dataclass(frozen=True)
class ResponseStarted:
    """A task to wait for or (``stream``) to stream, or (``replay``) a stored reply to send as is.

    ``replayed`` marks a stream that an earlier request with the same key started.
    """

    task_id: str | None = None
    idempotency_record_id: int | None = None
    replay: Reply | None = None
    stream: bool = False
    replayed: bool = False


def response_start(
    *,
    client: Client,
    request: Mapping[str, Any],
    idempotency_key: str | None,
    request_hash: str | None,
    stream: bool = False,
) -> ResponseStarted:
    """Accept a response request as a task, or find what an earlier request with its key started.

    Returns only after the commit (``durable=True``: never inside another
    transaction), so the task a caller then waits for or streams is durable.
    """
    with transaction.atomic(durable=True):
        claim = idempotency_claim_if_keyed(
            client=client,
            endpoint=RESPONSES_ENDPOINT,
            key=idempotency_key,
            request_hash=request_hash,
            settle=_settle_orphaned,
        )
        if claim is not None and claim.is_replay:
            reply = Reply.replay_of(claim)
            if reply.headers.get("Content-Type") == EVENT_STREAM_CONTENT_TYPE:
                return ResponseStarted(task_id=reply.body["task_id"], stream=True, replayed=True)
            return ResponseStarted(replay=reply)
        task = task_accept(client=client, request=request, on_restart=RestartPolicy.FAIL)
        if claim is not None:
            claim.record.task = task
            claim.record.save(update_fields=["task"])
            if stream:
                idempotency_complete(
                    record=claim.record,
                    status=200,
                    body={"task_id": task.id, "response_id": task.response_id},
                    headers={"Content-Type": EVENT_STREAM_CONTENT_TYPE},
                )
    return ResponseStarted(
        task_id=task.id, idempotency_record_id=claim.record.pk if claim is not None else None, stream=stream
    )


def _settle_orphaned(record: IdempotencyKey) -> bool:
    """Answer a key whose first request's waiter went away, once its task has ended."""
    if record.task_id is None or not response_task_finished(task_id=record.task_id):
        return False
    task = Task.objects.select_related("response").get(pk=record.task_id)
    idempotency_complete(record=record, status=200, body=response_object(task.response), headers={})
    return True


def response_task_finished(*, task_id: str) -> bool:
    return Task.objects.filter(pk=task_id, status__in=states.TERMINAL).exists()


def response_finish(*, task_id: str, idempotency_record_id: int | None) -> Reply:
    """The reply for a task that ended: its response object, stored for the key's replays."""
    task = Task.objects.select_related("response").get(pk=task_id)
    reply = Reply(200, response_object(task.response))
    if idempotency_record_id is not None:
        with transaction.atomic():
            # A retry may have settled the key already (and a replay must
            # match it byte for byte), so only an unanswered key is completed.
            record = IdempotencyKey.objects.filter(pk=idempotency_record_id, state=IdempotencyState.IN_PROGRESS).first()
            if record is not None:
                idempotency_complete(record=record, status=reply.status, body=reply.body, headers=reply.headers)
    return reply
