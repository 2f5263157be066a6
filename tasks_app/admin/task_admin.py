"""The task admin: the triage list, the task page (summary, attempts, live output, lifecycle), and the safe
actions, each asked first: cancel (one or many), run again, hand back now (``docs/admin.md``)."""

from __future__ import annotations

from collections import Counter
from typing import Any

from django.conf import settings
from django.contrib import admin, messages
from django.contrib.admin.utils import unquote
from django.contrib.admin.views.main import ChangeList
from django.core.exceptions import PermissionDenied
from django.db.models import Count, QuerySet
from django.http import HttpRequest, HttpResponse, HttpResponseRedirect, JsonResponse
from django.template.response import TemplateResponse
from django.urls import path, reverse
from django.utils import timezone
from django.utils.html import format_html, format_html_join
from django.utils.http import urlencode

from tasks_app import states
from tasks_app.admin.access import ReadOnlyAdmin
from tasks_app.admin.bounded_counts import BoundedCountAdmin
from tasks_app.admin.display import (
    admin_link,
    duration_text,
    json_column,
    status_badge,
    task_events_changelist_url,
    task_link,
)
from tasks_app.admin.record_admins import RESPONSE_BODY_FIELDS
from tasks_app.admin.task_filters import (
    INCOMPLETE,
    TaskBatchFilter,
    TaskCreatedFilter,
    TaskErrorCodeFilter,
    TaskHeartbeatFilter,
    TaskModelFilter,
    TaskStatusFilter,
    TaskWorkerFilter,
)
from tasks_app.exceptions import LmspError, TaskNotCancelable, TaskNotHandedBack
from tasks_app.generation import structured_output, tool_calls
from tasks_app.generation.spec import GenerationSpec
from tasks_app.models import Task
from tasks_app.plumbing.affinity import node_of
from tasks_app.selectors import tasks as selectors
from tasks_app.services.recovery import stuck_task_hand_back
from tasks_app.services.tasks import task_cancel, task_rerun
from tasks_app.states import ResponseStatus, TaskStatus

# What a task page shows of its lifecycle (its events other than output deltas); the rest is one link away.
DETAIL_EVENTS = 30
# A bulk cancel's confirmation names at most this many of the tasks it would cancel.
CONFIRM_LISTED = 50


