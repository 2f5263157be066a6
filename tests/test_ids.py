"""Prefixed ULIDs: format and order."""

from __future__ import annotations

import pytest

from tasks_app.ids import is_prefixed_ulid, new_message_id, new_response_id, new_task_id, new_ulid

# No database here: the PostgreSQL pass of scripts/test leaves these out (tests/conftest.py).
pytestmark = pytest.mark.database_free


def test_prefixes_and_length():
    for make, prefix in ((new_task_id, "task_"), (new_response_id, "resp_"), (new_message_id, "msg_")):
        value = make()
        assert value.startswith(prefix)
        assert len(value) == len(prefix) + 26
        assert is_prefixed_ulid(value, prefix)


def test_ids_sort_by_creation_even_within_one_millisecond():
    values = [new_ulid() for _ in range(5000)]
    assert values == sorted(values)
    assert len(set(values)) == len(values)


def test_rejects_malformed():
    assert not is_prefixed_ulid("task_" + "U" * 26, "task_")  # U is not Crockford
    assert not is_prefixed_ulid("task_" + "0" * 25, "task_")
    assert not is_prefixed_ulid("resp_" + new_ulid(), "task_")
    assert not is_prefixed_ulid("task_" + "8" + "0" * 25, "task_")  # beyond 48-bit time
