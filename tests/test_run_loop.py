"""The run loop (``workers.run_loop``) and its group commits (``lifecycle.tasks_progress``).

Group commits: each task's compare-and-set is its own: a cancelled task loses alone, the others commit
their events and snapshot rows as one ``task_progress`` each would. The loop carries rows without a
thread each: a row's first chunk is taken at once, the rows that became ready while a step ran go
together into the next, a place among the rows is taken before a claim and freed when the row ends,
quiet rows get their heartbeat, and a step that fails does not lose its rows.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext

from tasks_app.core import lifecycle
from tasks_app.core.lifecycle import ProgressBatch
from tasks_app.models import Task, TaskEvent, TaskSnapshot
from tasks_app.states import TaskStatus
from tests.support.moves import ITEM_ID, WORKER, move
from tests.support.specs import spec_json
from tests.support.waiting import wait_until
from workers.run_loop import RunLoop

S = TaskStatus
pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def running(make_client, demo_model):
    client, _ = make_client()

    def make(count: int) -> list[str]:
        ids = []
        for _ in range(count):
            task = lifecycle.task_insert(
                client=client,
                request={"model": "demo", "input": "x"},
                generation=spec_json({"model": "demo", "input": "x"}),
                model="demo",
            )
            assert move(task.id, S.LOADING).won and move(task.id, S.RUNNING).won
            ids.append(task.id)
        return ids

    return make


def batch(task_id: str, *texts: str, tokens: int = 1, worker: str = WORKER) -> ProgressBatch:
    snapshot = {"token_ids": list(range(tokens)), "state": {"item_id": ITEM_ID, "backend": {"step": tokens}}}
    return ProgressBatch(task_id, worker, ITEM_ID, list(texts), tokens, snapshot)


def deltas_of(task_id: str) -> list[str]:
    rows = TaskEvent.objects.filter(task_id=task_id, type="response.output_text.delta").order_by("sequence_number")
    return [json.loads(row.payload)["delta"] for row in rows]


def test_each_task_of_a_group_commits_as_alone_and_a_cancelled_one_loses_alone(running) -> None:
    first, cancelled, third = running(3)
    assert lifecycle.task_request_cancel(task_id=cancelled).won
    results = lifecycle.tasks_progress(
        batches=[batch(third, "c1", "c2", tokens=2), batch(cancelled, "lost"), batch(first, "a1", tokens=1)]
    )
    assert [r.task.id for r in results] == [third, cancelled, first]  # the order of the batches
    assert [r.won for r in results] == [True, False, True]
    assert results[1].task.status == S.CANCELLING
    assert deltas_of(third) == ["c1", "c2"] and deltas_of(first) == ["a1"] and deltas_of(cancelled) == []
    for result in (results[0], results[2]):
        task = Task.objects.get(pk=result.task.id)
        sequences = list(TaskEvent.objects.filter(task=task).values_list("sequence_number", flat=True))
        assert sequences == list(range(task.last_sequence + 1))  # contiguous from 0, as one task_progress makes them
        assert [e.sequence_number for e in result.events] == sequences[-len(result.events) :]
        (row,) = TaskSnapshot.objects.filter(task=task)  # this batch's, numbered by its last event
        assert row.sequence_number == task.last_sequence
    assert Task.objects.get(pk=third).output_tokens == 2
    # One transaction, one clock reading: every event the group wrote carries the same time.
    stamps = {
        e.created_at
        for r in results
        if r.won
        for e in TaskEvent.objects.filter(task_id=r.task.id).filter(
            sequence_number__in=[event.sequence_number for event in r.events]
        )
    }
    assert len(stamps) == 1
    assert not TaskSnapshot.objects.filter(task_id=cancelled).exists()


def test_a_group_is_one_transaction_of_four_statements_a_task(running) -> None:
    ids = running(5)
    with CaptureQueriesContext(connection) as captured:
        results = lifecycle.tasks_progress(batches=[batch(task_id, "x", "y") for task_id in ids])
    assert all(r.won for r in results)
    statements = [q["sql"].split()[0].upper() for q in captured.captured_queries]
    # A CAS UPDATE, the row read back, one INSERT of the events, one of the snapshot row, per task:
    # and no BEGIN or COMMIT between the tasks.
    body = [s for s in statements if s in {"UPDATE", "SELECT", "INSERT"}]
    assert len(body) == 4 * len(ids)
    assert len([s for s in statements if s in {"BEGIN", "COMMIT", "SAVEPOINT"}]) <= 2


def test_a_task_that_does_not_exist_gets_none_and_the_rest_commit(running) -> None:
    (task_id,) = running(1)
    results = lifecycle.tasks_progress(batches=[batch("task_missing", "x"), batch(task_id, "y")])
    assert results[0] is None and results[1] is not None and results[1].won
    assert deltas_of(task_id) == ["y"]


def test_a_worker_that_no_longer_holds_its_task_cannot_write_to_it_in_a_group(running) -> None:
    mine, taken = running(2)
    results = lifecycle.tasks_progress(batches=[batch(mine, "ok"), batch(taken, "late", worker="other@host/9")])
    assert [r.won for r in results] == [True, False]
    assert deltas_of(taken) == []


def test_one_task_twice_in_a_group_is_refused(running) -> None:
    (task_id,) = running(1)
    with pytest.raises(ValueError, match="twice"):
        lifecycle.tasks_progress(batches=[batch(task_id, "a"), batch(task_id, "b")])
    assert deltas_of(task_id) == []


# --------------------------------------------------------------------------- #
# The run loop
# --------------------------------------------------------------------------- #


class Row:
    """A row as the run loop carries it: chunks put from another thread, like the engine's model thread."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.chunks: list[str] = []
        self.last_beat = time.monotonic()
        self._notify: Callable[[], None] | None = None
        self._lock = threading.Lock()

    def notify(self, callback: Callable[[], None]) -> None:
        self._notify = callback

    def put(self, chunk: str) -> None:
        with self._lock:
            self.chunks.append(chunk)
        assert self._notify is not None
        self._notify()

    def take(self) -> list[str]:
        with self._lock:
            taken, self.chunks = self.chunks, []
        return taken


