"""Group commits: many running tasks' batches in one transaction (``lifecycle.tasks_progress``), and the
worker's commit window that gathers them (``workers.commit_window``).

Each task's compare-and-set is its own: a cancelled task loses alone, the others commit their events and
snapshot rows as one ``task_progress`` each would. The window hands every waiting thread its own
outcome, commits a lone batch at once, gathers what arrives while a commit runs, and passes a failed
group's error to each of its threads, after which it goes on with the next group.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Sequence

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext

from tasks_app import lifecycle
from tasks_app.exceptions import DatabaseBusy
from tasks_app.lifecycle import ProgressBatch, TransitionResult
from tasks_app.models import Task, TaskEvent, TaskSnapshot
from tasks_app.states import TaskStatus
from tests.support.moves import ITEM_ID, WORKER, move
from tests.support.waiting import wait_until
from workers.commit_window import CommitWindow

S = TaskStatus
pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def running(make_client, demo_model):
    client, _ = make_client()

    def make(count: int) -> list[str]:
        ids = []
        for _ in range(count):
            task = lifecycle.task_insert(client=client, request={"model": "demo", "input": "x"}, model="demo")
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
# The window
# --------------------------------------------------------------------------- #


class HeldCommit:
    """``lifecycle.tasks_progress`` that records each group and can hold a commit until released."""

    def __init__(self, *, hold_first: bool = False, fail_group: int | None = None) -> None:
        self.groups: list[list[str]] = []
        self.entered = threading.Event()
        self.release = threading.Event()
        if not hold_first:
            self.release.set()
        self.fail_group = fail_group

    def __call__(self, batches: Sequence[ProgressBatch]) -> list[TransitionResult | None]:
        self.groups.append([b.task_id for b in batches])
        self.entered.set()
        assert self.release.wait(30)
        if self.fail_group == len(self.groups) - 1:
            raise DatabaseBusy("database is locked")
        try:
            return lifecycle.tasks_progress(batches=batches)
        finally:
            connection.close()  # this thread's connection: the test database is dropped at the end


def commit_from_threads(window: CommitWindow, batches: Sequence[ProgressBatch]) -> dict[str, object]:
    outcomes: dict[str, object] = {}

    def run(b: ProgressBatch) -> None:
        outcome = window.progress(b)
        outcomes[b.task_id] = outcome
        connection.close()

    threads = [threading.Thread(target=run, args=(b,)) for b in batches]
    for thread in threads:
        thread.start()
    return {"threads": threads, "outcomes": outcomes}


def test_a_lone_batch_commits_at_once_and_what_arrives_meanwhile_goes_in_the_next_group(running) -> None:
    ids = running(6)
    commit = HeldCommit(hold_first=True)
    observed: list[tuple[str, int]] = []
    window = CommitWindow(commit, observe=lambda worker, tasks: observed.append((worker, tasks)))
    first = commit_from_threads(window, [batch(ids[0], "first")])
    assert commit.entered.wait(10)  # the first batch went alone, without waiting for company
    rest = commit_from_threads(window, [batch(task_id, f"d{i}") for i, task_id in enumerate(ids[1:])])
    # The five others queue while the first transaction is held.
    wait_until(lambda: window.waiting == 5, what="the other batches never queued behind the held commit")
    commit.release.set()
    for thread in first["threads"] + rest["threads"]:
        thread.join(30)
    assert commit.groups == [[ids[0]], sorted(ids[1:], key=ids.index)]
    outcomes = {**first["outcomes"], **rest["outcomes"]}
    assert all(outcomes[task_id].result.won and outcomes[task_id].result.task.id == task_id for task_id in ids)
    assert [outcomes[task_id].group for task_id in ids] == [1, 5, 5, 5, 5, 5]
    assert observed == [(WORKER, 1), (WORKER, 5)]
    assert [deltas_of(task_id) for task_id in ids] == [["first"], *[[f"d{i}"] for i in range(5)]]


def test_a_failed_group_fails_each_of_its_threads_and_the_window_goes_on(running) -> None:
    ids = running(3)
    commit = HeldCommit(fail_group=0)
    window = CommitWindow(commit)
    failed = commit_from_threads(window, [batch(ids[0], "x")])
    for thread in failed["threads"]:
        thread.join(30)
    assert isinstance(failed["outcomes"][ids[0]].error, DatabaseBusy)
    assert deltas_of(ids[0]) == []
    later = commit_from_threads(window, [batch(task_id, "y") for task_id in ids])
    for thread in later["threads"]:
        thread.join(30)
    assert all(later["outcomes"][task_id].result.won for task_id in ids)
    assert [deltas_of(task_id) for task_id in ids] == [["y"], ["y"], ["y"]]


def test_a_commit_that_answers_for_the_wrong_number_of_tasks_fails_its_threads_instead_of_leaving_them_waiting(
    running,
) -> None:
    (task_id,) = running(1)
    window = CommitWindow(lambda batches: [])  # a bug: no result for the batch it was given
    outcome = window.progress(batch(task_id, "x"))
    assert isinstance(outcome.error, RuntimeError) and "returned 0 results" in str(outcome.error)
    assert window.progress(batch(task_id, "y")).error is not None  # the committer is still there
