"""What the admin refuses: Django's own edit forms, and action views reached without a POST.

The edit forms would write rows past the services, so every model admin is
view-only; the few changes it offers are POST-only views that call a service.
"""

from __future__ import annotations

from typing import Any

from django.contrib import admin
from django.http import HttpRequest, HttpResponse, HttpResponseNotAllowed


class ReadOnlyAdmin(admin.ModelAdmin):
    """View-only pages: no add, change or delete (nor the bulk delete action)."""

    def has_add_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False


def post_only(request: HttpRequest) -> HttpResponse | None:
    return None if request.method == "POST" else HttpResponseNotAllowed(["POST"])
