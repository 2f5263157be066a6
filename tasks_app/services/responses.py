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

With ``background: true`` (OpenAI's background mode, PROFILE.md section 9)
the reply is the response object, ``queued``, at once; the task runs with the
request's ``on_restart`` policy and its end reaches the client's webhooks.
``POST /responses/{id}/cancel`` and ``DELETE /responses/{id}`` work on any
response: every response is a task.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from django.db import transaction

from tasks_app import states
from tasks_app.core.wire import Live, response_object
from tasks_app.exceptions import InvalidRequest, ResponseNotFinished, ResponseNotFound
from tasks_app.generation.spec import GenerationSpec
from tasks_app.models import Client, IdempotencyKey, IdempotencyState, Response, Task
from tasks_app.services.continuations import conversation_continuation
from tasks_app.services.conversations import ConversationUse
from tasks_app.services.idempotency import idempotency_claim_if_keyed, idempotency_complete
from tasks_app.services.tasks import Reply, task_accept, task_cancel
from tasks_app.states import Protocol, RestartPolicy

RESPONSES_ENDPOINT = "responses"
# The stored reply of a streamed request names the task whose events it was.
EVENT_STREAM_CONTENT_TYPE = "text/event-stream"


@dataclass(frozen=True)
class ResponseStarted:
    """A task to wait for or (``stream``) to stream, or (``replay``) a stored reply to send as is.

    ``replayed`` marks a stream that an earlier request with the same key
    started; ``answer`` is a background response's first reply, sent as is.
    """

    task_id: str | None = None
    idempotency_record_id: int | None = None
    replay: Reply | None = None
    stream: bool = False
    replayed: bool = False
    answer: Reply | None = None


def response_start(
    *,
    client: Client,
    request: Mapping[str, Any],
    spec: GenerationSpec,
    idempotency_key: str | None,
    request_hash: str | None,
    stream: bool = False,
    background: bool = False,
    on_restart: RestartPolicy = RestartPolicy.FAIL,
    protocol: Protocol = Protocol.LMSP,
    endpoint: str = RESPONSES_ENDPOINT,
    conversation: ConversationUse | None = None,
) -> ResponseStarted:
    """Accept a response request as a task, or find what an earlier request with its key started.

    ``protocol`` names the shape of ``request`` (another protocol's adapter
    passes its own, and its ``endpoint`` scopes its idempotency keys); ``conversation``: the conversation it
    reads and adds to (``tasks_app.services.conversations``).
    Returns only after the commit (``durable=True``: never inside another
    transaction), so the task a caller then waits for, streams or (background)
    is told about is durable.
    """
    continuation = conversation_continuation(client=client, previous_response_id=spec.continues)
    if background and request.get("store") is False:
        raise InvalidRequest(
            "a background response is stored: background requires store to be true",
            errors=[{"field": "store", "message": "must be true when background is true"}],
        )
    if on_restart == RestartPolicy.RETRY and idempotency_key is None:
        raise InvalidRequest(
            "on_restart 'retry' requires an Idempotency-Key header",
            errors=[{"field": "Idempotency-Key", "message": "required when on_restart is 'retry'"}],
        )
    with transaction.atomic(durable=True):
        claim = idempotency_claim_if_keyed(
            client=client,
            endpoint=endpoint,
            key=idempotency_key,
            request_hash=request_hash,
            settle=_settle_orphaned,
        )
        if claim is not None and claim.is_replay:
            reply = Reply.replay_of(claim)
            if reply.headers.get("Content-Type") == EVENT_STREAM_CONTENT_TYPE:
                return ResponseStarted(task_id=reply.body["task_id"], stream=True, replayed=True)
            return ResponseStarted(replay=reply)
        accepted = task_accept(
            client=client,
            request=request,
            spec=spec,
            on_restart=on_restart,
            notify_webhooks=background,
            continuation=continuation,
            protocol=protocol,
            conversation=conversation,
        )
        task = accepted.task
        answer = None
        if background and not stream:
            answer = Reply(200, response_object(task.response, Live(queue_position=accepted.queue_position)))
        if claim is not None:
            claim.record.task = task
            claim.record.save(update_fields=["task"])
            if answer is not None:
                idempotency_complete(record=claim.record, status=answer.status, body=answer.body, headers={})
            elif stream:
                idempotency_complete(
                    record=claim.record,
                    status=200,
                    body={"task_id": task.id, "response_id": task.response_id},
                    headers={"Content-Type": EVENT_STREAM_CONTENT_TYPE},
                )
    return ResponseStarted(
        task_id=task.id,
        idempotency_record_id=claim.record.pk if claim is not None else None,
        stream=stream,
        answer=answer,
    )


def _settle_orphaned(record: IdempotencyKey) -> bool:
    """Answer a key whose first request's waiter went away, once its task has ended."""
    if record.task_id is None or not response_task_finished(task_id=record.task_id):
        return False
    task = Task.objects.select_related("response").get(pk=record.task_id)
    idempotency_complete(record=record, status=200, body=response_object(task.response, Live()), headers={})
    return True


def response_task_finished(*, task_id: str) -> bool:
    return Task.objects.filter(pk=task_id, status__in=states.TERMINAL).exists()


def response_finish(*, task_id: str, idempotency_record_id: int | None) -> Reply:
    """The reply for a task that ended: its response object, stored for the key's replays."""
    task = Task.objects.select_related("response").get(pk=task_id)
    reply = Reply(200, response_object(task.response, Live()))
    if idempotency_record_id is not None:
        with transaction.atomic():
            # A retry may have settled the key already (and a replay must
            # match it byte for byte), so only an unanswered key is completed.
            record = IdempotencyKey.objects.filter(pk=idempotency_record_id, state=IdempotencyState.IN_PROGRESS).first()
            if record is not None:
                idempotency_complete(record=record, status=reply.status, body=reply.body, headers=reply.headers)
    return reply


def response_cancel(*, response: Response) -> Task:
    """Cancel the response's task through the lifecycle (``task_cancel``); its state after the move.

    As OpenAI documents: a second cancel answers the cancelled response
    again; one that ended otherwise is ``TaskNotCancelable``.
    """
    return task_cancel(task=response.task)


def response_delete(*, response: Response) -> None:
    """Delete a finished response with its task, events and snapshots (idempotency keys keep their reply).

    A response whose task has not ended is ``ResponseNotFinished``: the
    delete filters on the terminal statuses, so it cannot race a worker.
    """
    with transaction.atomic():
        # Cascades to events and snapshots; a terminal status never changes, so the filter is the whole check.
        _, by_model = Task.objects.filter(response_id=response.pk, status__in=states.TERMINAL).delete()
        if not by_model.get(Task._meta.label, 0):
            if Task.objects.filter(response_id=response.pk).exists():
                raise ResponseNotFinished(
                    f"response {response.pk} has not finished; cancel it first, or wait until it ends"
                )
            raise ResponseNotFound(f"No response with id {response.pk!r}")
        # Task.response is PROTECT: the response goes after its task.
        Response.objects.filter(pk=response.pk).delete()
