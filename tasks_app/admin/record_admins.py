"""The read-only admins of the logs and records: task events, responses, idempotency keys, pairing codes."""

from __future__ import annotations

import json

from django.contrib import admin
from django.db.models import QuerySet
from django.db.models.functions import Substr
from django.http import HttpRequest
from django.utils import timezone
from django.utils.html import format_html

from tasks_app.admin.access import ReadOnlyAdmin
from tasks_app.admin.bounded_counts import BoundedCountAdmin
from tasks_app.admin.display import json_column, pretty_json, task_link
from tasks_app.admin.filters import ModelNameFilter, TaskIdFilter
from tasks_app.events import EventType
from tasks_app.models import IdempotencyKey, PairingCode, Response, Task, TaskEvent
from tasks_app.selectors import tasks as selectors

# Characters of an event's payload shown in the event list.
PAYLOAD_PREVIEW_CHARS = 160
# Response columns that lists never show and that may be large.
RESPONSE_BODY_FIELDS = ("request", "output", "usage", "error", "incomplete_details", "metadata")


class EventTypeFilter(admin.SimpleListFilter):
    """One type of event (a task's lifecycle without its deltas: pick ``response.in_progress``, say)."""

    title = "type"
    parameter_name = "type"
    LIFECYCLE = "lifecycle"

    def lookups(self, request: HttpRequest, model_admin: admin.ModelAdmin) -> list[tuple[str, str]]:
        return [(self.LIFECYCLE, "all but output deltas"), *((str(kind), str(kind)) for kind in EventType)]

    def queryset(self, request: HttpRequest, queryset: QuerySet) -> QuerySet:
        value = self.value()
        if value == self.LIFECYCLE:
            return queryset.exclude(type__in=selectors.DELTA_EVENT_TYPES)
        return queryset.filter(type=value) if value in EventType.__members__.values() else queryset


@admin.register(TaskEvent)
class TaskEventAdmin(BoundedCountAdmin, ReadOnlyAdmin):
    list_display = ("event_column", "task_column", "type_column", "created_column", "payload_preview")
    list_display_links = ("event_column",)
    list_filter = (TaskIdFilter, EventTypeFilter)
    search_fields = ("task__id__exact",)
    search_help_text = "A task id, exactly."
    list_defer = ("payload",)
    fields = ("task_column", "sequence_number", "type", "created_at", "payload_json")
    readonly_fields = fields

    def get_queryset(self, request: HttpRequest) -> QuerySet[TaskEvent]:
        # A preview instead of the payload: a terminal event carries the whole response.
        return super().get_queryset(request).annotate(payload_head=Substr("payload", 1, PAYLOAD_PREVIEW_CHARS))

    def get_ordering(self, request: HttpRequest) -> tuple[str, ...]:
        # One task's log in its own order (the (task, sequence_number) index);
        # everything else newest first (the primary key).
        if request.GET.get(TaskIdFilter.parameter_name):
            # ``task_id``, not ``task``: Django sees the unique pair as a total
            # ordering only by the column name, and would append ``-id`` otherwise.
            return ("task_id", "sequence_number")
        return ("-id",)

    @admin.display(description="#", ordering="id")
    def event_column(self, event: TaskEvent) -> str:
        return f"#{event.sequence_number}"

    @admin.display(description="type", ordering="type")
    def type_column(self, event: TaskEvent) -> str:
        return format_html('<span class="lmsp-event-type">{}</span>', event.type)

    @admin.display(description="created", ordering="created_at")
    def created_column(self, event: TaskEvent) -> str:
        return timezone.localtime(event.created_at).strftime("%Y-%m-%d %H:%M:%S.%f")[:-3]

    @admin.display(description="task", ordering="task")
    def task_column(self, event: TaskEvent) -> str:
        return task_link(event.task_id)

    @admin.display(description="payload")
    def payload_preview(self, event: TaskEvent) -> str:
        head = event.payload_head or ""
        return head + ("…" if len(head) >= PAYLOAD_PREVIEW_CHARS else "")

    @admin.display(description="payload")
    def payload_json(self, event: TaskEvent) -> str:
        try:
            return pretty_json(json.loads(event.payload))
        except ValueError:
            return event.payload


@admin.register(Response)
class ResponseAdmin(BoundedCountAdmin, ReadOnlyAdmin):
    list_display = ("id", "client", "model", "status", "created_at", "updated_at")
    list_filter = ("status", ModelNameFilter)
    search_fields = ("id__exact",)
    search_help_text = "A response id (resp_…), exactly."
    list_select_related = ("client",)
    list_defer = RESPONSE_BODY_FIELDS
    ordering = ("-id",)
    fields = (
        "id",
        "client",
        "model",
        "status",
        "task_column",
        "created_at",
        "updated_at",
        "text",
        "output_json",
        "usage_json",
        "error_json",
        "incomplete_json",
        "metadata_json",
        "request_json",
    )
    readonly_fields = fields

    @admin.display(description="task")
    def task_column(self, response: Response) -> str:
        return task_link(Task.objects.filter(response_id=response.pk).values_list("id", flat=True).first())

    @admin.display(description="output text")
    def text(self, response: Response) -> str:
        return format_html('<pre class="lmsp-text">{}</pre>', selectors.response_output_text(response=response))

    output_json = json_column("output", "output")

    usage_json = json_column("usage", "usage")

    error_json = json_column("error", "error")

    incomplete_json = json_column("incomplete_details", "incomplete details")

    metadata_json = json_column("metadata", "metadata")

    request_json = json_column("request", "request")


@admin.register(IdempotencyKey)
class IdempotencyKeyAdmin(BoundedCountAdmin, ReadOnlyAdmin):
    list_display = ("key", "endpoint", "client", "state", "response_status", "task_column", "created_at", "expires_at")
    # No endpoint filter: its choices would be a DISTINCT over the whole table.
    list_filter = ("state", "client")
    search_fields = ("key__exact",)
    search_help_text = "An Idempotency-Key, exactly."
    list_select_related = ("client",)
    list_defer = ("response_body", "response_headers")
    ordering = ("-id",)
    fields = (
        "key",
        "endpoint",
        "client",
        "state",
        "request_hash",
        "response_status",
        "task_column",
        "created_at",
        "expires_at",
        "response_headers_json",
        "response_body_json",
    )
    readonly_fields = fields

    @admin.display(description="task")
    def task_column(self, record: IdempotencyKey) -> str:
        return task_link(record.task_id)

    response_headers_json = json_column("response_headers", "reply headers")

    response_body_json = json_column("response_body", "reply body")


@admin.register(PairingCode)
class PairingCodeAdmin(ReadOnlyAdmin):
    list_display = ("id", "scopes", "created_at", "expires_at", "used_at", "client")
    list_select_related = ("client",)
    ordering = ("-id",)
    # Never the code's hash.
    fields = ("id", "scopes", "created_at", "expires_at", "used_at", "client")
    readonly_fields = fields
