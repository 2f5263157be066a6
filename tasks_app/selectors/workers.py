"""Reads of the workers page: each node's tasks, and which of them went silent."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from datetime import datetime, timedelta

from django.conf import settings
from django.db.models import Count, Q, Sum
from django.utils import timezone

from tasks_app import states
from tasks_app.models import Task, WorkerNode, WorkerNodeState
from tasks_app.plumbing.affinity import node_of
from tasks_app.plumbing.querying import status_in


@dataclass(frozen=True)
class NodeTasks:
    """The tasks the processes of one node hold now, and how many of them have a silent heartbeat."""

    held: int = 0
    silent: int = 0


@dataclass(frozen=True)
class WorkerOverview:
    """Every node's held tasks, from one grouped query over the unfinished tasks' partial index."""

    by_node: dict[str, NodeTasks] = field(default_factory=dict)

    def of(self, node: str) -> NodeTasks:
        return self.by_node.get(node, NodeTasks())


def held_tasks_by_node(*, now: datetime | None = None) -> WorkerOverview:
    """Held tasks per node, and those whose heartbeat is older than ``LMSP_HEARTBEAT_SILENT_SECONDS``."""
    silent_before = (now or timezone.now()) - timedelta(seconds=settings.LMSP_HEARTBEAT_SILENT_SECONDS)
    rows = (
        Task.objects.filter(status_in(states.HELD))
        .exclude(worker="")
        .values("worker")
        .annotate(held=Count("id"), silent=Count("id", filter=Q(heartbeat_at__lt=silent_before)))
    )
    held: Counter[str] = Counter()
    silent: Counter[str] = Counter()
    for row in rows:
        node = node_of(row["worker"])
        held[node] += row["held"]
        silent[node] += row["silent"]
    return WorkerOverview({node: NodeTasks(held[node], silent[node]) for node in held})


def worker_node_report_age(*, node: WorkerNode, now: datetime | None = None) -> float:
    """Seconds since the node's newest report."""
    return max(0.0, ((now or timezone.now()) - node.reported_at).total_seconds())


def worker_node_liveness(*, node: WorkerNode, now: datetime | None = None) -> str:
    """``online``, ``draining``, ``stopped`` (as it said), or ``silent`` when its report is overdue."""
    if node.state == WorkerNodeState.STOPPED:
        return "stopped"
    if worker_node_report_age(node=node, now=now) > settings.LMSP_WORKER_SILENT_SECONDS:
        return "silent"
    return str(node.state)


def worker_rows_online(*, now: datetime | None = None) -> tuple[int, int]:
    """The rows of the task workers that report themselves online now, and how many such workers there are."""
    fresh = (now or timezone.now()) - timedelta(seconds=settings.LMSP_WORKER_SILENT_SECONDS)
    totals = WorkerNode.objects.filter(state=WorkerNodeState.ONLINE, reported_at__gte=fresh).aggregate(
        rows=Sum("max_rows"), nodes=Count("pk")
    )
    return int(totals["rows"] or 0), int(totals["nodes"] or 0)
