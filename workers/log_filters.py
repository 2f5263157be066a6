"""Keeps the periodic maintenance jobs out of the INFO log unless they did something.

Beat sends the sweeper, the reaper and the retention cleanup every few
seconds, and Celery logs three lines per round ("Sending due task", "Task …
received", "Task … succeeded in …") whatever the round did: close to half
of all lines of an idle installation. The jobs log themselves when they act
(re-dispatched, reaped, deleted) and Celery logs their failures at ERROR;
the routine lines go only where the root logger is at DEBUG
(``LMSP_LOG_LEVEL=DEBUG``). Attached to Celery's loggers by ``LOGGING`` in
the settings.
"""

from __future__ import annotations

import logging
from functools import cache


@cache
def _maintenance_tasks() -> frozenset[str]:
    # Imported on first use: the settings configure logging before the apps are ready.
    from tasks_app.plumbing.broker import CLEANUP_TASK, REAP_TASK, SWEEP_TASK

    return frozenset({SWEEP_TASK, REAP_TASK, CLEANUP_TASK})


def _task_name(record: logging.LogRecord) -> str | None:
    """The Celery task a record is about: its context dict (worker, trace) or beat's (entry, task name)."""
    args = record.args
    if isinstance(args, dict):
        return str(args.get("name", ""))
    if isinstance(args, tuple) and len(args) == 2 and record.name == "celery.beat":
        return str(args[1])
    return None


class MaintenanceChatterFilter(logging.Filter):
    """Drops Celery's routine INFO lines about the maintenance jobs unless the root logs DEBUG."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno > logging.INFO or _task_name(record) not in _maintenance_tasks():
            return True
        return logging.getLogger().isEnabledFor(logging.DEBUG)
