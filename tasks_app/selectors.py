"""Reads. Visibility rules (a client sees its own rows, `admin` sees all) live here."""

from __future__ import annotations

from dataclasses import dataclass

from django.db.models import Q, QuerySet

from tasks_app.exceptions import ModelNotFound, ResponseNotFound, TaskNotFound
from tasks_app.models import Client, ModelRecord, Response, Task, TaskStatus


def _sees_all(client: Client) -> bool:
    return "admin" in client.scopes


def task_get_visible(*, client: Client, task_id: str) -> Task:
    """The task if this client may see it; otherwise 404, never 403."""
    qs = Task.objects.select_related("response").filter(pk=task_id)
    if not _sees_all(client):
        qs = qs.filter(client=client)
    task = qs.first()
    if task is None:
        raise TaskNotFound(f"No task with id {task_id!r}")
    return task


def response_get_visible(*, client: Client, response_id: str) -> Response:
    qs = Response.objects.filter(pk=response_id)
    if not _sees_all(client):
        qs = qs.filter(client=client)
    response = qs.first()
    if response is None:
        raise ResponseNotFound(f"No response with id {response_id!r}")
    return response


@dataclass(frozen=True)
class Page:
    items: list
    has_more: bool


def task_list_visible(*, client: Client, statuses: list[str] | None, after: str | None, limit: int) -> Page:
    """Newest first; ``after`` is the id of the last task of the previous page."""
    qs: QuerySet[Task] = Task.objects.all()
    if not _sees_all(client):
        qs = qs.filter(client=client)
    if statuses:
        qs = qs.filter(status__in=statuses)
    if after:
        # Ids are ULIDs: id order is creation order.
        qs = qs.filter(id__lt=after)
    rows = list(qs.order_by("-id")[: limit + 1])
    items = rows[:limit]
    _attach_succeeded_responses(items)
    return Page(items=items, has_more=len(rows) > limit)


def _attach_succeeded_responses(tasks: list[Task]) -> None:
    """Load, in one query, the responses the task objects show (only succeeded
    tasks show theirs); the others' prompts and outputs stay in the database."""
    wanted = {task.response_id: task for task in tasks if task.status == TaskStatus.SUCCEEDED}
    if wanted:
        for response in Response.objects.filter(pk__in=wanted):
            wanted[response.pk].response = response


def _name_candidates(name: str) -> list[str]:
    # `name` and `name:latest` are the same model, as in Ollama.
    if name.endswith(":latest"):
        return [name, name[: -len(":latest")]]
    if ":" not in name:
        return [name, f"{name}:latest"]
    return [name]


def model_get_by_name(name: str) -> ModelRecord:
    rows = {m.name: m for m in ModelRecord.objects.filter(name__in=_name_candidates(name))}
    for candidate in _name_candidates(name):
        if candidate in rows:
            return rows[candidate]
    raise ModelNotFound(
        f"Model {name!r} is not registered",
        errors=[{"field": "input.model", "message": f"unknown model {name!r}"}],
    )


def model_list(*, after: str | None, limit: int) -> Page:
    """Models newest first; ``after`` is the name of the last model of the previous page."""
    qs = ModelRecord.objects.order_by("-created_at", "-id")
    if after:
        anchor = ModelRecord.objects.filter(name=after).values_list("created_at", "id").first()
        if anchor is None:
            return Page(items=[], has_more=False)
        created_at, pk = anchor
        qs = qs.filter(Q(created_at__lt=created_at) | Q(created_at=created_at, id__lt=pk))
    rows = list(qs[: limit + 1])
    return Page(items=rows[:limit], has_more=len(rows) > limit)
