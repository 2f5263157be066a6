"""The task list's filters: status (``incomplete`` apart), error code, time, heartbeat (the stuck view), worker node,
model, batch."""

from __future__ import annotations

import time
from datetime import timedelta

from django.conf import settings
from django.contrib import admin
from django.db.models import Q, QuerySet, TextField
from django.db.models.functions import Cast
from django.http import HttpRequest
from django.utils import timezone

from tasks_app import states
from tasks_app.admin.filters import ModelNameFilter
from tasks_app.ids import TASK_PREFIX, ulid_floor
from tasks_app.models import Task
from tasks_app.plumbing.querying import status_in
from tasks_app.selectors import tasks as selectors
from tasks_app.states import ResponseStatus, TaskStatus

# The status filter's and the status column's name for a succeeded task whose response is incomplete.
INCOMPLETE = "incomplete"


class TaskModelFilter(ModelNameFilter):
    field_path = "response__model"


class TaskStatusFilter(admin.SimpleListFilter):
    """Filter by status through ``status_in``, so that SQLite reads the few
    unfinished tasks from the partial index instead of walking every task
    (a page of queued tasks among 200,000 finished ones: 62 ms -> 1 ms)."""

    title = "status"
    parameter_name = "status"

    def lookups(self, request: HttpRequest, model_admin: admin.ModelAdmin) -> list[tuple[str, str]]:
        choices = list(TaskStatus.choices)
        at = choices.index((TaskStatus.SUCCEEDED, TaskStatus.SUCCEEDED.label)) + 1
        return [*choices[:at], (INCOMPLETE, "succeeded, incomplete (at a limit)"), *choices[at:]]

    def queryset(self, request: HttpRequest, queryset: QuerySet) -> QuerySet:
        value = self.value()
        if value == INCOMPLETE:
            return queryset.filter(status=TaskStatus.SUCCEEDED, response__status=ResponseStatus.INCOMPLETE)
        if value not in TaskStatus.values:
            return queryset
        return queryset.filter(status_in([value]))


class TaskErrorCodeFilter(admin.SimpleListFilter):
    """The failed tasks with one problem code (the codes a run or recovery fails a task with)."""

    title = "error code"
    parameter_name = "error"
    CODES = (
        "server_restarted",
        "backend_error",
        "model_load_failed",
        "context_length_exceeded",
        "invalid_request",
        "internal_error",
    )

    def lookups(self, request: HttpRequest, model_admin: admin.ModelAdmin) -> list[tuple[str, str]]:
        return [(code, code) for code in self.CODES]

    def queryset(self, request: HttpRequest, queryset: QuerySet) -> QuerySet:
        value = self.value()
        if not value:
            return queryset
        # ``error`` is the problem as compact JSON text (JSONTextField): its code is this exact member.
        # Cast: the field's own lookups would encode the pattern as JSON.
        text = Cast("error", TextField())
        return (
            queryset.filter(status=TaskStatus.FAILED)
            .alias(error_text=text)
            .filter(error_text__contains=f'"code":"{value}"')
        )


class TaskCreatedFilter(admin.SimpleListFilter):
    """Tasks created within a window: a range of ids (ULIDs begin with their time), so the primary key serves it."""

    title = "created"
    parameter_name = "created"
    WINDOWS = {
        "5m": ("in the last 5 minutes", 300),
        "1h": ("in the last hour", 3600),
        "24h": ("in the last 24 hours", 86400),
    }
    WINDOWS |= {"7d": ("in the last 7 days", 7 * 86400)}
    OLDER = "older"

    def lookups(self, request: HttpRequest, model_admin: admin.ModelAdmin) -> list[tuple[str, str]]:
        return [*((key, label) for key, (label, _) in self.WINDOWS.items()), (self.OLDER, "earlier than 7 days ago")]

    def queryset(self, request: HttpRequest, queryset: QuerySet) -> QuerySet:
        value = self.value()
        if value == self.OLDER:
            return queryset.filter(id__lt=TASK_PREFIX + ulid_floor(int((time.time() - 7 * 86400) * 1000)))
        if value not in self.WINDOWS:
            return queryset
        since = time.time() - self.WINDOWS[value][1]
        return queryset.filter(id__gte=TASK_PREFIX + ulid_floor(int(since * 1000)))


class TaskHeartbeatFilter(admin.SimpleListFilter):
    """The stuck view: held tasks whose worker has written no heartbeat for ``LMSP_HEARTBEAT_SILENT_SECONDS``."""

    title = "heartbeat"
    parameter_name = "heartbeat"
    SILENT = "silent"
    PAST_TIMEOUT = "past_timeout"

    def lookups(self, request: HttpRequest, model_admin: admin.ModelAdmin) -> list[tuple[str, str]]:
        return [
            (self.SILENT, f"silent (none for {settings.LMSP_HEARTBEAT_SILENT_SECONDS} s): stuck"),
            (self.PAST_TIMEOUT, f"past the reaper's timeout ({settings.LMSP_HEARTBEAT_TIMEOUT_SECONDS} s)"),
        ]

    def queryset(self, request: HttpRequest, queryset: QuerySet) -> QuerySet:
        seconds = {
            self.SILENT: settings.LMSP_HEARTBEAT_SILENT_SECONDS,
            self.PAST_TIMEOUT: settings.LMSP_HEARTBEAT_TIMEOUT_SECONDS,
        }.get(self.value() or "")
        if seconds is None:
            return queryset
        before = timezone.now() - timedelta(seconds=seconds)
        return queryset.filter(status_in(states.HELD), heartbeat_at__lt=before)


class TaskWorkerFilter(admin.SimpleListFilter):
    """``?worker=<node>``: the tasks a worker node holds now (the workers page links here)."""

    title = "worker node"
    parameter_name = "worker"

    def lookups(self, request: HttpRequest, model_admin: admin.ModelAdmin) -> list[tuple[str, str]]:
        value = self.value()
        return [(value, value)] if value else []

    def queryset(self, request: HttpRequest, queryset: QuerySet) -> QuerySet:
        value = self.value()
        if not value:
            return queryset
        # ``<node>/<pid>``: the node's processes (a worker named without a pid is its own node).
        return queryset.filter(status_in(states.HELD)).filter(Q(worker=value) | Q(worker__startswith=f"{value}/"))


class TaskBatchFilter(admin.SimpleListFilter):
    """``?batch=<task id>``: that task and the tasks sharing its batch (its list cell links here).

    No choice list of its own: the batches change with every step of the workers.
    """

    title = "batch"
    parameter_name = "batch"

    def lookups(self, request: HttpRequest, model_admin: admin.ModelAdmin) -> list[tuple[str, str]]:
        value = self.value()
        return [(value, f"with {value}")] if value else []

    def queryset(self, request: HttpRequest, queryset: QuerySet) -> QuerySet:
        value = self.value()
        if not value:
            return queryset
        task = Task.objects.select_related("response").only("id", "status", "worker", "response__model")
        task = task.filter(pk=value).first()
        peers = selectors.task_batch_peers(task=task) if task is not None else []
        return queryset.filter(pk__in=[value, *(peer.pk for peer in peers)])
