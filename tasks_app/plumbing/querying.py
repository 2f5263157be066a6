"""Task filters written so that SQLite can use the partial indexes on ``tasks``.

SQLite uses a partial index only when, as it prepares a statement, it can
prove that the query's WHERE implies the index's WHERE, and its proof is
literal: some AND-term of the query must be the index's own condition,
``"status" IN ('queued', 'loading', 'running', 'cancelling')`` for
``task_active``, written with the same values in the same order. Django binds
``status=...`` and ``status__in=[...]`` as parameters, which hides the values,
and even ``status = 'queued'`` written out is not enough; SQLite then scans an
index over every task ever kept (14-59 ms per statement at 200,000 tasks,
against 0.2-1.9 ms through the partial index; bench/README.md,
``partial_indexes.py``).

PostgreSQL proves such implications itself and, with Django's client-side
binding, sees the values anyway; there the filter is a plain ``IN`` of
literals, without the redundant term that would only skew its row estimates.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from django.db.models import BooleanField, Expression, F

from tasks_app.states import ACTIVE, TERMINAL, TaskStatus, in_declaration_order

# The conditions of the partial indexes task_active and task_finished
# (tasks_app/models.py), in their order: SQLite compares them term by term.
_INDEXED_GROUPS: tuple[tuple[TaskStatus, ...], ...] = tuple(map(in_declaration_order, (ACTIVE, TERMINAL)))


def _literals(statuses: Iterable[TaskStatus]) -> str:
    # Only TaskStatus values get here (checked in status_in), never a caller's string.
    return ", ".join(f"'{status.value}'" for status in statuses)


class _StatusIn(Expression):
    output_field = BooleanField()

    def __init__(self, statuses: tuple[TaskStatus, ...]) -> None:
        super().__init__()
        self.statuses = statuses
        # A column reference, not a table name written out: it compiles to
        # whatever alias the query gives the tasks table.
        self.column: Any = F("status")

    def get_source_expressions(self) -> list[Any]:
        return [self.column]

    def set_source_expressions(self, exprs: list[Any]) -> None:
        (self.column,) = exprs

    def as_sql(self, compiler: Any, connection: Any) -> tuple[str, list[Any]]:
        column, params = compiler.compile(self.column)
        return f"({column} IN ({_literals(self.statuses)}))", list(params)

    def as_sqlite(self, compiler: Any, connection: Any) -> tuple[str, list[Any]]:
        column, params = compiler.compile(self.column)
        wanted = set(self.statuses)
        for group in _INDEXED_GROUPS:
            if wanted <= set(group):
                terms = [f"{column} IN ({_literals(group)})"]
                if wanted != set(group):
                    terms.append(f"{column} IN ({_literals(self.statuses)})")
                # Parenthesised AND-terms stay separate terms for SQLite's proof.
                return f"({' AND '.join(terms)})", list(params) * len(terms)
        return self.as_sql(compiler, connection)


def status_in(statuses: Iterable[str]) -> Expression:
    """A condition for ``.filter()``: the task's status is one of ``statuses``.

    Same rows as ``status__in=statuses``, but written so that SQLite reads
    them through the partial index ``task_active`` (statuses all unfinished)
    or ``task_finished`` (all terminal) rather than scanning every task: see
    this module's docstring. Raises ``ValueError`` for an empty set or a value
    that is not a :class:`TaskStatus`.
    """
    wanted = {TaskStatus(status) for status in statuses}
    if not wanted:
        raise ValueError("status_in needs at least one status")
    # Declaration order, so that one set always gives the same statement.
    return _StatusIn(in_declaration_order(wanted))
