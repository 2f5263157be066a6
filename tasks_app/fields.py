"""A JSON column that keeps the text it was given."""

from __future__ import annotations

import json
from typing import Any

from django.db import models


class JSONTextField(models.TextField):
    """JSON stored as text, read back with its key order intact.

    PostgreSQL's ``jsonb`` (Django's JSONField there) re-sorts object keys, so
    a task's ``error`` or a stored idempotent reply would come back in another
    order than on SQLite. Objects we hand to clients use this field instead, so
    both databases answer the same bytes. Nothing queries inside these values.
    """

    def from_db_value(self, value: str | None, expression: Any, connection: Any) -> Any:
        return None if value is None else json.loads(value)

    def to_python(self, value: Any) -> Any:
        if isinstance(value, str):
            try:
                return json.loads(value)
            except ValueError:
                return value
        return value

    def get_prep_value(self, value: Any) -> str | None:
        if value is None:
            return None
        return json.dumps(value, ensure_ascii=False, separators=(",", ":"))

    def value_to_string(self, obj: models.Model) -> str:
        return self.get_prep_value(self.value_from_object(obj)) or ""


class EventPayloadField(models.TextField):
    """Text that bulk inserts bind as one parameter per row.

    On PostgreSQL Django 5.2 inserts many rows through ``UNNEST`` of one array
    per column, and psycopg then escapes every string of such an array in
    Python, a regular expression per element: for events, whose payloads are
    JSON of up to a few kilobytes, that cost a sixth of a recovery of 10,000
    tasks (bench/README.md). A field with its own placeholder keeps the plain
    ``VALUES`` form, whose parameters psycopg sends as they are.
    """

    def get_placeholder(self, value: Any, compiler: Any, connection: Any) -> str:
        return "%s"

    def deconstruct(self) -> Any:
        # The column stays a plain text column: migrations see a TextField, so
        # this class needs none (on SQLite an AlterField would copy the whole table).
        name, _, args, kwargs = super().deconstruct()
        return name, "django.db.models.TextField", args, kwargs
