"""An open stream keeps delivering while Redis is down and after it comes back (it polls meanwhile)."""

from __future__ import annotations

from tests.support.demo import ENDLESS_MODEL
from tests.support.logs import as_rows, events_path, stored
from tests.support.sse import call, open_stream


def test_an_open_stream_survives_a_redis_restart_without_gap_or_duplicate(private_stack):
    with private_stack("restart", {"LMSP_STREAM_FALLBACK_POLL_MS": "100"}) as stack:
        body = {"type": "response", "input": {"model": ENDLESS_MODEL, "input": "Keep going", "max_output_tokens": 2500}}
        status, task = call(stack.base, "POST", "/lmsp/v1/tasks", token=stack.token, body=body)
        assert status == 202
        with open_stream(stack.base, events_path(task["id"]), token=stack.token) as stream:
            before = stream.take(30)
            stack.redis.stop()
            while_down = stream.take(60)
            stack.redis.start()
            rest = stream.all()

    seen = before + while_down + rest
    assert len(while_down) == 60
    assert [event.id for event in seen] == list(range(len(seen)))
    assert as_rows(seen) == stored(task["id"])
    assert seen[-1].event == "response.incomplete"
