"""Reads of batches (docs/batches.md): strictly per client; another client's id is ``404 batch_not_found``.

A batch's progress is its own row (``request_counts`` are columns), so a read
or a page of a list costs one query whatever the batches' sizes.
"""

from __future__ import annotations

from tasks_app.exceptions import BatchNotFound
from tasks_app.models import Batch, Client
from tasks_app.selectors.tasks import Page


def batch_get_own(*, client: Client, batch_id: str) -> Batch:
    batch = Batch.objects.filter(pk=batch_id, client=client).first()
    if batch is None:
        raise BatchNotFound(f"No batch with id {batch_id!r}")
    return batch


def batch_list_own(*, client: Client, after: str | None, limit: int) -> Page:
    """Newest first (ids are ULIDs); ``after`` is the last id of the previous page."""
    rows = Batch.objects.filter(client=client)
    if after:
        rows = rows.filter(id__lt=after)
    found = list(rows.order_by("-id")[: limit + 1])
    return Page(items=found[:limit], has_more=len(found) > limit)
