"""A web process's sender of run messages: the broker round trips leave the request.

``POST /tasks`` commits the task, then (``task_dispatch_on_commit``) hands its
id to this thread and answers ``202`` without waiting for Redis: the task is
durable either way, and a message that is never sent (Redis down, the
process gone before the send) is the sweeper's job, as it always was for a
send that failed. Ids waiting together go out together, their dispatch
markers in one round trip.

Only a process that starts the sender (the web entry point,
``lmsp_project.asgi``) uses it; elsewhere (workers, the maintenance node,
``lmsp_recover``, tests in one process) dispatch stays inline at commit.
"""

from __future__ import annotations

import atexit
import logging
import queue
import threading

from tasks_app.plumbing import broker
from tasks_app.plumbing.affinity import affinity_route

logger = logging.getLogger(__name__)

# Ids sent per round; the markers of a round are set in one pipeline.
BATCH = 100
# Ids waiting at most; beyond that (Redis hangs) they are left to the sweeper.
BACKLOG = 10_000
# At exit, how long the ids still waiting may take to go out.
DRAIN_SECONDS = 2.0

_STOP = object()
_lock = threading.Lock()
_queue: queue.Queue | None = None
_thread: threading.Thread | None = None


def dispatch_sender_start() -> None:
    """Start this process's sender (once); from now on dispatch after commit goes through it."""
    global _queue, _thread
    with _lock:
        if _thread is not None:
            return
        _queue = queue.Queue(maxsize=BACKLOG)
        _thread = threading.Thread(target=_run, args=(_queue,), name="lmsp-dispatch", daemon=True)
        _thread.start()
        atexit.unregister(dispatch_sender_stop)  # once, however often it was started
        atexit.register(dispatch_sender_stop)


def dispatch_sender_submit(*, task_id: str, prefer_worker: str = "", conversation: str = "") -> bool:
    """Queue ``task_id`` for sending (to the node ``tasks_app.plumbing.affinity`` prefers, if it has room);
    False when this process has no sender (the caller sends inline)."""
    pending = _queue
    if pending is None:
        return False
    try:
        pending.put_nowait((task_id, prefer_worker, conversation))
    except queue.Full:
        logger.warning("dispatch backlog full; task %s is left to the sweeper", task_id)
    return True


def dispatch_sender_stop(*, timeout: float = DRAIN_SECONDS) -> None:
    """Send what is waiting (for at most ``timeout`` seconds), then stop the sender."""
    global _queue, _thread
    with _lock:
        pending, thread, _queue, _thread = _queue, _thread, None, None
    if thread is None or pending is None:
        return
    try:
        pending.put(_STOP, timeout=timeout)
    except queue.Full:
        return
    thread.join(timeout)


def _run(pending: queue.Queue) -> None:
    while True:
        batch = [pending.get()]
        while len(batch) < BATCH:
            try:
                batch.append(pending.get_nowait())
            except queue.Empty:
                break
        stop = _STOP in batch
        try:
            _send([item for item in batch if item is not _STOP])
        except Exception:  # the thread must outlive any one round
            logger.exception("dispatch round failed (the sweeper will retry its tasks)")
        if stop:
            return


def _send(items: list[tuple[str, str, str]]) -> None:
    """Send each ``(task id, preferred worker, conversation key)``."""
    if not items:
        return
    task_ids = [task_id for task_id, _, _ in items]
    # Markers first (one round trip): a worker that takes a message at once clears a marker already there.
    broker.dispatch_markers_set(task_ids=task_ids)
    for index, (task_id, prefer_worker, conversation) in enumerate(items):
        try:
            queue = affinity_route(worker=prefer_worker, conversation=conversation)
            broker.run_message_send(task_id=task_id, queue=queue)
        except broker.UNREACHABLE as exc:
            # The rest would fail the same way, each after its own timeout.
            left = task_ids[index:]
            broker.dispatch_markers_clear(task_ids=left)
            logger.warning(
                "could not dispatch %d task(s) (the sweeper will retry): %s: %s", len(left), ", ".join(left[:10]), exc
            )
            break
