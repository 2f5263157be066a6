"""Ways through the lifecycle table, for tests that need a task in a given status."""

from __future__ import annotations

from tasks_app.states import TaskStatus

S = TaskStatus

# The way from `queued` to each status, using only allowed moves; running
# and cancelling go through `running`, as a real generation does.
PATHS: dict[TaskStatus, list[TaskStatus]] = {
    S.QUEUED: [],
    S.LOADING: [S.LOADING],
    S.RUNNING: [S.LOADING, S.RUNNING],
    S.CANCELLING: [S.LOADING, S.RUNNING, S.CANCELLING],
    S.SUCCEEDED: [S.LOADING, S.RUNNING, S.SUCCEEDED],
    S.FAILED: [S.LOADING, S.RUNNING, S.FAILED],
    S.CANCELLED: [S.CANCELLED],
}
