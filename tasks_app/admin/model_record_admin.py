"""The models admin: the registered models, read-only, and "Rescan models"."""

from __future__ import annotations

from django.contrib import admin, messages
from django.core.exceptions import PermissionDenied
from django.http import HttpRequest, HttpResponse, HttpResponseRedirect
from django.urls import path, reverse
from django.utils.html import format_html, format_html_join

from tasks_app.admin.access import ReadOnlyAdmin, post_only
from tasks_app.admin.display import json_column
from tasks_app.models import ModelRecord
from tasks_app.registry.scan import model_scan


def human_size(size: int) -> str:
    value = float(size)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{size} B"


@admin.register(ModelRecord)
class ModelRecordAdmin(ReadOnlyAdmin):
    list_display = ("name", "layout", "backend", "size_column", "digest_column", "updated_at")
    list_filter = ("layout",)
    search_fields = ("name",)
    ordering = ("name",)
    fields = (
        "name",
        "path",
        "graph",
        "layout",
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
            self.message_user(request, "Rescanned models. " + "; ".join(parts) + ".", messages.SUCCESS)
            # A folder that is not a model (or could not be read) is named with the file, as the CLI does.
            for where, message in report.problems:
                self.message_user(request, f"Skipped {where}: {message}", messages.WARNING)
        return HttpResponseRedirect(reverse("admin:tasks_app_modelrecord_changelist"))

    def get_urls(self) -> list:
        return [
            path("rescan/", self.admin_site.admin_view(self.rescan_view), name="tasks_app_modelrecord_rescan"),
            *super().get_urls(),
        ]
