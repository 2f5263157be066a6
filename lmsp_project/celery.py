"""The Celery app: a Redis broker carrying task ids to workers.

Settings come from Django settings with the ``CELERY_`` prefix; the reasons
for acks, prefetch and the visibility timeout are in docs/workers.md. Beat
runs one periodic job, the sweeper that re-dispatches queued tasks whose
message may have been lost.
"""

from __future__ import annotations

import os

from celery import Celery

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "lmsp_project.settings")

app = Celery("lmsp_project")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.conf.imports = ("workers.tasks",)


@app.on_after_finalize.connect
def _schedule_sweeper(sender: Celery, **kwargs: object) -> None:
    from django.conf import settings

    interval = float(settings.LMSP_SWEEP_INTERVAL_SECONDS)
    # A sweep waiting behind busy workers is worthless once the next one is
    # due; expiring it keeps beat from piling them up in the queue.
    sender.add_periodic_task(
        interval, sender.signature("lmsp.sweep_queued", options={"expires": interval}), name="sweep queued tasks"
    )
