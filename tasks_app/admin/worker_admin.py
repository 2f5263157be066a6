"""The workers page: every worker node as it last reported itself, and whether it went silent.

A node reports every ``LMSP_WORKER_REPORT_SECONDS`` (``workers.node_report``);
one whose report is older than ``LMSP_WORKER_SILENT_SECONDS`` shows as
silent (frozen, cut off, killed) while the reaper still waits for its
tasks' heartbeat timeout. Its held tasks and those among them whose
heartbeat is silent link to the task list.
"""

from __future__ import annotations

from django.conf import settings
from django.contrib import admin
from django.contrib.admin.views.main import ChangeList
from django.http import HttpRequest
from django.urls import reverse
from django.utils import timezone
from django.utils.html import format_html, format_html_join
from django.utils.http import urlencode

from tasks_app.admin.access import ReadOnlyAdmin
from tasks_app.admin.display import status_badge
from tasks_app.models import WorkerNode
from tasks_app.selectors import workers as selectors


def _tasks_url(**params: str) -> str:
    return reverse("admin:tasks_app_task_changelist") + "?" + urlencode(params)


@admin.register(WorkerNode)
class WorkerNodeAdmin(ReadOnlyAdmin):
    list_display = (
        "name",
        "liveness",
        "report_age",
        "tasks_held",
        "rows_column",
        "engines_column",
        "tokens_per_second",
        "process",
        "version",
        "started_column",
    )
    list_display_links = ("name",)
    ordering = ("name",)
    search_fields = ("name__startswith",)
    search_help_text = "A node name (worker@host), or its beginning."
    list_filter = ("state",)
    # The list's columns, and the pool and the exact time of the newest report.
    fields = (*list_display[:-2], "pool", *list_display[-2:], "reported_column")
    readonly_fields = fields

    def get_changelist_instance(self, request: HttpRequest) -> ChangeList:
        changelist = super().get_changelist_instance(request)
        # One grouped query for the page's held tasks, and one clock reading for its ages.
        self._overview = selectors.held_tasks_by_node()
        self._now = timezone.now()
        return changelist

    def get_object(self, request: HttpRequest, object_id: str, from_field: str | None = None) -> WorkerNode | None:
        node = super().get_object(request, object_id, from_field)
        self._overview = selectors.held_tasks_by_node()
        self._now = timezone.now()
        return node

    @admin.display(description="state")
    def liveness(self, node: WorkerNode) -> str:
        state = selectors.worker_node_liveness(node=node, now=self._now)
        if state == "silent":
            age = selectors.worker_node_report_age(node=node, now=self._now)
            return status_badge("silent", f"silent for {age:.0f} s")
        return status_badge(state, state)

    @admin.display(description="last report", ordering="reported_at")
    def report_age(self, node: WorkerNode) -> str:
        age = selectors.worker_node_report_age(node=node, now=self._now)
        return format_html(
            '<span title="{}">{} s ago</span>', node.reported_at.isoformat(timespec="milliseconds"), f"{age:.1f}"
        )

    @admin.display(description="tasks held")
    def tasks_held(self, node: WorkerNode) -> str:
        held = self._overview.of(node.name)
        if not held.held:
            return "0"
        link = format_html('<a href="{}">{}</a>', _tasks_url(worker=node.name), held.held)
        if not held.silent:
            return link
        stuck = _tasks_url(worker=node.name, heartbeat="silent")
        return format_html(
            '{} (<a class="lmsp-status lmsp-status-silent" href="{}">{} stuck</a>)', link, stuck, held.silent
        )

    @admin.display(description="rows")
    def rows_column(self, node: WorkerNode) -> str:
        rows = sum(int(engine.get("rows", 0)) for engine in node.engines)
        waiting = sum(int(engine.get("waiting", 0)) for engine in node.engines)
        text = f"{rows} / {node.max_rows}"
        return f"{text}, {waiting} waiting" if waiting else text

    @admin.display(description="models (device)")
    def engines_column(self, node: WorkerNode) -> str:
        if not node.engines:
            return "-" if node.pool == "threads" else f"- (a {node.pool} node's pool processes hold them)"
        return format_html_join(
            ", ", "{} ({})", ((engine.get("model", "?"), engine.get("device") or "?") for engine in node.engines)
        )

    @admin.display(description="tokens/s")
    def tokens_per_second(self, node: WorkerNode) -> str:
        rate = sum(float(engine.get("tokens_per_s", 0.0)) for engine in node.engines)
        return f"{rate:.1f}"

    @admin.display(description="started", ordering="started_at")
    def started_column(self, node: WorkerNode) -> str:
        return timezone.localtime(node.started_at).strftime("%Y-%m-%d %H:%M:%S")

    @admin.display(description="reported at", ordering="reported_at")
    def reported_column(self, node: WorkerNode) -> str:
        return timezone.localtime(node.reported_at).isoformat(sep=" ", timespec="milliseconds")

    @admin.display(description="host / pid")
    def process(self, node: WorkerNode) -> str:
        return f"{node.hostname} / {node.pid}"

    def changelist_view(self, request: HttpRequest, extra_context: dict | None = None):  # type: ignore[no-untyped-def]
        context = {
            "title": "Worker nodes",
            "subtitle": (
                f"A node reports itself every {settings.LMSP_WORKER_REPORT_SECONDS:g} s; silent after "
                f"{settings.LMSP_WORKER_SILENT_SECONDS:g} s without a report. The reaper hands back a task whose "
                f"heartbeat is {settings.LMSP_HEARTBEAT_TIMEOUT_SECONDS} s old."
            ),
            **(extra_context or {}),
        }
        return super().changelist_view(request, extra_context=context)
