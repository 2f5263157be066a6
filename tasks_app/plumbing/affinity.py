"""Where a continued conversation is sent: the worker that holds its prefix cache (issue 29, point 3).

A worker's engines keep the cache of the prompts and answers they ran
(``workers/backends/onnx/prefix_cache.py``), so a response that continues
another (``previous_response_id``) starts at once on the worker that ran the
one before it, and from scratch anywhere else. Each worker node consumes a
queue of its own beside the shared one (``affinity_queue``: the shared name,
``@``, the node) and, while it is alive and has a free place, keeps its
presence in Redis (``<prefix>:affinity:<task queue>:<node>``, the free
places, a short TTL) fresh. A continued conversation's run message goes to the queue of the
node that ran its previous response when that presence says it has room,
and to the shared queue otherwise: a node that died, is draining or is full
gets nothing routed to it.

A conversation the client echoes back (no ``previous_response_id``) is
known by its ``prompt_cache_key`` when it sends one (OpenAI's routing hint
for its prompt cache; Codex CLI sends its session id, so every turn of a
session and ``codex exec resume`` name it alike), else by its beginning:
``GenerationSpec.conversation_key`` hashes what a prompt starts with (model,
system text, tools, the first turn), which every turn of one
conversation repeats. A worker that starts a task records its node
under that key (``affinity_remember``, an hour's TTL), and a later request
with the same beginning that carries turns before its own
(``GenerationSpec.continues_conversation``) prefers that node, on the same terms; a first
turn goes to the shared queue. The web
never tokenizes: the key is over the request's turns, not its tokens.

Nothing here decides who runs a task: the message is a hint as every run
message is, and the claim's compare-and-set in the database decides. A
routed message that waits too long (its node stopped right after the
presence was read) is sent again to the shared queue by the sweeper, whose
check of the broker reads only that queue, after its grace period; the
second message is dropped by whichever claim loses.
"""

from __future__ import annotations

import logging

import redis
from django.conf import settings

from tasks_app.plumbing.notify import key, redis_client

logger = logging.getLogger(__name__)

# A presence this old is gone: a node refreshes it every PRESENCE_REFRESH_SECONDS.
PRESENCE_TTL_SECONDS = 5
PRESENCE_REFRESH_SECONDS = 1.0
# How long a conversation's beginning points at the node that last ran it: an agent's next turn comes
# within minutes; a longer gap finds a cache that was probably evicted anyway.
CONVERSATION_TTL_SECONDS = 3600


def node_of(worker: str) -> str:
    """The node (Celery's hostname) of a task's ``worker`` (``<node>/<pid>``)."""
    return worker.rpartition("/")[0] or worker


def affinity_queue(node: str) -> str:
    """The queue only ``node`` consumes, beside the shared task queue."""
    return f"{settings.LMSP_TASK_QUEUE}@{node}"


# The keys name the task queue: a web routes only to nodes of its own queue (several queues may share one
# Redis prefix), and a node's own queue is named from the same setting.
def _presence(node: str) -> str:
    return key("affinity", settings.LMSP_TASK_QUEUE, node)


def affinity_announce(*, node: str, room: int) -> None:
    """``node`` is alive with ``room`` free places (0: alive but full, nothing is routed to it)."""
    try:
        redis_client().set(_presence(node), str(max(0, room)), ex=PRESENCE_TTL_SECONDS)
    except redis.RedisError as exc:
        # Without a presence the node's conversations go to the shared queue: slower, never lost.
        logger.debug("could not announce node %s: %s", node, exc)


def affinity_withdraw(*, node: str) -> None:
    """``node`` stops: route nothing more to it."""
    try:
        redis_client().delete(_presence(node))
    except redis.RedisError:
        pass


def _conversation(conversation: str) -> str:
    return key("affinity-conversation", settings.LMSP_TASK_QUEUE, conversation)


def affinity_remember(*, conversation: str, worker: str) -> None:
    """``worker``'s node runs a task of ``conversation`` (a conversation key): later turns prefer it.
    Never raises."""
    if not conversation:
        return
    try:
        redis_client().set(_conversation(conversation), node_of(worker), ex=CONVERSATION_TTL_SECONDS)
    except redis.RedisError as exc:
        logger.debug("could not remember the node of conversation %s: %s", conversation, exc)


def affinity_queue_of_conversation(*, conversation: str) -> str | None:
    """The queue of the node that last ran a task of ``conversation`` (``GenerationSpec.conversation_key``),
    if that node is alive and has room; else None. Never raises."""
    if not conversation or not settings.LMSP_AFFINITY:
        return None
    try:
        node = redis_client().get(_conversation(conversation))
    except redis.RedisError:
        return None
    return affinity_queue_for(worker=node.decode()) if node else None


def affinity_route(*, worker: str, conversation: str) -> str | None:
    """Where a new task's run message goes (None: the shared queue): the node of ``worker`` (that ran the
    response it continues), else the node that last ran its ``conversation``, if it is alive with room."""
    return affinity_queue_for(worker=worker) or affinity_queue_of_conversation(conversation=conversation)


def affinity_queue_for(*, worker: str) -> str | None:
    """The queue of the node that ran ``worker``'s task, if that node is alive and has room; else None
    (the shared queue). Never raises: without Redis there is no routing."""
    if not worker or not settings.LMSP_AFFINITY:
        return None
    node = node_of(worker)
    try:
        room = redis_client().get(_presence(node))
    except redis.RedisError:
        return None
    try:
        return affinity_queue(node) if room is not None and int(room) > 0 else None
    except ValueError:
        return None