class Advance:
    """The loop's step: records which rows it got together and what each had; may hold its first call."""

    def __init__(self, *, hold_first: bool = False, fail_first: bool = False) -> None:
        self.calls: list[list[tuple[str, list[str]]]] = []
        self.entered = threading.Event()
        self.release = threading.Event()
        if not hold_first:
            self.release.set()
        self.fail_first = fail_first
        self.ending: set[str] = set()

    def __call__(self, rows: list[Row]) -> list[Row]:
        taken = [(row.name, row.take()) for row in rows]
        if self.fail_first and not self.calls:
            self.calls.append([])
            for row, (_, chunks) in zip(rows, taken, strict=True):
                row.chunks[:0] = chunks  # a bug, before anything was done: the chunks are still the row's
            raise RuntimeError("a bug in the step")
        if not any(chunks for _, chunks in taken):
            return []  # woken for nothing (a row's first look, when it was handed over)
        self.calls.append([(name, chunks) for name, chunks in taken if chunks])
        self.entered.set()
        assert self.release.wait(30)
        return [row for row in rows if row.name in self.ending]


def hold(loop: RunLoop, *rows: Row) -> None:
    for row in rows:
        loop.hold(row, row.notify)


def test_the_rows_that_became_ready_during_a_step_go_together_into_the_next() -> None:
    advance = Advance(hold_first=True)
    loop: RunLoop[Row] = RunLoop(advance=advance, beat=lambda rows: None, beat_seconds=60)
    rows = [Row(f"r{i}") for i in range(6)]
    hold(loop, *rows)
    rows[0].put("first")
    assert advance.entered.wait(10), "the first chunk was not advanced at once"
    assert advance.calls == [[("r0", ["first"])]]
    for index, row in enumerate(rows[1:], start=1):  # while that step is held
        row.put(f"a{index}")
        row.put(f"b{index}")
    rows[0].put("second")
    advance.release.set()
    wait_until(lambda: len(advance.calls) >= 2, what="the later chunks were not advanced")
    # One step for every row that was ready, each with all its chunks in order.
    assert advance.calls[1:] == [
        [("r1", ["a1", "b1"]), ("r2", ["a2", "b2"]), ("r3", ["a3", "b3"]), ("r4", ["a4", "b4"]),
         ("r5", ["a5", "b5"]), ("r0", ["second"])]
    ]  # fmt: skip


def test_a_place_is_taken_before_a_claim_and_freed_when_its_row_ends() -> None:
    advance = Advance()
    loop: RunLoop[Row] = RunLoop(advance=advance, beat=lambda rows: None, beat_seconds=60)
    assert loop.reserve(2, timeout=1) and loop.reserve(2, timeout=1)
    assert not loop.reserve(2, timeout=0.05)  # both places are taken (rows still starting)
    loop.unreserve()  # a task that never started: its place goes back
    assert loop.reserve(2, timeout=1)
    first, second = Row("first"), Row("second")
    hold(loop, first, second)  # each in its reserved place
    assert loop.held == 2 and not loop.reserve(2, timeout=0.05)
    taken = threading.Event()
    waiter = threading.Thread(target=lambda: loop.reserve(2, timeout=30) and taken.set())
    waiter.start()
    advance.ending.add("first")
    first.put("last")
    waiter.join(30)
    assert taken.is_set() and loop.held == 1
    assert not loop.wait_empty(timeout=0.05)
    advance.ending.add("second")
    second.put("last")
    assert loop.wait_empty(timeout=30)


def test_rows_that_committed_nothing_for_a_beat_get_their_heartbeat_and_the_others_do_not() -> None:
    beats: list[list[str]] = []
    loop: RunLoop[Row] = RunLoop(
        advance=Advance(), beat=lambda rows: beats.append([r.name for r in rows]), beat_seconds=0.2
    )
    quiet, busy = Row("quiet"), CommittingRow("busy")
    hold(loop, quiet, busy)
    time.sleep(1.0)
    assert beats and all(names == ["quiet"] for names in beats)


class CommittingRow(Row):
    """A row that commits all the time: its last commit is always now (read by the loop, whatever the load)."""

    @property
    def last_beat(self) -> float:
        return time.monotonic()

    @last_beat.setter
    def last_beat(self, value: float) -> None:
        pass


def test_a_step_that_fails_is_logged_and_its_rows_are_tried_again(caplog) -> None:
    advance = Advance(fail_first=True)
    loop: RunLoop[Row] = RunLoop(advance=advance, beat=lambda rows: None, beat_seconds=60)
    row = Row("r")
    hold(loop, row)
    row.put("x")
    wait_until(lambda: [("r", ["x"])] in advance.calls, what="the row was not tried again")
    assert "could not advance 1 rows" in caplog.text
