"""The task admin: the list and its filters, the task page with its live output, and cancelling."""

from __future__ import annotations

from collections import Counter
from typing import Any

from django.contrib import admin, messages
from django.contrib.admin.utils import unquote
from django.contrib.admin.views.main import ChangeList
from django.core.exceptions import PermissionDenied
from django.db.models import QuerySet
from django.http import HttpRequest, HttpResponse, HttpResponseRedirect
from django.urls import path, reverse
from django.utils.html import format_html, format_html_join
from django.utils.http import urlencode

from tasks_app import states
from tasks_app.admin.access import ReadOnlyAdmin, post_only
from tasks_app.admin.bounded_counts import BoundedCountAdmin
from tasks_app.admin.display import admin_link, json_column, task_events_changelist_url, task_link
from tasks_app.admin.filters import ModelNameFilter
from tasks_app.admin.record_admins import RESPONSE_BODY_FIELDS
from tasks_app.exceptions import TaskNotCancelable
from tasks_app.generation import structured_output, tool_calls
from tasks_app.generation.spec import GenerationSpec
from tasks_app.models import Task
from tasks_app.plumbing.querying import status_in
from tasks_app.selectors import tasks as selectors
from tasks_app.services.tasks import task_cancel
from tasks_app.states import TaskStatus

# What a task page shows of the log; the rest is one link away.
DETAIL_EVENTS = 20


class TaskModelFilter(ModelNameFilter):
    field_path = "response__model"


class TaskStatusFilter(admin.SimpleListFilter):
    """Filter by status through ``status_in``, so that SQLite reads the few
    unfinished tasks from the partial index instead of walking every task
    (a page of queued tasks among 200,000 finished ones: 62 ms -> 1 ms)."""

    title = "status"
    parameter_name = "status"

    def lookups(self, request: HttpRequest, model_admin: admin.ModelAdmin) -> list[tuple[str, str]]:
        return list(TaskStatus.choices)

    def queryset(self, request: HttpRequest, queryset: QuerySet) -> QuerySet:
        value = self.value()
        if value not in TaskStatus.values:
            return queryset
        return queryset.filter(status_in([value]))


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


@admin.register(Task)
class TaskAdmin(BoundedCountAdmin, ReadOnlyAdmin):
    list_display = (
        "id",
        "client",
        "model_column",
        "status",
        "batch_column",
        "on_restart",
        "attempts",
        "output_tokens",
        "created_at",
        "updated_at",
    )
    list_filter = (TaskStatusFilter, TaskModelFilter, "response__protocol", "on_restart", "client", TaskBatchFilter)
    # ``id__exact`` rather than ``=id``: the admin turns ``=`` into ``iexact``
    # (UPPER()/LIKE), which no index serves; both columns here are unique.
    search_fields = ("id__exact", "response__id__exact")
    search_help_text = "A task id (task_…) or a response id (resp_…), exactly as the API shows it."
    # The response only for its model: its request and output stay unread.
    list_select_related = ("client", "response")
    list_defer = ("error", *(f"response__{name}" for name in RESPONSE_BODY_FIELDS))
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
                    "created_at",
                    "updated_at",
                )
            },
        ),
        ("Worker", {"fields": ("worker", "batch_peers", "heartbeat_at", "cancel_requested_at")}),
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

    @admin.display(description="model", ordering="response__model")
    def model_column(self, task: Task) -> str:
        return task.response.model

    @admin.display(description="shares a batch with")
    def batch_peers(self, task: Task) -> str:
        if task.status not in states.HELD or not task.worker:
            return "-"
        peers = selectors.task_batch_peers(task=task)
        if not peers:
            return "no other task: it runs alone in its worker process's engine"
        return format_html_join(", ", "{} ({})", ((task_link(peer.pk), peer.status) for peer in peers))

    def get_changelist_instance(self, request: HttpRequest) -> ChangeList:
        changelist = super().get_changelist_instance(request)
        # The page is read here rather than by the template (which reuses the
        # rows), so that one query finds the batches of all its held tasks.
        page = list(changelist.result_list)
        peers_of = selectors.task_batch_peer_ids(tasks=page)
        for task in page:
            task.batch_peer_ids = peers_of.get(task.pk)
        return changelist

    @admin.display(description="batch")
    def batch_column(self, task: Task) -> str:
        peers = getattr(task, "batch_peer_ids", None)
        if peers is None:
            return "-"
        url = "?" + urlencode({TaskBatchFilter.parameter_name: task.pk})
        return format_html('<a href="{}">{}</a>', url, f"with {len(peers)}" if peers else "alone")

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
        if not usage:
            return "- (counted when the generation starts)"
        cached = (usage.get("input_tokens_details") or {}).get("cached_tokens", 0)
        return f"{usage['input_tokens']} ({cached} from the prefix cache)"

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
        snapshot = selectors.task_snapshot_get(task_id=task.pk)
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
        """Cancelling is a change of the task: Django's "Can change task" permission."""
        opts = self.opts
        return request.user.has_perm(f"{opts.app_label}.change_{opts.model_name}")

    # --- cancel ----------------------------------------------------------------

    @admin.action(description="Cancel selected tasks", permissions=["cancel"])
    def cancel_tasks(self, request: HttpRequest, queryset: QuerySet[Task]) -> None:
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

    @staticmethod
    def _status_now(task: Task) -> str:
        # The status the refusal saw, not the one the page was read with: the
        # task may have finished in between.
        return Task.objects.filter(pk=task.pk).values_list("status", flat=True).get()

    def cancel_view(self, request: HttpRequest, object_id: str) -> HttpResponse:
        if (refusal := post_only(request)) is not None:
            return refusal
        task = self.get_object(request, unquote(object_id))
        if task is None:
            return self._get_obj_does_not_exist_redirect(request, self.opts, object_id)
        if not self.has_cancel_permission(request, task):
            raise PermissionDenied
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

    def get_urls(self) -> list:
        # Before the default URLs: their ``<path:object_id>/`` would take it.
        return [
            path(
                "<path:object_id>/cancel/", self.admin_site.admin_view(self.cancel_view), name="tasks_app_task_cancel"
            ),
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
            context.update(
                {
                    "task": obj,
                    "detail": detail,
                    "live": not obj.is_terminal,
                    "stream_url": reverse("task-events", kwargs={"task_id": obj.pk})
                    + "?"
                    + urlencode({"starting_after": detail.cursor}),
                    "all_events_url": task_events_changelist_url(obj.pk),
                    "can_cancel": self.has_cancel_permission(request, obj) and not obj.is_terminal,
                    "cancel_url": reverse("admin:tasks_app_task_cancel", args=[obj.pk]),
                }
            )
        return super().render_change_form(request, context, add, change, form_url, obj)
