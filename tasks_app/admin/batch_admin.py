"""The batch and file admins (docs/batches.md): read-only; a batch's progress is its own row's counts."""

from __future__ import annotations

from django.contrib import admin

from tasks_app.admin.access import ReadOnlyAdmin
from tasks_app.models import Batch, File


@admin.register(Batch)
class BatchAdmin(ReadOnlyAdmin):
    list_display = ("id", "client", "endpoint", "status", "progress", "created_at", "expires_at")
    list_filter = ("status", "client")
    search_fields = ("id__exact",)
    search_help_text = "A batch id (batch_…), exactly."
    list_select_related = ("client",)
    ordering = ("-id",)
    fields = (
        *("id", "client", "endpoint", "model", "status", "progress", "errors", "metadata"),
        *("input_tokens", "cached_tokens", "output_tokens"),
        *("input_file_id", "output_file_id", "error_file_id", "output_lines", "error_lines"),
        *("created_at", "in_progress_at", "expires_at", "finalizing_at", "completed_at", "failed_at"),
        *("expired_at", "cancelling_at", "cancelled_at"),
    )
    readonly_fields = fields

    @admin.display(description="progress")
    def progress(self, batch: Batch) -> str:
        # The counts are columns of the row: this costs no query per batch listed.
        done = batch.completed + batch.failed
        share = f" ({100 * done // batch.total}%)" if batch.total else ""
        return f"{done}/{batch.total}{share}: {batch.completed} completed, {batch.failed} failed"


@admin.register(File)
class FileAdmin(ReadOnlyAdmin):
    list_display = ("id", "client", "filename", "purpose", "bytes", "created_at")
    list_filter = ("purpose", "client")
    search_fields = ("id__exact",)
    search_help_text = "A file id (file-…), exactly."
    list_select_related = ("client",)
    ordering = ("-id",)
    fields = ("id", "client", "filename", "purpose", "bytes", "sha256", "path", "created_at", "expires_at")
    readonly_fields = fields
