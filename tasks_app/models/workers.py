"""Worker nodes as they report themselves (``workers.node_report``)."""

from __future__ import annotations

from django.db import models
from django.db.models import Q

from tasks_app.fields import JSONTextField


class WorkerNodeState(models.TextChoices):
    ONLINE = "online", "online"
    DRAINING = "draining", "draining (shutting down)"
    STOPPED = "stopped", "stopped"


class WorkerNode(models.Model):
    """A worker node's own report of itself, refreshed every ``LMSP_WORKER_REPORT_SECONDS`` (``workers.node_report``).

    What the admin's workers page shows: a node whose report stopped is silent
    (frozen, cut off or killed) even before the reaper's heartbeat timeout.
    """

    name = models.CharField(max_length=200, primary_key=True, help_text="Celery's node name")
    hostname = models.CharField(max_length=200)
    pid = models.IntegerField()
    version = models.CharField(max_length=50)
    pool = models.CharField(max_length=50, help_text="Celery's pool (threads: one process runs every row)")
    state = models.CharField(max_length=20, choices=WorkerNodeState.choices, default=WorkerNodeState.ONLINE)
    started_at = models.DateTimeField()
    reported_at = models.DateTimeField(help_text="Its newest report, on the clock heartbeats are written with")
    max_rows = models.IntegerField(default=0, help_text="Rows it runs at once")
    engines = JSONTextField(default=list, help_text="Per loaded model: device, rows, waiting, tokens/s")

    class Meta:
        db_table = "worker_nodes"
        constraints = [
            models.CheckConstraint(condition=Q(state__in=WorkerNodeState.values), name="worker_node_state_valid"),
        ]

    def __str__(self) -> str:
        return self.name
