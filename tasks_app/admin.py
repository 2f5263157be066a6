"""The operator's admin (``/admin/``): read-only tables; every change goes through a service.

Nothing here writes a row itself. Cancelling calls ``services.tasks.task_cancel``
(so an admin cancel obeys the lifecycle rules an API cancel does), creating and
revoking clients call ``services.clients``, and "Rescan models" calls
``services.models.model_scan``. Every model admin refuses change and delete
(Django's own edit forms would bypass the services), so the change views are
view-only pages and a POST to them is a 403.

Large tables (tasks, events, idempotency keys, responses) are listed without a
full ``COUNT(*)``: ``BoundedCountPaginator`` counts at most a page window's rows
and the list says "more than N". Permissions: see ``docs/admin.md``.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Callable
from typing import Any

from django import forms
from django.contrib import admin, messages
from django.contrib.admin.options import IS_POPUP_VAR
from django.contrib.admin.utils import unquote
from django.contrib.admin.views.main import PAGE_VAR, ChangeList
from django.core.exceptions import PermissionDenied
from django.core.paginator import Paginator
from django.db.models import QuerySet
from django.db.models.functions import Substr
from django.http import HttpRequest, HttpResponse, HttpResponseNotAllowed, HttpResponseRedirect
from django.template.response import TemplateResponse
from django.urls import path, reverse
from django.utils.functional import cached_property
from django.utils.html import format_html, format_html_join
from django.utils.http import urlencode

from tasks_app import selectors
from tasks_app.exceptions import InvalidRequest, TaskNotCancelable
from tasks_app.models import (
    Client,
    IdempotencyKey,
    ModelRecord,
    PairingCode,
    Response,
    Task,
    TaskEvent,
    TaskStatus,
)
from tasks_app.querying import status_in
from tasks_app.services.clients import MAX_NAME_LENGTH, SCOPES, client_create, client_revoke_by_id
from tasks_app.services.models import model_scan
from tasks_app.services.tasks import task_cancel

admin.site.site_header = "LMSP service"
admin.site.site_title = "LMSP admin"
admin.site.index_title = "Operations"
# The service has no site outside the API and the admin.
admin.site.site_url = None

# What a task page shows of the log; the rest is one link away.
DETAIL_EVENTS = 20
# Characters of an event's payload shown in the event list.
PAYLOAD_PREVIEW_CHARS = 160
# Response columns that lists never show and that may be large.
RESPONSE_BODY_FIELDS = ("request", "output", "usage", "error", "incomplete_details", "metadata")


# --------------------------------------------------------------------------- #
# Lists without COUNT(*)
# --------------------------------------------------------------------------- #


class BoundedCountPaginator(Paginator):
    """A paginator that counts at most ``count_limit + 1`` rows.

    ``COUNT(*)`` over a filtered queryset reads every matching row (SQLite
    has no other way, PostgreSQL's MVCC neither); on a table of millions of
    events that is seconds per page view. Counting ``LIMIT count_limit + 1``
    rows in a subquery costs no more than reading the pages up to there.
    ``capped`` tells the template to say "more than ``count_limit``".
    """

    def __init__(self, object_list: QuerySet, per_page: int, *, count_limit: int, **kwargs: Any) -> None:
        super().__init__(object_list, per_page, **kwargs)
        self.count_limit = count_limit

    @cached_property
    def count(self) -> int:
        # Only the primary keys: no annotation (a payload preview) is computed for counting.
        return self.object_list.values("pk")[: self.count_limit + 1].count()

    @property
    def capped(self) -> bool:
        return self.count > self.count_limit


class BoundedCountAdmin(admin.ModelAdmin):
    """List pages of a large table: bounded counts, no facet counts, no full total."""

    paginator = BoundedCountPaginator
    show_full_result_count = False
    # Facets would COUNT every filter choice over the whole table.
    show_facets = admin.ShowFacets.NEVER
    # The count window reaches ``pages_ahead`` pages past the one shown (at
    # least ``count_floor`` rows), so every later page stays one click away.
    count_floor = 1000
    pages_ahead = 10
    # Columns the list does not show and that may be large (JSON bodies).
    list_defer: tuple[str, ...] = ()

    def get_paginator(
        self,
        request: HttpRequest,
        queryset: QuerySet,
        per_page: int,
        orphans: int = 0,
        allow_empty_first_page: bool = True,
    ) -> BoundedCountPaginator:
        try:
            page = max(1, int(request.GET.get(PAGE_VAR, 1)))
        except ValueError:
            page = 1
        limit = max(self.count_floor, (page + self.pages_ahead) * per_page)
        return BoundedCountPaginator(
            queryset, per_page, orphans=orphans, allow_empty_first_page=allow_empty_first_page, count_limit=limit
        )

    def get_changelist(self, request: HttpRequest, **kwargs: Any) -> type[ChangeList]:
        return _DeferringChangeList


class _DeferringChangeList(ChangeList):
    def get_queryset(self, request: HttpRequest, exclude_parameters: Any = None) -> QuerySet:
        queryset = super().get_queryset(request, exclude_parameters)
        deferred = getattr(self.model_admin, "list_defer", ())
        return queryset.defer(*deferred) if deferred else queryset


class ReadOnlyAdmin(admin.ModelAdmin):
    """View-only pages: no add, change or delete (nor the bulk delete action)."""

    def has_add_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False


# --------------------------------------------------------------------------- #
# Shared bits
# --------------------------------------------------------------------------- #


def pretty_json(value: Any) -> str:
    if value is None or value == "":
        return "-"
    return format_html('<pre class="lmsp-json">{}</pre>', json.dumps(value, indent=2, ensure_ascii=False))


def json_column(path: str, description: str) -> Callable[[Any, Any], str]:
    """A read-only admin field showing the JSON at ``path`` (dotted) of the row, pretty-printed."""

    @admin.display(description=description)
    def show(model_admin: Any, obj: Any) -> str:
        value = obj
        for name in path.split("."):
            value = getattr(value, name)
        return pretty_json(value)

    return show


def admin_link(obj: Any, text: str | None = None) -> str:
    if obj is None:
        return "-"
    url = reverse(f"admin:{obj._meta.app_label}_{obj._meta.model_name}_change", args=[obj.pk])
    return format_html('<a href="{}">{}</a>', url, text or str(obj))


def task_link(task_id: str | None) -> str:
    if not task_id:
        return "-"
    return format_html('<a href="{}">{}</a>', reverse("admin:tasks_app_task_change", args=[task_id]), task_id)


def task_events_changelist_url(task_id: str) -> str:
    return reverse("admin:tasks_app_taskevent_changelist") + "?" + urlencode({TaskIdFilter.parameter_name: task_id})


def post_only(request: HttpRequest) -> HttpResponse | None:
    return None if request.method == "POST" else HttpResponseNotAllowed(["POST"])


class ModelNameFilter(admin.SimpleListFilter):
    """Filter by the response's model; the choices come from the (small) models table."""

    title = "model"
    parameter_name = "model"
    field_path = "model"

    def lookups(self, request: HttpRequest, model_admin: admin.ModelAdmin) -> list[tuple[str, str]]:
        return [(name, name) for name in selectors.model_names()]

    def queryset(self, request: HttpRequest, queryset: QuerySet) -> QuerySet:
        value = self.value()
        return queryset.filter(**{self.field_path: value}) if value else queryset


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


# --------------------------------------------------------------------------- #
# Tasks
# --------------------------------------------------------------------------- #


@admin.register(Task)
class TaskAdmin(BoundedCountAdmin, ReadOnlyAdmin):
    list_display = (
        "id",
        "client",
        "model_column",
        "status",
        "on_restart",
        "attempts",
        "output_tokens",
        "created_at",
        "updated_at",
    )
    list_filter = (TaskStatusFilter, TaskModelFilter, "on_restart", "client")
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
                    "on_restart",
                    "attempts",
                    "output_tokens",
                    "last_sequence",
                    "created_at",
                    "updated_at",
                )
            },
        ),
        ("Worker", {"fields": ("worker", "heartbeat_at", "cancel_requested_at")}),
        ("Request", {"fields": ("request_json",)}),
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

    @admin.display(description="response")
    def response_link(self, task: Task) -> str:
        return admin_link(task.response)

    request_json = json_column("response.request", "request")

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
            if before in (TaskStatus.CANCELLING, TaskStatus.CANCELLED):
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


