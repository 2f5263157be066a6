"""The transition table of chapter 7.2, row by row, through the lifecycle module."""

from __future__ import annotations

import json

import pytest

from tasks_app import states
from tasks_app.core import lifecycle
from tasks_app.exceptions import ServerRestarted, TaskNotFound, TransitionNotAllowed
from tasks_app.models import Task, TaskEvent
from tasks_app.selectors import tasks as selectors
from tasks_app.states import ResponseStatus, TaskStatus
from tests.support import moves
from tests.support.specs import spec_json

S = TaskStatus
ALL = list(S)
FAILURE = ServerRestarted("test failure").to_problem()

# The way from `queued` to each status, using only allowed moves.
PATHS: dict[TaskStatus, list[TaskStatus]] = {
    S.QUEUED: [],
    S.LOADING: [S.LOADING],
    S.RUNNING: [S.LOADING, S.RUNNING],
    S.CANCELLING: [S.LOADING, S.CANCELLING],
    S.SUCCEEDED: [S.LOADING, S.RUNNING, S.SUCCEEDED],
    S.FAILED: [S.FAILED],
    S.CANCELLED: [S.CANCELLED],
}
ALLOWED = {
    (S.QUEUED, S.LOADING),
    (S.QUEUED, S.CANCELLED),
    (S.QUEUED, S.FAILED),
    (S.LOADING, S.RUNNING),
    (S.LOADING, S.CANCELLING),
    (S.LOADING, S.FAILED),
    (S.RUNNING, S.SUCCEEDED),
    (S.RUNNING, S.FAILED),
    (S.RUNNING, S.CANCELLING),
    (S.CANCELLING, S.CANCELLED),
}


def move(task_id: str, to: TaskStatus, **kwargs) -> lifecycle.TransitionResult:
    if to == S.FAILED:
        kwargs.setdefault("error", FAILURE)
    return moves.move(task_id, to, **kwargs)


@pytest.fixture
def new_task(make_client, demo_model):
    client, _ = make_client()

    def make(status: TaskStatus = S.QUEUED) -> Task:
        task = lifecycle.task_insert(
            client=client,
            request={"model": "demo", "input": "x"},
            generation=spec_json({"model": "demo", "input": "x"}),
            model="demo",
        )
        for step in PATHS[status]:
            assert move(task.id, step).won
        return Task.objects.select_related("response").get(pk=task.id)

    return make


def events_of(task: Task) -> list[dict]:
    return [json.loads(e.payload) for e in TaskEvent.objects.filter(task=task).order_by("sequence_number")]


def test_table_is_chapter_7_2():
    table = {(src, dst) for src, targets in states.TRANSITIONS.items() for dst in targets}
    assert table == ALLOWED
    assert states.TERMINAL == {S.SUCCEEDED, S.FAILED, S.CANCELLED}


def test_the_verbs_make_exactly_the_moves_of_the_table():
    made = {(src, move.to) for move in lifecycle.MOVES.values() if move.to is not None for src in move.sources}
    assert made == ALLOWED
    # The verbs that keep the status only ever touch unfinished tasks.
    assert all(move.sources <= states.ACTIVE for move in lifecycle.MOVES.values() if move.to is None)


@pytest.mark.parametrize("source", ALL)
@pytest.mark.parametrize("target", ALL)
def test_every_pair_of_states(new_task, source, target):
    task = new_task(source)
    before = len(events_of(task))
    if (source, target) in ALLOWED:
        result = move(task.id, target, sources=[source])
        assert result.won
        task.refresh_from_db()
        assert task.status == target
    else:
        with pytest.raises(TransitionNotAllowed):
            move(task.id, target, sources=[source])
        task.refresh_from_db()
        assert task.status == source
        assert len(events_of(task)) == before


@pytest.mark.parametrize("terminal", [S.SUCCEEDED, S.FAILED, S.CANCELLED])
@pytest.mark.parametrize("target", [S.LOADING, S.RUNNING, S.CANCELLING, S.SUCCEEDED, S.FAILED, S.CANCELLED])
def test_terminal_states_never_change(new_task, terminal, target):
    task = new_task(terminal)
    before = events_of(task)
    # Ask with every source the table allows for the target: the task's own
    # (terminal) status is never among them, so the compare-and-set loses.
    result = move(task.id, target)
    assert not result.won
    assert result.task.status == terminal
    task.refresh_from_db()
    assert task.status == terminal
    assert events_of(task) == before
    with pytest.raises(TransitionNotAllowed):
        move(task.id, target, sources=[terminal])


