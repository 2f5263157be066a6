"""Worker nodes: their own reports of themselves (the admin's workers page), and an operator's hand-back.

A node reports every ``LMSP_WORKER_REPORT_SECONDS`` (``workers.node_report``):
its process, version, pool, the models it has loaded and on which device,
their rows and tokens/s. The time of the report is the heartbeats' clock (the
database's, on PostgreSQL), so a report's age means the same on every host.
A node whose report is older than ``LMSP_WORKER_SILENT_SECONDS`` is silent:
frozen, cut off or dead, long before the reaper's heartbeat timeout.
"""

from __future__ import annotations

import functools
import subprocess
import tomllib
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

from django.conf import settings

from tasks_app.models import WorkerNode, WorkerNodeState
from tasks_app.plumbing.db_locks import clock_now


@functools.cache
def service_version() -> str:
    """This checkout's version: pyproject's, and the commit when the code is a git checkout."""
    try:
        with open(settings.BASE_DIR / "pyproject.toml", "rb") as file:
            version = tomllib.load(file)["project"]["version"]
    except (OSError, KeyError, tomllib.TOMLDecodeError):
        version = "unknown"
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            cwd=settings.BASE_DIR,
            capture_output=True,
            text=True,
            timeout=5,
            check=False,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        commit = ""
    return f"{version} ({commit})" if commit else version


def worker_node_report(
    *,
    name: str,
    hostname: str,
    pid: int,
    pool: str,
    state: WorkerNodeState,
    started_at: datetime,
    max_rows: int,
    engines: Sequence[Mapping[str, Any]],
) -> None:
    """Node ``name`` as it is now: one UPDATE (an INSERT the first time)."""
    columns = {
        "hostname": hostname[:200],
        "pid": pid,
        "version": service_version()[:50],
        "pool": pool[:50],
        "state": state,
        "started_at": started_at,
        "reported_at": clock_now(),
        "max_rows": max_rows,
        "engines": [dict(engine) for engine in engines],
    }
    if WorkerNode.objects.filter(pk=name).update(**columns) == 0:
        # Two reports of one new node never race: one thread of one process reports it.
        WorkerNode.objects.create(name=name, **columns)


def worker_nodes_forget(*, before: datetime) -> int:
    """Nodes that have not reported since ``before`` (stopped or gone long ago): deleted; how many."""
    return WorkerNode.objects.filter(reported_at__lt=before).delete()[0]
