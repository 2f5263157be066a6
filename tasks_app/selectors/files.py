"""Reads of files (docs/batches.md): strictly per client; another client's id is ``404 file_not_found``."""

from __future__ import annotations

from tasks_app.exceptions import FileNotFound
from tasks_app.models import Client, File
from tasks_app.selectors.tasks import Page


def file_get_own(*, client: Client, file_id: str) -> File:
    file = File.objects.filter(pk=file_id, client=client).first()
    if file is None:
        raise FileNotFound(f"No file with id {file_id!r}")
    return file


def file_list_own(*, client: Client, after: str | None, limit: int, order: str, purpose: str | None) -> Page:
    """In id order (``desc``: newest first; ids are ULIDs); ``after`` is the last id of the previous page."""
    rows = File.objects.filter(client=client)
    if purpose:
        rows = rows.filter(purpose=purpose)
    if after:
        rows = rows.filter(id__lt=after) if order == "desc" else rows.filter(id__gt=after)
    found = list(rows.order_by("-id" if order == "desc" else "id")[: limit + 1])
    return Page(items=found[:limit], has_more=len(found) > limit)
