"""Creating and cancelling tasks; every status change goes through the lifecycle."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import Any

from django.conf import settings
from django.db import transaction

from tasks_app import states
from tasks_app.core import lifecycle
from tasks_app.core.wire import task_object
from tasks_app.exceptions import (
    ConversationBusy,
    ConversationNotFound,
    InvalidRequest,
    LmspError,
    ModelNotFound,
    QueueFull,
    ResponseNotFinished,
    ResponseNotFound,
    TaskNotCancelable,
    TaskNotRerunnable,
    UnsupportedCapability,
    UnsupportedParameter,
)
from tasks_app.generation.spec import GenerationSpec
from tasks_app.models import Client, Task
from tasks_app.plumbing.querying import status_in
from tasks_app.selectors.tasks import model_get_by_name
from tasks_app.services.continuations import Continuation, conversation_continuation
from tasks_app.services.conversations import ConversationUse, conversation_items_pend, conversation_join
from tasks_app.services.dispatch import task_dispatch_on_commit
from tasks_app.services.idempotency import IdempotencyClaim, idempotency_claim_if_keyed, idempotency_complete
from tasks_app.states import Protocol, RestartPolicy, TaskStatus

TASKS_ENDPOINT = "tasks"


@dataclass(frozen=True)
class Reply:
    """An HTTP reply decided by a service (fresh or replayed)."""

    status: int
    body: Any
    headers: dict[str, str] = field(default_factory=dict)
    replayed: bool = False

    @classmethod
    def replay_of(cls, claim: IdempotencyClaim) -> Reply:
        return cls(claim.replay_status, claim.replay_body, claim.replay_headers or {}, replayed=True)


def task_location(task_id: str) -> str:
    return f"/lmsp/v1/tasks/{task_id}"


@dataclass(frozen=True)
class Accepted:
    """A task just accepted, and its place in the line (the queued tasks counted before it, plus one)."""

    task: Task
    queue_position: int


def task_accept(
    *,
    client: Client,
    request: Mapping[str, Any],
    spec: GenerationSpec,
    on_restart: RestartPolicy,
    notify_webhooks: bool = False,
    continuation: Continuation | None = None,
    protocol: Protocol = Protocol.LMSP,
    conversation: ConversationUse | None = None,
) -> Accepted:
    """Insert a queued task for ``request`` and dispatch it once the caller's transaction commits.

    Shared by ``POST /tasks`` and ``POST /responses``; must run in a transaction.
    ``notify_webhooks``: its end goes to the client's webhook endpoints (docs/webhooks.md);
    ``spec``: the request's generation spec, which the task stores beside it;
    ``protocol``: the shape ``request`` is in (``Protocol``);
    ``continuation``: the conversation the spec continues (``conversation_continuation``):
    its refusal is raised here, after the caller's idempotency key had its say; its turns are copied
    into the task's spec, before its own; the worker that ran the response before gets the task if it has room
    (``tasks_app.plumbing.affinity``);
    ``conversation``: the conversation (PROFILE.md 12.1) the response reads its context from and adds its items
    to when it ends (``tasks_app.services.conversations``); it takes the place of ``continuation``.
    The count that checks the queue's limit is also the new task's place in
    the line: inside the write transaction, every queued task is ahead of it.
    """
    if conversation is not None:
        continuation = conversation_join(client=client, use=conversation)
    context = continuation.context_or_refusal() if continuation is not None else None
    model = model_get_by_name(spec.model)
    if on_restart == RestartPolicy.RESUME and not model.resumable:
        raise UnsupportedCapability(
            f"model {model.name!r} has no resumable snapshots; on_restart 'resume' is not available",
            errors=[{"field": "on_restart", "message": "the model's backend has no resumable snapshots"}],
        )
    # Runs for every new task: counted over the partial index of unfinished tasks, not all tasks kept.
    ahead = Task.objects.filter(status_in([TaskStatus.QUEUED])).count()
    if ahead >= settings.LMSP_MAX_QUEUED_TASKS:
        retry_after = str(settings.LMSP_QUEUE_FULL_RETRY_AFTER_SECONDS)
        raise QueueFull("Too many tasks are waiting; try again later", headers={"Retry-After": retry_after})
    stored_request = {**request, "model": model.name}
    spec = replace(spec, model=model.name)
    if context is not None:
        spec = spec.continued(context)
    task = lifecycle.task_insert(
        client=client,
        request=stored_request,
        generation=spec.to_json(),
        model=model.name,
        on_restart=on_restart,
        metadata=request.get("metadata") or {},
        notify_webhooks=notify_webhooks,
        protocol=protocol,
        conversation_id=conversation.conversation_id if conversation is not None else "",
    )
    if conversation is not None:
        conversation_items_pend(use=conversation, response_id=task.response_id)
    task_dispatch_on_commit(
        task_id=task.id,
        prefer_worker=continuation.worker if continuation is not None else "",
        conversation=spec.conversation_key() if spec.continues_conversation() else "",
    )
    return Accepted(task, ahead + 1)


@contextmanager
def in_envelope(field: str, *, only: type[LmspError] | tuple[type[LmspError], ...] = LmspError) -> Iterator[None]:
    """Errors about a request's fields (of class ``only``), named by their path in a body that holds the
    request in ``field``."""
    try:
        yield
    except only as error:
        error.errors = [{**e, "field": f"{field}.{e['field']}"} for e in error.errors or ()] or None
        if isinstance(error, UnsupportedParameter):
            error.param = f"{field}.{error.param}"
        raise


def task_create(
    *,
    client: Client,
    request: Mapping[str, Any],
    spec: GenerationSpec,
    on_restart: RestartPolicy,
    idempotency_key: str | None,
    request_hash: str | None,
    conversation: ConversationUse | None = None,
) -> Reply:
    """Accept a task: task, response, event 0 and idempotency record in one transaction.

    Returns only after the commit, so a 202 built from the reply describes a
    task that is already durable: ``durable=True`` makes that a rule, since
    called inside another transaction it would commit only with that one.
    """
    if on_restart == RestartPolicy.RETRY and idempotency_key is None:
        raise InvalidRequest(
            "on_restart 'retry' requires an Idempotency-Key header",
            errors=[{"field": "Idempotency-Key", "message": "required when on_restart is 'retry'"}],
        )
    continuation = conversation_continuation(client=client, previous_response_id=spec.continues)
    # The model is looked up inside the transaction (task_accept), the continuation's refusal raised
    # there (after a replay had its chance); their paths in this body are under input.
    refusals = (ModelNotFound, ResponseNotFound, ResponseNotFinished, ConversationNotFound, ConversationBusy)
    with in_envelope("input", only=refusals), transaction.atomic(durable=True):
        claim = idempotency_claim_if_keyed(
            client=client, endpoint=TASKS_ENDPOINT, key=idempotency_key, request_hash=request_hash
        )
        if claim is not None and claim.is_replay:
            return Reply.replay_of(claim)
        # A task's client learns of its end by polling, streaming or its webhooks.
        accepted = task_accept(
            client=client,
            request=request,
            spec=spec,
            on_restart=on_restart,
            notify_webhooks=True,
            continuation=continuation,
            conversation=conversation,
        )
        task = accepted.task
        reply = Reply(202, task_object(task, accepted.queue_position), {"Location": task_location(task.id)})
        if claim is not None:
            idempotency_complete(
                record=claim.record, status=reply.status, body=reply.body, headers=reply.headers, task_id=task.id
            )
    return reply


def task_abandon(*, task_id: str) -> None:
    """Cancel the task of a client that went away and cannot come back for it (a chat completion, an
    unkeyed Messages stream, an Ollama answer: none has an id to follow again); one that ended stays."""
    task = Task.objects.filter(pk=task_id).first()
    if task is None:
        return
    try:
        task_cancel(task=task)
    except TaskNotCancelable:
        pass


def task_cancel(*, task: Task) -> Task:
    """Cancel a task (chapter 7.3) and return its current state.

    queued -> cancelled at once; loading/running -> cancelling (the worker
    finishes the move); cancelling/cancelled -> unchanged; succeeded/failed ->
    ``TaskNotCancelable``. Each attempt is a compare-and-set, so a cancel that
    races a worker simply retries against the state that won.
    """
    current = task
    for _ in range(5):
        if current.status in states.CANCELABLE_AT_ONCE:
            result = lifecycle.task_cancel_queued(task_id=task.id)
        elif current.status in states.CANCELABLE_VIA_BACKEND:
            result = lifecycle.task_request_cancel(task_id=task.id, sources=[current.status])
        elif current.status in states.CANCEL_UNDER_WAY:
            return current
        else:
            raise TaskNotCancelable(f"task {task.id} already {current.status}")
        current = result.task
        if result.won:
            return current
    # Five lost races in a row means the task moves faster than we read it;
    # what we report is still a state it really had.
    return current


def task_rerun(*, task: Task) -> Task:
    """A new queued task from ``task``'s request (the same client, generation spec, protocol and policy),
    linked to it by ``rerun_of``, dispatched once it commits; ``task`` stays as it is.

    Only a failed or cancelled task (``TaskNotRerunnable`` otherwise), on a model that is still
    registered (``ModelNotFound``); the caller audits it.
    """
    if task.status not in states.RERUNNABLE:
        raise TaskNotRerunnable(f"task {task.id} is {task.status}: only a failed or cancelled task runs again")
    response = task.response
    if response.generation is None:
        raise TaskNotRerunnable(f"task {task.id} was stored without a generation spec; send its request again")
    model = model_get_by_name(response.model)
    with transaction.atomic():
        rerun = lifecycle.task_insert(
            client=task.client,
            request=response.request,
            generation=response.generation,
            model=model.name,
            on_restart=RestartPolicy(task.on_restart),
            metadata=response.metadata,
            notify_webhooks=task.notify_webhooks,
            protocol=Protocol(response.protocol),
            rerun_of=task,
        )
        task_dispatch_on_commit(task_id=rerun.id)
    return rerun
