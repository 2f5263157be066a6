"""The Celery app: a Redis broker carrying task ids to workers.

Settings come from Django settings with the ``CELERY_`` prefix; the reasons
for acks, prefetch and the visibility timeout are in docs/workers.md.

Beat schedules three periodic jobs on their own queue
(``LMSP_MAINTENANCE_QUEUE``), which the beat node consumes itself, so that a
worker busy with an hour-long generation never delays them: the sweeper
(re-dispatches waiting tasks whose message may be lost), the reaper (applies
the restart policy to tasks whose worker stopped reporting) and the retention
cleanup. See docs/recovery.md.

The names of the Celery tasks are set here, with the app that schedules
them; everything else reaches them (and the app) through
``tasks_app.plumbing.broker``, the one module that imports this one.
"""

from __future__ import annotations

import os

from celery import Celery

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "lmsp_project.settings")

RUN_TASK = "lmsp.run_task"
"""Runs one task: its only argument is the task id."""
SWEEP_TASK = "lmsp.sweep_queued"
"""Re-sends waiting tasks whose message may be lost."""
REAP_TASK = "lmsp.reap_abandoned"
"""Applies the restart policy to tasks whose worker stopped reporting."""
CLEANUP_TASK = "lmsp.cleanup"
"""Deletes what retention no longer keeps."""

app = Celery("lmsp_project")
app.config_from_object("django.conf:settings", namespace="CELERY")
# workers.shutdown: one line per task a stop interrupts, instead of tracebacks. workers.presence: the
# node's own queue and its presence (tasks_app.plumbing.affinity).
app.conf.imports = ("workers.tasks", "workers.shutdown", "workers.presence", "workers.node_report")


@app.on_after_finalize.connect
def _schedule_maintenance(sender: Celery, **kwargs: object) -> None:
    # Imported here: Django's settings are configured by the time the app is finalized.
    from django.conf import settings

    jobs = (
        ("sweep waiting tasks", SWEEP_TASK, settings.LMSP_SWEEP_INTERVAL_SECONDS),
        ("reap abandoned tasks", REAP_TASK, settings.LMSP_REAP_INTERVAL_SECONDS),
        ("retention cleanup", CLEANUP_TASK, settings.LMSP_CLEANUP_INTERVAL_SECONDS),
    )
    for name, task, seconds in jobs:
        interval = float(seconds)
        # A run waiting in the queue is worthless once the next one is due;
        # expiring it keeps beat from piling them up while the node is down.
        options = {"expires": interval, "queue": settings.LMSP_MAINTENANCE_QUEUE}
        sender.add_periodic_task(interval, sender.signature(task, options=options), name=name)
