"""The harness's end of a transactional test (``tests.support.flush``) leaves what Django's flush left.

Every table empty but the content types and permissions ``migrate`` wrote;
rows that reference each other go in one transaction on both databases.
The two tests run in this order (one file, one worker): the second sees
what the first one's teardown left.
"""

from __future__ import annotations

from django.contrib.admin.models import ADDITION, LogEntry
from django.contrib.auth.models import Group, Permission, User
from django.contrib.contenttypes.models import ContentType
from django.contrib.sessions.backends.db import SessionStore
from django.db import connection
from django.test import TransactionTestCase

from tasks_app.models import Task
from tasks_app.registry.scan import model_scan
from tests.support import flush
from tests.support.api import ApiClient

BODY = {"type": "response", "input": {"model": "demo", "input": "Hello"}, "on_restart": "retry"}


def rows_per_table() -> dict[str, int]:
    with connection.cursor() as cursor:
        counts = {}
        for table in connection.introspection.django_table_names(only_existing=True, include_views=False):
            cursor.execute(f"SELECT COUNT(*) FROM {connection.ops.quote_name(table)}")
            counts[table] = cursor.fetchone()[0]
    return counts


def write_everywhere(api: ApiClient) -> None:
    """Rows in the auth, admin and session tables and in the service's own, most of them referencing others."""
    user = User.objects.create_superuser("root", password="x")
    group = Group.objects.create(name="viewers")
    group.permissions.add(Permission.objects.get(codename="view_task"))
    user.groups.add(group)
    user.user_permissions.add(Permission.objects.get(codename="change_task"))
    SessionStore().create()
    reply = api.post("/lmsp/v1/tasks", BODY, headers={"Idempotency-Key": "k"})
    assert reply.status_code == 202
    LogEntry.objects.create(
        user=user,
        content_type=ContentType.objects.get_for_model(Task),
        object_id=reply.json()["id"],
        object_repr="a task",
        action_flag=ADDITION,
    )


def test_the_harness_empties_every_table_but_what_migrate_wrote(transactional_db, queue, api, make_client, settings):
    assert TransactionTestCase._fixture_teardown is flush._fixture_teardown  # installed by tests/conftest.py
    write_everywhere(api)
    filled = {table for table, count in rows_per_table().items() if count}
    assert {"tasks", "task_events", "auth_user_groups", "django_admin_log", "django_session"} <= filled

    emptied = flush.database_empty(alias="default")

    counts = rows_per_table()
    assert {name.strip('"`') for name in emptied} == filled - flush.KEPT_TABLES
    assert {table for table, count in counts.items() if count} == set(flush.KEPT_TABLES)
    # Again (the client and the model records went too), for the teardown that the next test checks.
    model_scan(models_dir=settings.LMSP_MODELS_DIR)
    client, token = make_client("again")
    write_everywhere(ApiClient(token, client))


def test_the_last_tests_rows_are_gone_and_what_migrate_wrote_stays(transactional_db):
    counts = rows_per_table()
    assert {table for table, count in counts.items() if count} == set(flush.KEPT_TABLES)
    assert Permission.objects.filter(codename="view_task").exists()