@admin.register(Task)
class TaskAdmin(BoundedCountAdmin, ReadOnlyAdmin):
    # What triage needs, fitting 1280 px beside the filters; the rest is on the task page and in the filters.
    list_display = (
        "id",
        "status_column",
        "error_column",
        "model_column",
        "worker_column",
        "attempts_column",
        "tokens_column",
        "duration_column",
        "created_column",
    )
    list_filter = (
        TaskStatusFilter,
        TaskErrorCodeFilter,
        TaskCreatedFilter,
        TaskHeartbeatFilter,
        TaskModelFilter,
        "response__protocol",
        "on_restart",
        "client",
        TaskWorkerFilter,
        TaskBatchFilter,
    )
    # ``id__exact`` rather than ``=id``: the admin turns ``=`` into ``iexact``
    # (UPPER()/LIKE), which no index serves; both columns here are unique.
    search_fields = ("id__exact", "response__id__exact")
    search_help_text = "A task id (task_…) or a response id (resp_…), exactly as the API shows it."
    # The response for its model and status: its request and output stay unread.
    list_select_related = ("client", "response")
    list_defer = tuple(f"response__{name}" for name in RESPONSE_BODY_FIELDS)
    # Ids are ULIDs: newest first, served by the primary key.
    ordering = ("-id",)
    actions = ("cancel_tasks",)
    fieldsets = (
        (
            None,
            {
                "fields": (
                    "id",
                    "status",
                    "client",
                    "model_column",
                    "response_link",
                    "protocol",
                    "on_restart",
                    "attempts",
                    "prompt_tokens",
                    "output_tokens",
                    "last_sequence",
                    "rerun_links",
                    "created_at",
                    "finished_at",
                )
            },
        ),
        ("Worker", {"fields": ("worker_label", "batch_peers", "heartbeat_at", "cancel_requested_at")}),
        ("Request", {"fields": ("output_constraint", "request_json")}),
        ("Error", {"fields": ("error_json",)}),
        ("Snapshot", {"fields": ("snapshot_summary",)}),
    )
    # Every field is shown, none is edited.
    readonly_fields = tuple(name for _, options in fieldsets for name in options["fields"])

    def get_object(self, request: HttpRequest, object_id: str, from_field: str | None = None) -> Task | None:
        try:
            return self.get_queryset(request).select_related("client", "response").get(pk=object_id)
        except Task.DoesNotExist:
            return None

    # --- list columns ----------------------------------------------------------

    @admin.display(description="status", ordering="status")
    def status_column(self, task: Task) -> str:
        if task.status == TaskStatus.SUCCEEDED and task.response.status == ResponseStatus.INCOMPLETE:
            return status_badge(INCOMPLETE, "succeeded · incomplete", "succeeded, its response incomplete (a limit)")
        return status_badge(task.status, task.status)

    @admin.display(description="error")
    def error_column(self, task: Task) -> str:
        if not task.error:
            return ""
        code = task.error.get("code") or task.error.get("type") or "error"
        return format_html('<span title="{}">{}</span>', task.error.get("detail") or "", code)

    @admin.display(description="model", ordering="response__model")
    def model_column(self, task: Task) -> str:
        return task.response.model

    @admin.display(description="tries", ordering="attempts")
    def attempts_column(self, task: Task) -> int:
        return task.attempts

    @admin.display(description="tokens", ordering="output_tokens")
    def tokens_column(self, task: Task) -> int:
        """Output tokens of the current (or last) attempt."""
        return task.output_tokens

    @admin.display(description="worker · beat")
    def worker_column(self, task: Task) -> str:
        """A held task's node and heartbeat age (red once silent); a finished one's last node, greyed."""
        if not task.worker:
            return "-"
        node = node_of(task.worker)
        if task.status not in states.HELD:
            return format_html('<span class="lmsp-muted" title="{}">{}</span>', task.worker, node)
        age = selectors.task_heartbeat_age_seconds(task=task, now=self._now)
        if age is None:
            return node
        silent = age > settings.LMSP_HEARTBEAT_SILENT_SECONDS
        return format_html(
            '<span title="{}">{}</span> · <span class="{}">{} s</span>',
            task.worker,
            node,
            "lmsp-status lmsp-status-silent" if silent else "",
            f"{age:.1f}",
        )

    @admin.display(description="duration", ordering="finished_at")
    def duration_column(self, task: Task) -> str:
        """Creation to the end; an unfinished task's age so far (in italics)."""
        if task.finished_at is not None:
            return duration_text((task.finished_at - task.created_at).total_seconds() * 1000)
        age = (self._now - task.created_at).total_seconds() * 1000
        return format_html('<em title="not finished: its age">{}</em>', duration_text(age))

    @admin.display(description="created", ordering="id")
    def created_column(self, task: Task) -> str:
        local = timezone.localtime(task.created_at)
        return format_html(
            '<span title="{}">{}</span>', local.isoformat(timespec="milliseconds"), local.strftime("%m-%d %H:%M:%S")
        )

    def get_changelist_instance(self, request: HttpRequest) -> ChangeList:
        # One clock reading for the whole page's ages.
        self._now = timezone.now()
        return super().get_changelist_instance(request)

    # --- task page fields --------------------------------------------------------

    @admin.display(description="shares a batch with")
    def batch_peers(self, task: Task) -> str:
        if task.status not in states.HELD or not task.worker:
            return "-"
        peers = selectors.task_batch_peers(task=task)
        if not peers:
            return "no other task: it runs alone in its worker process's engine"
        return format_html_join(", ", "{} ({})", ((task_link(peer.pk), peer.status) for peer in peers))

    @admin.display(description="worker")
    def worker_label(self, task: Task) -> str:
        if not task.worker:
            return "- (no worker holds it)"
        if task.status in states.HELD:
            return format_html("{} (holds it now)", task.worker)
        return format_html("{} (its last attempt's; it holds nothing now)", task.worker)

    @admin.display(description="reruns")
    def rerun_links(self, task: Task) -> str:
        parts = []
        if task.rerun_of_id:
            parts.append(format_html("run again from {}", task_link(task.rerun_of_id)))
        reruns = list(Task.objects.filter(rerun_of_id=task.pk).order_by("id").values_list("id", flat=True)[:20])
        if reruns:
            parts.append(
                format_html("run again as {}", format_html_join(", ", "{}", ((task_link(r),) for r in reruns)))
            )
        return format_html_join("; ", "{}", ((part,) for part in parts)) if parts else "-"

    @admin.display(description="response")
    def response_link(self, task: Task) -> str:
        return admin_link(task.response)

    request_json = json_column("response.request", "request")

    @admin.display(description="protocol")
    def protocol(self, task: Task) -> str:
        """The protocol the request came in: its ``request`` is in that protocol's shape."""
        return task.response.get_protocol_display()

    @admin.display(description="prompt tokens")
    def prompt_tokens(self, task: Task) -> str:
        """The prompt's tokens and how many its worker's prefix cache held (their model calls skipped)."""
        usage = task.response.usage
        if usage:
            cached = (usage.get("input_tokens_details") or {}).get("cached_tokens", 0)
            return f"{usage['input_tokens']} ({cached} from the prefix cache)"
        if task.status == TaskStatus.QUEUED:
            return "- (counted once a worker runs it)"
        if task.status in states.HELD:
            return "- (reported with the usage when the generation ends)"
        return "- (not reported: the task ended before its generation did)"

    @admin.display(description="output constraint")
    def output_constraint(self, task: Task) -> str:
        if task.response.generation is None:
            return "- (no generation spec)"
        spec = GenerationSpec.from_json(task.response.generation)
        constraint = structured_output.constraint_summary(spec.constraint)
        if spec.tools:
            # The tools' grammar holds the format too (an auto choice's answer is that JSON).
            return f"{tool_calls.tools_summary(spec)}; output format {constraint}"
        return constraint

    error_json = json_column("error", "error")

    @admin.display(description="snapshot")
    def snapshot_summary(self, task: Task) -> str:
        # The page's own reading (render_change_form), not a second query.
        detail = getattr(task, "admin_detail", None)
        snapshot = detail.snapshot if detail is not None else selectors.task_snapshot_get(task_id=task.pk)
        if snapshot is None:
            return "none (only a running resumable task keeps one)"
        return format_html(
            "{} rows, {} token ids stored, as of event {}",
            snapshot.rows,
            len(snapshot.token_ids),
            snapshot.sequence_number,
        )

    # --- permissions ---------------------------------------------------------

    def has_cancel_permission(self, request: HttpRequest, obj: Task | None = None) -> bool:
        """Cancelling, running again and handing back change a task: Django's "Can change task" permission."""
        opts = self.opts
        return request.user.has_perm(f"{opts.app_label}.change_{opts.model_name}")

    # --- cancel ----------------------------------------------------------------

    @admin.action(description="Cancel selected tasks…", permissions=["cancel"])
    def cancel_tasks(self, request: HttpRequest, queryset: QuerySet[Task]) -> HttpResponse | None:
        """Asks first (how many, and which), like Django's delete: the confirmation posts back with ``confirmed``."""
        if request.POST.get("confirmed") != "yes":
            return self._cancel_confirmation(request, queryset)
        outcome: Counter[str] = Counter()
        refused: list[str] = []
        # Read first, then write: a cursor left open over rows being updated
        # (SQLite shares one connection) could skip or repeat some.
        for task in list(queryset.select_related(None).only("id", "status")):
            before = task.status
            try:
                after = task_cancel(task=task)
            except TaskNotCancelable:
                refused.append(f"{task.pk} ({self._status_now(task)})")
                continue
            if before in states.CANCEL_UNDER_WAY:
                outcome["unchanged"] += 1
            else:
                outcome[after.status] += 1
                self.log_change(request, task, f"Cancel: {before} -> {after.status}")
        done = [
            f"{outcome[TaskStatus.CANCELLED]} cancelled",
            f"{outcome[TaskStatus.CANCELLING]} cancelling (the worker stops them)",
            f"{outcome['unchanged']} already cancelling or cancelled",
        ]
        if sum(outcome.values()):
            self.message_user(request, "Cancel: " + ", ".join(done) + ".", messages.SUCCESS)
        if refused:
            shown = ", ".join(refused[:20]) + (f" and {len(refused) - 20} more" if len(refused) > 20 else "")
            self.message_user(
                request, f"Not cancelled, already finished (succeeded or failed): {shown}.", messages.ERROR
            )
        return None

    def _cancel_confirmation(self, request: HttpRequest, queryset: QuerySet[Task]) -> HttpResponse:
        rows = queryset.select_related(None).only("id", "status").order_by("-id")
        by_status = Counter(
            dict(rows.order_by().values_list("status").annotate(n=Count("id")).values_list("status", "n"))
        )
        total = sum(by_status.values())
        finished = by_status[TaskStatus.SUCCEEDED] + by_status[TaskStatus.FAILED]
        context = {
            **self.admin_site.each_context(request),
            "title": f"Cancel {total} task{'s' if total != 1 else ''}?",
            "opts": self.opts,
            "total": total,
            "by_status": sorted(by_status.items()),
            "finished": finished,
            "listed": list(rows[:CONFIRM_LISTED]),
            "more": max(0, total - CONFIRM_LISTED),
            "selected": request.POST.getlist(admin.helpers.ACTION_CHECKBOX_NAME),
            "select_across": request.POST.get("select_across", "0"),
            "action": request.POST.get("action", "cancel_tasks"),
            "index": request.POST.get("index", "0"),
            "back_url": request.get_full_path(),
        }
        return TemplateResponse(request, "admin/tasks_app/task/cancel_selected_confirmation.html", context)

    @staticmethod
    def _status_now(task: Task) -> str:
        # The status the refusal saw, not the one the page was read with: the
        # task may have finished in between.
        return Task.objects.filter(pk=task.pk).values_list("status", flat=True).get()

    def _task_or_redirect(self, request: HttpRequest, object_id: str) -> Task | HttpResponse:
        task = self.get_object(request, unquote(object_id))
        if task is None:
            return self._get_obj_does_not_exist_redirect(request, self.opts, object_id)
        if not self.has_cancel_permission(request, task):
            raise PermissionDenied
        return task

    def _confirm(self, request: HttpRequest, task: Task, *, title: str, lines: list[str], button: str) -> HttpResponse:
        context = {
            **self.admin_site.each_context(request),
            "title": title,
            "opts": self.opts,
            "task": task,
            "object": task,
            "lines": lines,
            "button": button,
            "back_url": reverse("admin:tasks_app_task_change", args=[task.pk]),
        }
        return TemplateResponse(request, "admin/tasks_app/task/confirm.html", context)

    def cancel_view(self, request: HttpRequest, object_id: str) -> HttpResponse:
        task = self._task_or_redirect(request, object_id)
        if isinstance(task, HttpResponse):
            return task
        if request.method != "POST":
            return self._confirm(
                request,
                task,
                title=f"Cancel task {task.pk}?",
                lines=self._cancel_effect(task),
                button="Yes, cancel it",
            )
        try:
            after = task_cancel(task=task)
        except TaskNotCancelable:
            self.message_user(
                request,
                f"Task {task.pk} was not cancelled: it has already finished ({self._status_now(task)}).",
                messages.ERROR,
            )
        else:
            if after.status != task.status:
                self.log_change(request, task, f"Cancel: {task.status} -> {after.status}")
            if after.status == TaskStatus.CANCELLED and task.status != TaskStatus.CANCELLED:
                text = f"Task {task.pk} was cancelled."
            elif after.status == TaskStatus.CANCELLING and task.status != TaskStatus.CANCELLING:
                text = f"Task {task.pk} is cancelling: its worker stops it and marks it cancelled."
            else:
                text = f"Task {task.pk} was already {after.status}."
            self.message_user(request, text, messages.SUCCESS)
        return HttpResponseRedirect(reverse("admin:tasks_app_task_change", args=[task.pk]))

    @staticmethod
    def _cancel_effect(task: Task) -> list[str]:
        if task.status == TaskStatus.QUEUED:
            return ["It is queued: it becomes cancelled at once, and no worker will run it."]
        if task.status in states.CANCELABLE_VIA_BACKEND:
            return [
                f"It is {task.status} on {task.worker or 'a worker'} with {task.output_tokens} output tokens: "
                "it becomes cancelling, its worker stops generating, and it ends cancelled with the text "
                "written so far.",
                "Its client sees response.cancelled; a cancel cannot be undone (run again makes a new task).",
            ]
        return [f"It is {task.status}: a cancel changes nothing."]

    # --- run again ---------------------------------------------------------------

    def rerun_view(self, request: HttpRequest, object_id: str) -> HttpResponse:
        task = self._task_or_redirect(request, object_id)
        if isinstance(task, HttpResponse):
            return task
        if request.method != "POST":
            lines = [
                f"A new task is queued with the same request (model {task.response.model}, "
                f"on_restart {task.on_restart}), for the same client ({task.client}), linked to {task.pk}.",
                f"{task.pk} stays {task.status}; its client's stream and webhooks are not told of the new task.",
            ]
            if task.status not in states.RERUNNABLE:
                lines = [f"It is {task.status}: only a failed or cancelled task runs again."]
            return self._confirm(
                request, task, title=f"Run task {task.pk} again?", lines=lines, button="Yes, run it again"
            )
        try:
            rerun = task_rerun(task=task)
        except LmspError as exc:
            self.message_user(request, f"Task {task.pk} was not run again: {exc}", messages.ERROR)
            return HttpResponseRedirect(reverse("admin:tasks_app_task_change", args=[task.pk]))
        self.log_change(request, task, f"Run again as {rerun.pk}")
        self.log_change(request, rerun, f"Run again from {task.pk}")
        self.message_user(request, f"Task {task.pk} runs again as {rerun.pk}.", messages.SUCCESS)
        return HttpResponseRedirect(reverse("admin:tasks_app_task_change", args=[rerun.pk]))

    # --- hand back now -------------------------------------------------------------

    def hand_back_view(self, request: HttpRequest, object_id: str) -> HttpResponse:
        task = self._task_or_redirect(request, object_id)
        if isinstance(task, HttpResponse):
            return task
        if request.method != "POST":
            age = selectors.task_heartbeat_age_seconds(task=task)
            heard = "never" if age is None else f"{age:.1f} s ago"
            lines = [
                f"Its worker {task.worker or '-'} last wrote a heartbeat {heard}; "
                f"the reaper would hand it back at {settings.LMSP_HEARTBEAT_TIMEOUT_SECONDS} s.",
                f"Its policy decides (on_restart {task.on_restart}): resume goes on from its last snapshot, retry "
                "runs it again from the start, fail fails it with server_restarted.",
                f"Refused if the heartbeat is younger than {settings.LMSP_HEARTBEAT_SILENT_SECONDS} s, or if its "
                "worker's node answers that it still runs it.",
            ]
            return self._confirm(
                request, task, title=f"Hand task {task.pk} back now?", lines=lines, button="Yes, hand it back"
            )
        operator = request.user.get_username()
        try:
            summary = stuck_task_hand_back(task_id=task.pk, operator=operator)
        except TaskNotHandedBack as exc:
            self.message_user(request, f"Task {task.pk} was not handed back: {exc}.", messages.ERROR)
        else:
            moved = next(label for label, ids in summary.task_ids.items() if task.pk in ids)
            self.log_change(request, task, f"Hand back: {task.status} -> {moved}")
            self.message_user(request, f"Task {task.pk} was handed back: {moved}.", messages.SUCCESS)
        return HttpResponseRedirect(reverse("admin:tasks_app_task_change", args=[task.pk]))

    # --- liveness (the open task page polls it) --------------------------------------

    def liveness_view(self, request: HttpRequest, object_id: str) -> HttpResponse:
        task = self.get_object(request, unquote(object_id))
        if task is None or not self.has_view_permission(request, task):
            return JsonResponse({"detail": "no such task"}, status=404)
        age = selectors.task_heartbeat_age_seconds(task=task)
        return JsonResponse(
            {
                "status": task.status,
                "worker": task.worker,
                "held": task.status in states.HELD,
                "heartbeat_age": None if age is None else round(age, 1),
                "silent": task.status in states.HELD
                and age is not None
                and age > settings.LMSP_HEARTBEAT_SILENT_SECONDS,
                "silent_after": settings.LMSP_HEARTBEAT_SILENT_SECONDS,
                "timeout": settings.LMSP_HEARTBEAT_TIMEOUT_SECONDS,
            }
        )

    def get_urls(self) -> list:
        view = self.admin_site.admin_view
        # Before the default URLs: their ``<path:object_id>/`` would take them.
        return [
            path("<path:object_id>/cancel/", view(self.cancel_view), name="tasks_app_task_cancel"),
            path("<path:object_id>/rerun/", view(self.rerun_view), name="tasks_app_task_rerun"),
            path("<path:object_id>/hand-back/", view(self.hand_back_view), name="tasks_app_task_hand_back"),
            path("<path:object_id>/liveness/", view(self.liveness_view), name="tasks_app_task_liveness"),
            *super().get_urls(),
        ]

    # --- detail page -----------------------------------------------------------

    def render_change_form(
        self,
        request: HttpRequest,
        context: dict[str, Any],
        add: bool = False,
        change: bool = False,
        form_url: str = "",
        obj: Task | None = None,
    ) -> HttpResponse:
        if obj is not None:
            detail = selectors.task_admin_detail(task=obj, events=DETAIL_EVENTS)
            obj.admin_detail = detail
            attempts = selectors.task_attempts(task=obj)
            age = selectors.task_heartbeat_age_seconds(task=obj)
            held = obj.status in states.HELD
            may_change = self.has_cancel_permission(request, obj)
            context.update(
                {
                    "task": obj,
                    "detail": detail,
                    "attempts": attempts,
                    "timings": (timings := selectors.task_timings(task=obj, attempts=attempts)),
                    "times": {
                        "duration": duration_text(timings.duration_ms),
                        "age": duration_text((timezone.now() - obj.created_at).total_seconds() * 1000),
                        "queue_wait": duration_text(timings.queue_wait_ms),
                        "first_token": duration_text(timings.first_token_ms),
                        "generation": duration_text(timings.generation_ms),
                    },
                    "status_badge": self.status_column(obj),
                    "heartbeat_age": age,
                    "silent": held and age is not None and age > settings.LMSP_HEARTBEAT_SILENT_SECONDS,
                    "held": held,
                    "silent_after": settings.LMSP_HEARTBEAT_SILENT_SECONDS,
                    "heartbeat_timeout": settings.LMSP_HEARTBEAT_TIMEOUT_SECONDS,
                    "heartbeat_interval": settings.LMSP_HEARTBEAT_SECONDS,
                    "queue_position": (
                        selectors.task_queue_positions(task_ids=[obj.pk]).get(obj.pk)
                        if obj.status == TaskStatus.QUEUED
                        else None
                    ),
                    "worker_node": node_of(obj.worker) if obj.worker else "",
                    "worker_node_url": (
                        reverse("admin:tasks_app_workernode_change", args=[node_of(obj.worker)]) if obj.worker else ""
                    ),
                    "live": not obj.is_terminal,
                    "stream_url": reverse("task-events", kwargs={"task_id": obj.pk})
                    + "?"
                    + urlencode({"starting_after": detail.cursor}),
                    "liveness_url": reverse("admin:tasks_app_task_liveness", args=[obj.pk]),
                    "all_events_url": task_events_changelist_url(obj.pk),
                    "can_cancel": may_change and not obj.is_terminal,
                    "can_rerun": may_change and obj.status in states.RERUNNABLE,
                    "can_hand_back": may_change and held,
                    "cancel_url": reverse("admin:tasks_app_task_cancel", args=[obj.pk]),
                    "rerun_url": reverse("admin:tasks_app_task_rerun", args=[obj.pk]),
                    "hand_back_url": reverse("admin:tasks_app_task_hand_back", args=[obj.pk]),
                }
            )
        return super().render_change_form(request, context, add, change, form_url, obj)
