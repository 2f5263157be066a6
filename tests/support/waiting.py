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


# A probe is often a query or a request that the processes under test must
# answer, on a machine whose cores they share: polls start every 20 ms (a
# condition met at once is seen as soon as before) and slow down as the wait
# grows, to a twentieth of the time waited so far (at most 0.1 s), so a long
# wait costs ten polls a second instead of fifty, and is seen at most 5% late.
FIRST_POLL_SECONDS = 0.02
LAST_POLL_SECONDS = 0.1


def poll_interval(waited: float) -> float:
    """How long to sleep before the next poll, after ``waited`` seconds of polling."""
    return min(LAST_POLL_SECONDS, max(FIRST_POLL_SECONDS, waited / 20))


def wait_until(probe: Callable[[], T], *, what: str | Callable[[], str], timeout: float = 60) -> T:
    """Call ``probe`` until it returns something truthy, and return that."""
    started = time.monotonic()
    deadline = started + timeout
    while True:
        result = probe()
        if result:
            return result
        now = time.monotonic()
        if now > deadline:
            raise TimeoutError(what if isinstance(what, str) else what())
        time.sleep(poll_interval(now - started))
