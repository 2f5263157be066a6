"""The Redis namespace of this test run."""

from __future__ import annotations

import os

# Every Redis key, queue and channel of this run carries its own prefix, so a
# test run never touches a running service's queue (or another run's).
REDIS_PREFIX = f"lmsp-test-{os.getpid()}"
