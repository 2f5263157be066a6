"""Read-only admin views of the tables; changes go through services only."""

from django.contrib import admin

from tasks_app.models import Client, IdempotencyKey, ModelRecord, PairingCode, Response, Task, TaskEvent


class ReadOnlyAdmin(admin.ModelAdmin):
    def has_add_permission(self, request, obj=None):
        return False

    def has_change_permission(self, request, obj=None):
        return False

    def has_delete_permission(self, request, obj=None):
        return False


@admin.register(Task)
class TaskAdmin(ReadOnlyAdmin):
    list_display = ("id", "client", "status", "on_restart", "attempts", "last_sequence", "created_at", "updated_at")
    list_filter = ("status", "on_restart")
    search_fields = ("id", "response__id")
    list_select_related = ("client",)
    show_full_result_count = False


@admin.register(TaskEvent)
class TaskEventAdmin(ReadOnlyAdmin):
    list_display = ("task", "sequence_number", "type", "created_at")
    search_fields = ("task__id",)
    show_full_result_count = False


@admin.register(Response)
class ResponseAdmin(ReadOnlyAdmin):
    list_display = ("id", "client", "model", "status", "created_at")
    list_filter = ("status",)
    search_fields = ("id",)
    show_full_result_count = False


@admin.register(Client)
class ClientAdmin(ReadOnlyAdmin):
    list_display = ("name", "scopes", "created_at", "last_used_at", "revoked_at")
    exclude = ("token_hash",)


@admin.register(ModelRecord)
class ModelRecordAdmin(ReadOnlyAdmin):
    list_display = ("name", "backend", "size_bytes", "digest", "updated_at")


@admin.register(IdempotencyKey)
class IdempotencyKeyAdmin(ReadOnlyAdmin):
    list_display = ("client", "endpoint", "key", "state", "response_status", "expires_at")


@admin.register(PairingCode)
class PairingCodeAdmin(ReadOnlyAdmin):
    list_display = ("id", "scopes", "created_at", "expires_at", "used_at", "client")
    exclude = ("code_hash",)