def test_lost_compare_and_set_reports_current_state(new_task):
    task = new_task(S.RUNNING)
    assert move(task.id, S.CANCELLING, sources=[S.RUNNING]).won
    lost = move(task.id, S.SUCCEEDED, sources=[S.RUNNING])
    assert not lost.won
    assert lost.task.status == S.CANCELLING
    assert lost.events == ()


def test_creation_writes_event_zero_with_queued_response(new_task):
    task = new_task()
    [event] = events_of(task)
    assert event["type"] == "response.created"
    assert event["sequence_number"] == 0
    assert event["response"]["id"] == task.response_id
    assert event["response"]["status"] == "queued"
    assert task.last_sequence == 0


def test_full_run_numbers_events_contiguously(new_task):
    task = new_task(S.LOADING)
    running = move(task.id, S.RUNNING)
    assert [e.type for e in running.events] == [
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    deltas = moves.progress(task.id, ["a", "b", "c"])
    assert deltas.won
    done = move(task.id, S.SUCCEEDED, text="abc", incomplete=True)
    assert done.won
    log = events_of(task)
    assert [e["sequence_number"] for e in log] == list(range(len(log)))
    assert log[-1]["type"] == "response.incomplete"
    assert log[-1]["response"]["status"] == "incomplete"
    assert log[-1]["response"]["incomplete_details"] == {"reason": "max_output_tokens"}
    task.refresh_from_db()
    assert task.last_sequence == len(log) - 1
    assert task.response.status == ResponseStatus.INCOMPLETE


def test_failure_stores_problem_on_task_and_response(new_task):
    task = new_task(S.RUNNING)
    move(task.id, S.FAILED, error=FAILURE)
    task.refresh_from_db()
    assert task.error["code"] == "server_restarted"
    assert task.response.status == ResponseStatus.FAILED
    assert task.response.error["code"] == "server_restarted"
    assert events_of(task)[-1]["type"] == "response.failed"


def test_failed_needs_an_error(new_task):
    task = new_task()
    with pytest.raises(TransitionNotAllowed):
        lifecycle.task_fail(task_id=task.id, error=None)


def test_append_events_refused_after_cancel(new_task):
    task = new_task(S.RUNNING)
    move(task.id, S.CANCELLING)
    result = moves.progress(task.id, ["x"])
    assert not result.won
    # The log ends where the start left it (in_progress, the opened item and part).
    assert [e["type"] for e in events_of(task)][-1] == "response.content_part.added"


def test_a_verb_asked_to_move_from_a_terminal_status_is_a_programming_error(new_task):
    task = new_task(S.RUNNING)
    with pytest.raises(TransitionNotAllowed):
        lifecycle.task_fail(task_id=task.id, error=FAILURE, sources=[S.SUCCEEDED])
    with pytest.raises(TransitionNotAllowed):
        lifecycle.task_request_cancel(task_id=task.id, sources=[S.CANCELLED])
    task.refresh_from_db()
    assert task.status == S.RUNNING


def test_only_succeeded_chooses_the_response_status(new_task):
    task = new_task(S.RUNNING)
    assert move(task.id, S.CANCELLING).won
    task.refresh_from_db()
    assert task.response.status == ResponseStatus.IN_PROGRESS


def test_unknown_task(db):
    with pytest.raises(TaskNotFound):
        lifecycle.task_claim(task_id="task_01ARZ3NDEKTSV4RRFFQ69G5FAV", worker=moves.WORKER)


def test_database_refuses_a_second_terminal_event(new_task):
    from django.db import IntegrityError, transaction
    from django.utils import timezone

    task = new_task(S.CANCELLED)
    with pytest.raises(IntegrityError), transaction.atomic():
        TaskEvent.objects.create(
            task=task, sequence_number=99, type="response.completed", payload="{}", created_at=timezone.now()
        )


def test_database_refuses_a_duplicate_sequence_number(new_task):
    from django.db import IntegrityError, transaction
    from django.utils import timezone

    task = new_task()
    with pytest.raises(IntegrityError), transaction.atomic():
        TaskEvent.objects.create(
            task=task, sequence_number=0, type="response.output_text.delta", payload="{}", created_at=timezone.now()
        )


def test_database_refuses_an_unknown_status(new_task):
    from django.db import IntegrityError, transaction

    task = new_task()
    with pytest.raises(IntegrityError), transaction.atomic():
        Task.objects.filter(pk=task.pk).update(status="paused")


def test_delta_batch_query_count(new_task, django_assert_num_queries):
    """A batch of deltas costs three statements whatever its size, and never
    reads the response (prompt and output) it does not change."""
    task = new_task(S.RUNNING)
    # UPDATE task (compare-and-set), SELECT task, INSERT events.
    with django_assert_num_queries(3):
        assert moves.progress(task.id, [str(i) for i in range(32)]).won


def snapshot(ids: list[int], n: int) -> dict:
    return {"token_ids": ids, "state": {"n": n}}


def test_a_batch_appends_its_snapshot_row_with_its_events(new_task):
    task = new_task(S.RUNNING)

    first = moves.progress(task.id, ["a"], snapshot=snapshot([1], 1))
    second = moves.progress(task.id, ["b"], snapshot=snapshot([2, 3], 2))

    assert first.won and second.won
    stored = selectors.task_snapshot_get(task_id=task.id)
    assert stored.token_ids == [1, 2, 3]
    assert (stored.first_state, stored.last_state, stored.rows) == ({"n": 1}, {"n": 2}, 2)
    assert stored.sequence_number == second.events[-1].sequence_number
    task.refresh_from_db()
    assert stored.sequence_number == task.last_sequence


def test_a_lost_batch_writes_neither_events_nor_snapshot(new_task):
    task = new_task(S.RUNNING)
    moves.progress(task.id, [], snapshot=snapshot([1], 1))
    assert move(task.id, S.CANCELLING).won
    before = TaskEvent.objects.filter(task=task).count()

    lost = moves.progress(task.id, ["late"], snapshot=snapshot([2], 2))

    assert not lost.won
    assert TaskEvent.objects.filter(task=task).count() == before
    assert selectors.task_snapshot_get(task_id=task.id).token_ids == [1]


def test_a_finished_task_keeps_no_snapshot(new_task):
    task = new_task(S.RUNNING)
    moves.progress(task.id, [], snapshot=snapshot([1, 2], 1))

    assert move(task.id, S.SUCCEEDED).won

    assert selectors.task_snapshot_get(task_id=task.id) is None


def test_a_batch_of_deltas_costs_a_fixed_number_of_queries(new_task, django_assert_num_queries):
    """The worker's hot path: compare-and-set, read back, insert the events, append the snapshot row."""
    task = new_task(S.RUNNING)
    moves.progress(task.id, [], snapshot=snapshot([1], 1))
    deltas = [str(n) for n in range(16)]

    with django_assert_num_queries(4):
        result = moves.progress(task.id, deltas, snapshot=snapshot(list(range(16)), 2))

    assert result.won
    assert len(result.events) == 16


@pytest.mark.database_free
@pytest.mark.parametrize("text", ["", "plain", 'quote " and \\ backslash', "ünïcödé ✓ 🙂", "\n\t\x00"])
def test_an_event_encoded_before_its_number_is_the_same_bytes_as_one_encoded_with_it(text):
    from tasks_app import events
    from tasks_app.core import event_payloads

    built = [
        *event_payloads.message_opened("msg_1", 0),
        event_payloads.message_delta("msg_1", 0, text),
        *event_payloads.message_closed("msg_1", 0, text, "completed"),
    ]
    for event in built:
        for number in (0, 7, 12345):
            assert events.encoded(event).payload(number) == events.encode(event.type, number, event.fields)
    with pytest.raises(ValueError):
        events.encoded(events.Event(events.EventType.OUTPUT_TEXT_DELTA, {"sequence_number": 3}))
