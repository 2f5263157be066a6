"""A worker node's side of routing (``tasks_app.plumbing.affinity``): a queue of its own, and its presence.

At start (``celeryd_after_setup``, after ``--queues`` applied) a node that
consumes the task queue also consumes ``affinity_queue(node)``, where the web sends the conversations
whose previous response it ran. Once ready, a thread of the node's main
process keeps its presence fresh every ``PRESENCE_REFRESH_SECONDS`` with the
places it has free: a threads-pool node (the Procfile's) counts its run
loop's rows against ``LMSP_MAX_BATCH`` (0 when an engine holds a row back for
its KV budget); a prefork node, whose pool processes the main process cannot
count, says 1 while it runs (a routed message then waits for a free pool
process, or for the sweeper's fallback). From a stop on it says nothing:
its presence is removed and nothing more is routed to it.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from celery.signals import celeryd_after_setup, worker_ready, worker_shutting_down
from django.conf import settings

from tasks_app.plumbing.affinity import PRESENCE_REFRESH_SECONDS, affinity_announce, affinity_queue, affinity_withdraw

logger = logging.getLogger(__name__)

_node = ""
_threads_pool = False
_stopping = threading.Event()


@celeryd_after_setup.connect
def _consume_own_queue(sender: str, instance: Any, **kwargs: object) -> None:
    global _node, _threads_pool
    queues = instance.app.amqp.queues
    if settings.LMSP_TASK_QUEUE not in queues.consume_from:
        return  # not a task worker (the maintenance node): nothing is ever routed to it
    _node = sender
    _threads_pool = "thread" in str(getattr(instance, "pool_cls", "")).lower()
    queues.select_add(affinity_queue(sender))


@worker_ready.connect
def _start_presence(**kwargs: object) -> None:
    if not _node:
        return
    threading.Thread(target=_keep_presence, name="lmsp-affinity", daemon=True).start()


@worker_shutting_down.connect
def _withdraw(**kwargs: object) -> None:
    """Runs inside the stop's signal handler: it only flags the thread, which removes the presence."""
    _stopping.set()


def node_room() -> int:
    """Places this node has free for another row now."""
    if not _threads_pool:
        return 1
    # Imported here: the main process of a prefork node never loads the engine's modules.
    from workers.engines import draining, engines_full, max_rows
    from workers.run_rows import run_loop_taken

    if draining() or engines_full():
        return 0
    return max(0, max_rows() - run_loop_taken())


def _keep_presence() -> None:
    while True:
        try:
            affinity_announce(node=_node, room=node_room())
        except Exception:  # the thread must outlive any one round: without it the node only gets less
            logger.exception("the presence of node %s was not refreshed", _node)
        if _stopping.wait(PRESENCE_REFRESH_SECONDS):
            affinity_withdraw(node=_node)
            return
