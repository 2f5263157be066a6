"""How a transactional test's rows are removed after it: DELETE from the tables that hold any.

Django's ``TransactionTestCase`` ends each test with ``manage.py flush``. On
PostgreSQL that is a TRUNCATE of every table, empty or not (85 ms for our 20
on an idle machine: each table and index gets new files, and every session
connected to the database rebuilds its cache of them), then the post_migrate
signal that re-creates the content types and permissions the TRUNCATE took
(10 ms). The PostgreSQL pass runs that after hundreds of tests, beside the
SQLite pass on the same cores (decision 0003).

The same end state, cheaper: one query finds the tables that hold rows, and
one transaction DELETEs them (Django's foreign keys are deferred to the
commit, so the order does not matter). The content types and permissions
that ``migrate`` wrote stay (no test changes them), so no signal has to put
them back. ``tests/test_support_flush.py`` checks that every table is empty
after a transactional test that wrote to the auth, admin, session and service
tables.
"""

from __future__ import annotations

from django.db import connections, transaction
from django.test import TransactionTestCase

# Written once by migrate's post_migrate; read by the admin tests, never changed by a test.
KEPT_TABLES = frozenset({"django_content_type", "auth_permission"})

_tables: dict[str, list[str]] = {}


def database_empty(*, alias: str) -> list[str]:
    """Delete every row of the test database ``alias`` but the kept ones; return the tables that had rows."""
    connection = connections[alias]
    if alias not in _tables:
        names = connection.introspection.django_table_names(only_existing=True, include_views=False)
        _tables[alias] = [connection.ops.quote_name(name) for name in sorted(set(names) - KEPT_TABLES)]
    quoted = _tables[alias]
    with transaction.atomic(using=alias), connection.cursor() as cursor:
        cursor.execute(
            " UNION ALL ".join(f"SELECT {i} WHERE EXISTS (SELECT 1 FROM {name})" for i, name in enumerate(quoted))
        )
        filled = [quoted[i] for (i,) in cursor.fetchall()]
        for name in filled:
            cursor.execute(f"DELETE FROM {name}")
    return filled


_django_fixture_teardown = TransactionTestCase._fixture_teardown


def _fixture_teardown(self: TransactionTestCase) -> None:
    if self.available_apps is not None or self.serialized_rollback or self.reset_sequences:
        # What Django's flush does differently for these (none of our tests asks for them).
        _django_fixture_teardown(self)
        return
    for alias in self._databases_names(include_mirrors=False):
        database_empty(alias=alias)


def install() -> None:
    """Every transactional test of this process ends with ``database_empty`` instead of ``flush``."""
    TransactionTestCase._fixture_teardown = _fixture_teardown
