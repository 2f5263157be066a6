"""HTML for read-only fields, and links from one admin page to another."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from django.contrib import admin
from django.urls import reverse
from django.utils.html import format_html
from django.utils.http import urlencode

from tasks_app.admin.filters import TaskIdFilter


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


def status_badge(kind: str, text: str, title: str = "") -> str:
    """A coloured label (``admin.css``: ``lmsp-status-<kind>``), for a status the eye must find in a list."""
    return format_html('<span class="lmsp-status lmsp-status-{}" title="{}">{}</span>', kind, title or text, text)


def duration_text(ms: float | None) -> str:
    """``850 ms``, ``12.3 s``, ``4 min 05 s``, ``2 h 03 min``; ``-`` for none."""
    if ms is None:
        return "-"
    if ms < 1000:
        return f"{ms:.0f} ms"
    seconds = ms / 1000
    if seconds < 60:
        return f"{seconds:.1f} s"
    if seconds < 3600:
        return f"{int(seconds // 60)} min {int(seconds % 60):02d} s"
    return f"{int(seconds // 3600)} h {int(seconds % 3600 // 60):02d} min"
