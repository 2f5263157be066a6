"""The operator's admin (``/admin/``): read-only tables; every change goes through a service.

Nothing here writes a row itself. Cancelling calls ``services.tasks.task_cancel``
(so an admin cancel obeys the lifecycle rules an API cancel does), creating and
revoking clients call ``services.clients``, and "Rescan models" calls
``services.model_scan.model_scan``. Every model admin refuses change and delete
(Django's own edit forms would bypass the services), so the change views are
view-only pages and a POST to them is a 403.

Large tables (tasks, events, idempotency keys, responses) are listed without a
full ``COUNT(*)``: ``BoundedCountPaginator`` counts at most a page window's rows
and the list says "more than N". Permissions: see ``docs/admin.md``.

Django's autodiscover imports this package only, so it imports every module
that registers an admin.
"""

from __future__ import annotations

from django.contrib import admin

from tasks_app.admin import (
    client_admin,
    conversation_admin,
    model_record_admin,
    record_admins,
    task_admin,
    webhook_admin,
    worker_admin,
)
from tasks_app.admin.bounded_counts import BoundedCountAdmin, BoundedCountPaginator
from tasks_app.admin.task_admin import TaskAdmin

__all__ = (
    "BoundedCountAdmin",
    "BoundedCountPaginator",
    "TaskAdmin",
    "batch_admin",
    "client_admin",
    "conversation_admin",
    "model_record_admin",
    "record_admins",
    "task_admin",
    "webhook_admin",
    "worker_admin",
)

admin.site.site_header = "LMSP service"
admin.site.site_title = "LMSP admin"
admin.site.index_title = "Operations"
# The service has no site outside the API and the admin.
admin.site.site_url = None
# No app list beside every page: its 300 px are the task list's columns at 1280 px (the home page lists them).
admin.site.enable_nav_sidebar = False
