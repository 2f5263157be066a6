"""A task accepted while the broker is down is kept, and runs once the broker is back."""

from __future__ import annotations

from tasks_app.models import Task
from tasks_app.states import TaskStatus
from tests.support.sse import call
from tests.support.waiting import wait_until


def test_task_created_while_the_broker_is_down_runs_after_it_returns(private_stack, capfd):
    sweeper = {"LMSP_SWEEP_INTERVAL_SECONDS": "1", "LMSP_SWEEP_GRACE_SECONDS": "0"}
    with private_stack("outage", sweeper, beat=True) as stack:
        stack.redis.stop()

        status, task = call(
            stack.base,
            "POST",
            "/lmsp/v1/tasks",
            token=stack.token,
            body={"type": "response", "input": {"model": "demo", "input": "Are you there?", "max_output_tokens": 8}},
        )

        assert status == 202
        assert task["status"] == "queued"
        assert Task.objects.get(pk=task["id"]).status == TaskStatus.QUEUED
        # The web process sends after the 202: Redis stays down until that send
        # has failed (the web server's stderr is the test's), so only the
        # sweeper can bring the task to a worker.
        web_log: list[str] = []
        wait_until(
            lambda: web_log.append(capfd.readouterr().err) or "could not dispatch" in "".join(web_log),
            what=lambda: f"the web process never reported the failed send:\n{''.join(web_log)[-2000:]}",
        )
        assert task["id"] in "".join(web_log)
        stack.redis.start()

        def finished() -> dict | None:
            _, current = call(stack.base, "GET", f"/lmsp/v1/tasks/{task['id']}", token=stack.token)
            return current if current["status"] in {"succeeded", "failed", "cancelled"} else None

        current = wait_until(finished, what=lambda: f"the task never ended:\n{stack.worker.log()[-3000:]}", timeout=90)
        assert current["status"] == "succeeded"
        assert current["response"]["usage"]["output_tokens"] == 8
        assert "sweeper re-dispatched 1 waiting task(s): " + task["id"] in stack.worker.log()