# --------------------------------------------------------------------------- #
# Events
# --------------------------------------------------------------------------- #


class TaskIdFilter(admin.SimpleListFilter):
    """``?task=<id>``: one task's log in order. No choice list: there may be millions of tasks."""

    title = "task"
    parameter_name = "task"

    def lookups(self, request: HttpRequest, model_admin: admin.ModelAdmin) -> list[tuple[str, str]]:
        value = self.value()
        return [(value, value)] if value else []

    def queryset(self, request: HttpRequest, queryset: QuerySet) -> QuerySet:
        value = self.value()
        return queryset.filter(task_id=value) if value else queryset


@admin.register(TaskEvent)
class TaskEventAdmin(BoundedCountAdmin, ReadOnlyAdmin):
    list_display = ("event_column", "task_column", "sequence_number", "type", "created_at", "payload_preview")
    list_display_links = ("event_column",)
    list_filter = (TaskIdFilter,)
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

    @admin.display(description="event", ordering="id")
    def event_column(self, event: TaskEvent) -> str:
        return f"#{event.sequence_number} {event.type}"

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


# --------------------------------------------------------------------------- #
# Responses, idempotency keys, pairing codes
# --------------------------------------------------------------------------- #


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


# --------------------------------------------------------------------------- #
# Clients
# --------------------------------------------------------------------------- #


