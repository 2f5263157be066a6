"""A worker node's report of itself, for the admin's workers page (``tasks_app.services.workers``).

Once the node is ready, a thread of its main process writes its row every
``LMSP_WORKER_REPORT_SECONDS``: its process, pool and version, the models
its engine process has loaded and on which execution provider, and each
engine's rows, waiting rows and tokens/s (``workers.run_metrics``). The
report is what stops when the node is frozen (SIGSTOP), cut off from the
database or killed, so the page shows it silent within
``LMSP_WORKER_SILENT_SECONDS``, long before the reaper's heartbeat timeout.
A stop says ``draining`` at once and ``stopped`` at exit. With
``LMSP_WORKER_REPORT_SECONDS`` 0 the node does not report itself (the page
does not list it).

Only task workers report (not the maintenance node). A prefork node's
engines live in its pool processes, which this thread cannot see: it
reports none. The model thread never waits on this: the thread only reads
numbers the engines keep in memory.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
from datetime import datetime
from typing import Any

from celery.signals import celeryd_after_setup, worker_ready, worker_shutdown, worker_shutting_down
from django.conf import settings
from django.db import connection
from django.utils import timezone

from tasks_app.metrics.store import RateLimitedWarning
from tasks_app.models import WorkerNodeState
from tasks_app.plumbing.database_outages import database_outage

logger = logging.getLogger(__name__)
_warning = RateLimitedWarning(logger)

_node = ""
_pool = ""
_concurrency = 1
_started_at: datetime | None = None
_state = WorkerNodeState.ONLINE
_wake = threading.Event()
_stopped = threading.Event()
_report_lock = threading.Lock()


def _hold_reports_across_fork() -> None:
    """A prefork node forks a new pool process whenever one dies: never in the middle of a report.

    SQLite keeps its locks' bookkeeping in process-wide memory, which a fork copies: a pool process forked
    while this thread held the write lock believed forever after that another connection of its own held
    it, and every write it tried was ``database is locked`` (test_recovery's dead pool process, 2026-12-07).
    The report runs under ``_report_lock``, so taking it around the fork keeps every fork between reports.
    """
    os.register_at_fork(
        before=_report_lock.acquire, after_in_parent=_report_lock.release, after_in_child=_report_lock.release
    )


@celeryd_after_setup.connect
def _remember_node(sender: str, instance: Any, **kwargs: object) -> None:
    global _node, _pool, _concurrency, _started_at
    if settings.LMSP_TASK_QUEUE not in instance.app.amqp.queues.consume_from:
        return  # the maintenance node runs no task
    pool = str(getattr(instance, "pool_cls", "")).lower()
    _node, _started_at = sender, timezone.now()
    _pool = next((name for name in ("threads", "prefork", "solo", "gevent", "eventlet") if name[:4] in pool), pool)
    _concurrency = int(getattr(instance, "concurrency", 1) or 1)


def _reports() -> bool:
    """Whether this node reports itself (``LMSP_WORKER_REPORT_SECONDS`` 0: it does not)."""
    return bool(_node) and settings.LMSP_WORKER_REPORT_SECONDS > 0


@worker_ready.connect
def _start(**kwargs: object) -> None:
    if _reports():
        if _pool == "prefork":
            _hold_reports_across_fork()
        threading.Thread(target=_keep_reporting, name="lmsp-node-report", daemon=True).start()


@worker_shutting_down.connect
def _draining(**kwargs: object) -> None:
    """Runs inside the stop's signal handler: it only flags the thread, which reports at once."""
    global _state
    _state = WorkerNodeState.DRAINING
    _wake.set()


@worker_shutdown.connect
def _stop(**kwargs: object) -> None:
    global _state
    if not _reports():
        return
    _state = WorkerNodeState.STOPPED
    _stopped.set()
    _wake.set()
    _report()


def _engines() -> list[dict[str, Any]]:
    if _pool != "threads":
        return []
    # Imported here: the main process of a prefork node never loads the engines' modules.
    from workers.model_cache import model_cache
    from workers.run_metrics import recorder

    devices = model_cache().loaded()
    readings = {str(reading["model"]): reading for reading in recorder().engine_readings()}
    return [
        {
            "model": model,
            "device": devices.get(model, ""),
            "rows": int(readings.get(model, {}).get("rows", 0)),
            "waiting": int(readings.get(model, {}).get("waiting", 0)),
            "tokens_per_s": float(readings.get(model, {}).get("tokens_per_s", 0.0)),
        }
        for model in sorted(set(devices) | set(readings))
    ]


def _max_rows() -> int:
    if _pool != "threads":
        return _concurrency  # one row per pool process
    from workers.engines import max_rows

    return max_rows()


def _report() -> None:
    from tasks_app.services.workers import worker_node_report

    if database_outage() is not None and _state != WorkerNodeState.STOPPED:
        # The commits' retries find the end of an outage: a report that reached the database on a connection
        # of its own would end this process's outage early, and the next failure start another (one line
        # per outage: docs/recovery.md). A silent node during an outage is what the page should show. Its
        # connection, which the outage may have cut, is closed: the next report opens a new one.
        connection.close()
        return
    with _report_lock:
        # A connection an outage cut between two reports (which then saw none of it) is dropped unseen: its
        # first statement would otherwise fail after the end and start a second outage in the log.
        if connection.connection is not None and not connection.is_usable():
            connection.close()
        try:
            worker_node_report(
                name=_node,
                hostname=socket.gethostname(),
                pid=os.getpid(),
                pool=_pool,
                state=_state,
                started_at=_started_at or timezone.now(),
                max_rows=_max_rows(),
                engines=_engines(),
            )
        except Exception as exc:  # a report lost to an outage is written again next round; the node goes on
            _warning("worker node %s: report not written: %s", _node, exc)
            connection.close()


def _keep_reporting() -> None:
    try:
        while not _stopped.is_set():
            _report()
            _wake.wait(settings.LMSP_WORKER_REPORT_SECONDS)
            _wake.clear()
    finally:
        connection.close()
