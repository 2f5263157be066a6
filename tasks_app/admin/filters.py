"""List filters that more than one admin page uses."""

from __future__ import annotations

from django.contrib import admin
from django.db.models import QuerySet
from django.http import HttpRequest

from tasks_app.selectors import tasks as selectors


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