class ClientCreateForm(forms.Form):
    name = forms.CharField(max_length=MAX_NAME_LENGTH, help_text="Unique among active clients.")
    scopes = forms.MultipleChoiceField(
        choices=[(scope, scope) for scope in SCOPES],
        widget=forms.CheckboxSelectMultiple,
        initial=["responses", "read"],
        help_text="responses: create and cancel its own tasks; read: read them; admin: every client's tasks.",
    )


class ClientStateFilter(admin.SimpleListFilter):
    title = "state"
    parameter_name = "state"

    def lookups(self, request: HttpRequest, model_admin: admin.ModelAdmin) -> list[tuple[str, str]]:
        return [("active", "active"), ("revoked", "revoked")]

    def queryset(self, request: HttpRequest, queryset: QuerySet) -> QuerySet:
        if self.value() == "active":
            return queryset.filter(revoked_at__isnull=True)
        if self.value() == "revoked":
            return queryset.filter(revoked_at__isnull=False)
        return queryset


@admin.register(Client)
class ClientAdmin(admin.ModelAdmin):
    """Create (the token is shown once, on the answer to the POST) and revoke; never edit or delete."""

    list_display = ("name", "scopes_column", "active", "created_at", "last_used_at", "revoked_at")
    list_filter = (ClientStateFilter,)
    search_fields = ("name",)
    ordering = ("-created_at", "-id")
    actions = ("revoke_clients",)
    # Never the token's hash.
    fields = ("name", "scopes_column", "created_at", "last_used_at", "revoked_at")
    readonly_fields = fields

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        # Tasks and responses point at their client (PROTECT): revoke instead.
        return False

    def has_revoke_permission(self, request: HttpRequest, obj: Client | None = None) -> bool:
        """Revoking changes the client: Django's "Can change client" permission."""
        opts = self.opts
        return request.user.has_perm(f"{opts.app_label}.change_{opts.model_name}")

    @admin.display(description="scopes")
    def scopes_column(self, client: Client) -> str:
        return ", ".join(client.scopes)

    @admin.display(description="active", boolean=True)
    def active(self, client: Client) -> bool:
        return client.revoked_at is None

    def add_view(self, request: HttpRequest, form_url: str = "", extra_context: dict | None = None) -> HttpResponse:
        if not self.has_add_permission(request):
            raise PermissionDenied
        form = ClientCreateForm(request.POST if request.method == "POST" else None)
        if request.method == "POST" and form.is_valid():
            try:
                client, token = client_create(name=form.cleaned_data["name"], scopes=form.cleaned_data["scopes"])
            except InvalidRequest as exc:
                form.add_error("name", exc.detail)
            else:
                self.log_addition(request, client, [{"added": {}}])
                # The token lives only in this answer: no redirect, no message
                # (messages are stored), and no copy in any cache.
                response = TemplateResponse(
                    request,
                    "admin/tasks_app/client/token_once.html",
                    {**self._page_context(request, f"Client {client.name} created"), "client": client, "token": token},
                )
                response["Cache-Control"] = "no-store"
                return response
        return TemplateResponse(
            request,
            "admin/tasks_app/client/add_form.html",
            {**self._page_context(request, "Add client"), "form": form},
        )

    def _page_context(self, request: HttpRequest, title: str) -> dict[str, Any]:
        return {
            **self.admin_site.each_context(request),
            "opts": self.opts,
            "title": title,
            "has_view_permission": self.has_view_permission(request),
            "is_popup": IS_POPUP_VAR in request.GET,
        }

    @admin.action(description="Revoke selected clients", permissions=["revoke"])
    def revoke_clients(self, request: HttpRequest, queryset: QuerySet[Client]) -> None:
        revoked = []
        for client in queryset:
            if client_revoke_by_id(client_id=client.pk) is not None:
                self.log_change(request, client, "Revoked")
                revoked.append(client.name)
        if revoked:
            self.message_user(request, f"Revoked: {', '.join(revoked)}.", messages.SUCCESS)
        else:
            self.message_user(request, "Nothing revoked: the selected clients were already revoked.", messages.WARNING)

    def revoke_view(self, request: HttpRequest, object_id: str) -> HttpResponse:
        if (refusal := post_only(request)) is not None:
            return refusal
        client = self.get_object(request, unquote(object_id))
        if client is None:
            return self._get_obj_does_not_exist_redirect(request, self.opts, object_id)
        if not self.has_revoke_permission(request, client):
            raise PermissionDenied
        if client_revoke_by_id(client_id=client.pk) is None:
            self.message_user(request, f"Client {client.name} was already revoked.", messages.WARNING)
        else:
            self.log_change(request, client, "Revoked")
            self.message_user(request, f"Client {client.name} is revoked: its token no longer works.", messages.SUCCESS)
        return HttpResponseRedirect(reverse("admin:tasks_app_client_change", args=[client.pk]))

    def get_urls(self) -> list:
        return [
            path(
                "<path:object_id>/revoke/",
                self.admin_site.admin_view(self.revoke_view),
                name="tasks_app_client_revoke",
            ),
            *super().get_urls(),
        ]

    def render_change_form(
        self,
        request: HttpRequest,
        context: dict[str, Any],
        add: bool = False,
        change: bool = False,
        form_url: str = "",
        obj: Client | None = None,
    ) -> HttpResponse:
        if obj is not None:
            context.update(
                {
                    "can_revoke": obj.revoked_at is None and self.has_revoke_permission(request, obj),
                    "revoke_url": reverse("admin:tasks_app_client_revoke", args=[obj.pk]),
                }
            )
        return super().render_change_form(request, context, add, change, form_url, obj)


