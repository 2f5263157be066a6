"""Waiting for something another process does.

A deadline here guards against a hang (a test that would otherwise never
end); it is not a claim about speed, so it raises ``TimeoutError`` naming what
never happened instead of asserting on the clock. Speed is measured in bench/.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def wait_until(probe: Callable[[], T], *, what: str | Callable[[], str], timeout: float = 60) -> T:
    """Call ``probe`` until it returns something truthy, and return that."""
    deadline = time.monotonic() + timeout
    while True:
        result = probe()
        if result:
            return result
        if time.monotonic() > deadline:
            raise TimeoutError(what if isinstance(what, str) else what())
        time.sleep(0.02)
