"""Fault points that a test arms in a real process, to freeze it where no signal could land on purpose.

``LMSP_FAULT_FREEZE=<point>[@<n>]`` makes the process stop itself (SIGSTOP,
as a paused VM or a swapped-out process stops) the ``n``-th time (default:
the first) it passes that point, and only then. The points sit inside write
transactions, after the compare-and-set: a lifecycle verb's name (holding
SQLite's write lock, or the task row's lock on PostgreSQL), and
``tasks_recover`` (a page of recovery, before its commit). The test sends
SIGCONT, or SIGKILL to see what a crash there leaves. Unset (always, outside
tests), :data:`ARMED` is False and a fault point costs one attribute read.

``LMSP_FAULT_MODEL_CALL_SECONDS=<s>`` makes every model call of a generation
wait that long first, as a slow device would (:func:`slowed`): a test that
must see a worker commit between tokens gets that on any machine, where a
fast one would otherwise make the whole generation before the first commit.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable

_point, _, _nth = os.environ.get("LMSP_FAULT_FREEZE", "").partition("@")
ARMED = bool(_point)
_remaining = int(_nth or 1)
MODEL_CALL_SECONDS = float(os.environ.get("LMSP_FAULT_MODEL_CALL_SECONDS") or 0)


def freeze_point(name: str) -> None:
    """Stop this process here if the test armed ``name`` and this is its turn."""
    global _remaining
    if name != _point or _remaining <= 0:
        return
    _remaining -= 1
    if _remaining == 0:
        os.kill(os.getpid(), signal.SIGSTOP)


def slowed(should_stop: Callable[[], bool]) -> Callable[[], bool]:
    """``should_stop`` (asked before every model call), made to wait ``MODEL_CALL_SECONDS`` first when armed."""
    if not MODEL_CALL_SECONDS:
        return should_stop

    def slow_should_stop() -> bool:
        time.sleep(MODEL_CALL_SECONDS)
        return should_stop()

    return slow_should_stop
