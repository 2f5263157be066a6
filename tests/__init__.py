import pytest

# The helpers in tests/support assert too; rewritten like test modules, their
# failures show the values compared. Registered before anything imports them.
pytest.register_assert_rewrite("tests.support")