# --------------------------------------------------------------------------- #
# Models
# --------------------------------------------------------------------------- #


def human_size(size: int) -> str:
    value = float(size)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{size} B"


@admin.register(ModelRecord)
class ModelRecordAdmin(ReadOnlyAdmin):
    list_display = ("name", "backend", "size_column", "digest_column", "updated_at")
    search_fields = ("name",)
    ordering = ("name",)
    fields = (
        "name",
        "path",
        "backend",
        "size_column",
        "digest",
        "capabilities_json",
        "config_json",
        "files_table",
        "created_at",
        "updated_at",
    )
    readonly_fields = fields

    def has_rescan_permission(self, request: HttpRequest) -> bool:
        """A rescan adds, updates and removes rows: Django's "Can change model" permission."""
        opts = self.opts
        return request.user.has_perm(f"{opts.app_label}.change_{opts.model_name}")

    @admin.display(description="size", ordering="size_bytes")
    def size_column(self, record: ModelRecord) -> str:
        return f"{human_size(record.size_bytes)} ({record.size_bytes} bytes)"

    @admin.display(description="digest", ordering="digest")
    def digest_column(self, record: ModelRecord) -> str:
        # The full digest is on the detail page and in the title.
        return format_html('<code title="{}">{}…</code>', record.digest, record.digest[:19])

    capabilities_json = json_column("capabilities", "capabilities")

    config_json = json_column("config", "config")

    @admin.display(description="files")
    def files_table(self, record: ModelRecord) -> str:
        rows = format_html_join(
            "",
            "<tr><td>{}</td><td>{}</td><td><code>sha256:{}</code></td></tr>",
            ((name, human_size(entry["size"]), entry["sha256"]) for name, entry in sorted(record.files.items())),
        )
        return format_html("<table><tr><th>file</th><th>size</th><th>digest</th></tr>{}</table>", rows)

    def changelist_view(self, request: HttpRequest, extra_context: dict | None = None) -> HttpResponse:
        extra = {
            "can_rescan": self.has_rescan_permission(request),
            "rescan_url": reverse("admin:tasks_app_modelrecord_rescan"),
            **(extra_context or {}),
        }
        return super().changelist_view(request, extra)

    def rescan_view(self, request: HttpRequest) -> HttpResponse:
        if (refusal := post_only(request)) is not None:
            return refusal
        if not self.has_rescan_permission(request):
            raise PermissionDenied
        try:
            report = model_scan()
        except OSError as exc:
            self.message_user(request, f"Rescan failed: {exc}", messages.ERROR)
        else:
            parts = [
                f"{label}: {', '.join(names) if names else 'none'}"
                for label, names in (("added", report.added), ("updated", report.updated), ("removed", report.removed))
            ]
            parts.append(f"unchanged: {len(report.unchanged)}")
            if report.skipped:
                parts.append(f"skipped (unreadable): {', '.join(report.skipped)}")
            self.message_user(request, "Rescanned models. " + "; ".join(parts) + ".", messages.SUCCESS)
        return HttpResponseRedirect(reverse("admin:tasks_app_modelrecord_changelist"))

    def get_urls(self) -> list:
        return [
            path("rescan/", self.admin_site.admin_view(self.rescan_view), name="tasks_app_modelrecord_rescan"),
            *super().get_urls(),
        ]
