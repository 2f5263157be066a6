"""The task lifecycle as a state machine: verbs, deaths and recoveries in random orders, on the real database.

Hypothesis drives several tasks of every ``on_restart`` policy through the
verbs of chapter 7.2 (as several fake workers, so that fencing is exercised),
the things that happen around them (a worker stops writing: time passes over
its heartbeat; the reaper; startup recovery; a hand-back; a pool process's
death; retention cleanup; a response's delete), and compares after every step the database with a
model of what each task should be (``tests.support.machine``).

Sizes: ``LMSP_MACHINE_EXAMPLES`` and ``LMSP_MACHINE_STEPS`` (and
``LMSP_MACHINE_TASKS``) make a long run; the defaults fit CI. The failures
the machine found are kept below it as plain tests with their exact calls.
"""

from __future__ import annotations

import itertools
import os
from collections import Counter
from collections.abc import Callable, Iterator
from datetime import datetime, timedelta
from typing import Any

import pytest
from django.utils import timezone
from hypothesis import HealthCheck, configuration, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule, run_state_machine_as_test

from tasks_app import events, states
from tasks_app.core import lifecycle
from tasks_app.core.lifecycle import Partial, RecoveryMove, TransitionResult
from tasks_app.exceptions import (
    BackendError,
    ModelLoadFailed,
    ResponseNotFinished,
    ResponseNotFound,
    ServerRestarted,
    TaskNotCancelable,
    TaskNotFound,
    TransitionNotAllowed,
)
from tasks_app.models import Response, Task, TaskEvent
from tasks_app.selectors import tasks as selectors
from tasks_app.services.clients import client_create
from tasks_app.services.recovery import (
    BUSY,
    LOST_RACE,
    RAISED,
    LiveWorkers,
    RecoverySummary,
    abandoned_tasks_reap,
    held_task_release,
    leftover_tasks_recover,
    lost_task_recover,
)
from tasks_app.services.responses import response_delete
from tasks_app.services.retention import retention_cleanup
from tasks_app.services.tasks import task_cancel
from tasks_app.services.webhooks import webhook_endpoint_create
from tasks_app.states import RestartPolicy, TaskStatus
from tests.support.machine import (
    FINISHED,
    HELD,
    SHOWS_TEXT,
    UNFINISHED,
    Beat,
    Expected,
    TaskView,
    check_task,
    orphan_rows,
    recovery_plan,
    summary_expected,
    webhook_deliveries,
    world_read,
    world_reset,
)
from tests.support.specs import spec_json

S = TaskStatus
R = RestartPolicy

EXAMPLES = int(os.environ.get("LMSP_MACHINE_EXAMPLES", "10"))
STEPS = int(os.environ.get("LMSP_MACHINE_STEPS", "50"))
# Unfinished tasks at once, and tasks per example (new ones come as old ones finish).
MAX_UNFINISHED = int(os.environ.get("LMSP_MACHINE_TASKS", "2"))
MAX_TASKS = 6 * MAX_UNFINISHED + 4

# Two processes of one node and one of another: a name is the fencing token. The pids are past any
# pid_max, so that no process of this machine has them: a lost pool process is one that does not exist.
WORKERS = ("w1@host/4900001", "w1@host/4900002", "w2@other/4900001")
MAX_ATTEMPTS = 3
TIMEOUT = 60
REQUEST = {"model": "demo", "input": "x"}
HAND_BACK = "its worker was shut down"
# The ends the client's webhook endpoint is subscribed to (not all: an end it did not ask for is not delivered).
HOOKED = ["response.completed", "response.failed", "response.cancelled"]
# Text a model may produce: quotes, backslashes, newlines, a control character and non-ASCII, as JSON must carry.
DELTA = st.text(alphabet=st.sampled_from('ab "\\\n\x00é€😀'), min_size=1, max_size=3)
DELTAS = st.lists(DELTA, max_size=3)
# Three times in four (and what a failing example shrinks to): the move fits, so tasks get somewhere.
OFTEN = st.sampled_from([True, True, True, False])

FAILURES = {
    S.LOADING: ModelLoadFailed("the model would not load").to_problem(),
    S.RUNNING: ServerRestarted("no snapshot to resume from").to_problem(),
}
BACKEND_FAILURE = BackendError("the backend stopped").to_problem()
# Rules with a budget: one use, and so many more for each task the example created. They are enabled
# most of the time; unbounded, the ones that end queued or loading tasks or restart the service would end
# most tasks before they reach resumes, retries and cancels of later attempts, and the harmless ones (a
# heartbeat, a read) would take the steps the others need.
RARE = {
    "from_outside": 0.5,
    "succeed": 0.5,
    "heartbeat": 0.5,
    "worker_fail": 0.3,
    "reaper": 0.5,
    "hand_back": 0.2,
    "pool_process_lost": 0.2,
    "startup_recovery": 0.2,
    "retention": 0.25,
    "delete_response": 0.25,
    "refused_move": 0.2,
    "verb_on_a_deleted_task": 0.2,
    "read": 0.5,
}
# The moves the examples made, printed at the end (``-s``): a run that never reached a path tested nothing there.
REACHED: Counter[str] = Counter()


# What each verb needs of a task to win (the model's side); a rule is enabled only when some task fits.
def queued(task: Expected) -> bool:
    return task.status == S.QUEUED


def loading(task: Expected) -> bool:
    return task.status == S.LOADING


def waiting_for_adoption(task: Expected) -> bool:
    return task.status in SHOWS_TEXT and task.worker == ""


def held(task: Expected) -> bool:
    return task.status in HELD and task.worker != ""


def running_held(task: Expected) -> bool:
    return task.status == S.RUNNING and task.worker != ""


def cancelling_held(task: Expected) -> bool:
    return task.status == S.CANCELLING and task.worker != ""


def unfinished(task: Expected) -> bool:
    return task.status in UNFINISHED


def finished(task: Expected) -> bool:
    return task.status in FINISHED


def stale(task: Expected) -> bool:
    return task.status in HELD and task.beat == Beat.STALE


def nobody() -> LiveWorkers:
    """Startup with no live worker: every unfinished task is a leftover."""
    return LiveWorkers(frozenset(), frozenset(), timezone.now())


def stale_heartbeat() -> datetime:
    """A heartbeat older than the reaper's timeout: what time passing does to a worker that stopped writing."""
    return timezone.now() - timedelta(seconds=TIMEOUT + 3600)


class LifecycleMachine(RuleBasedStateMachine):
    """The database under the verbs and recoveries, step by step, against the model in ``self.tasks``."""

    def __init__(self) -> None:
        super().__init__()
        world_reset()
        self.client, _ = client_create(name="machine", scopes="responses,read")
        webhook_endpoint_create(client=self.client, name="machine", url="http://127.0.0.1:9/hook", event_types=HOOKED)
        self.tasks: dict[str, Expected] = {}
        # A finished task's rows as they were when it finished: they never change again.
        self.frozen: dict[str, TaskView] = {}
        self.items = itertools.count(1)
        self.spent: Counter[str] = Counter()

    # ------------------------------------------------------------------ #
    # Picking tasks and workers
    # ------------------------------------------------------------------ #

    def live(self) -> list[Expected]:
        return [task for task in self.tasks.values() if not task.deleted]

    def some(self, fits: Callable[[Expected], bool]) -> bool:
        return any(fits(task) for task in self.live())

    def gone(self) -> list[Expected]:
        return [task for task in self.tasks.values() if task.deleted]

    def pick(self, data: st.DataObject, fits: Callable[[Expected], bool]) -> Expected:
        """A live task: often one the move fits (so tasks get somewhere), otherwise any (so moves also lose)."""
        live = self.live()
        fitting = [task for task in live if fits(task)]
        pool = fitting if fitting and data.draw(OFTEN, label="fitting") else live
        name = data.draw(st.sampled_from(sorted(task.name for task in pool)), label="task")
        return self.tasks[name]

    def worker_for(self, data: st.DataObject, task: Expected) -> str:
        """Often the task's holder, otherwise any worker (a stale one, a stranger)."""
        if task.worker and data.draw(OFTEN, label="holder"):
            return task.worker
        return data.draw(st.sampled_from(WORKERS), label="worker")

    def may(self, rule: str) -> bool:
        """Whether a rule with a budget (RARE) has some left."""
        return self.spent[rule] < 1 + RARE[rule] * len(self.tasks)

    def spent_all(self) -> bool:
        """The example made all its tasks and they finished: nothing but reads is left to do."""
        return len(self.tasks) >= MAX_TASKS and not self.some(unfinished)

    def spend(self, rule: str) -> None:
        self.spent[rule] += 1

    def new_item(self) -> str:
        return f"msg_{next(self.items)}"

    # ------------------------------------------------------------------ #
    # One verb, checked: it wins exactly when the model says, and a loss writes nothing
    # ------------------------------------------------------------------ #

    def verb(
        self, name: str, task: Expected, call: Callable[[], TransitionResult], wins: bool, *, counts_events: bool = True
    ) -> TransitionResult:
        before = world_read()
        result = call()
        after = world_read()
        assert result.won == wins, f"{task.name}: won={result.won}, the model expected {wins} ({task})"
        if not result.won:
            REACHED[f"{name}: lost"] += 1
            assert after == before, f"{task.name}: a lost compare-and-set wrote something"
            assert result.task.status == before[task.id].status and result.events == ()
            return result
        # The verb touched its own task only, and made a move of chapter 7.2's table.
        assert {k: v for k, v in after.items() if k != task.id} == {k: v for k, v in before.items() if k != task.id}
        found, now = before[task.id].status, after[task.id].status
        REACHED[f"{name}: {found} -> {now}"] += 1
        assert found == now or now in states.TRANSITIONS[found], f"{task.name}: {found} -> {now}"
        assert found in states.ACTIVE, f"{task.name}: a finished task moved"
        assert result.task.status == now and result.task.last_sequence == after[task.id].row["last_sequence"]
        added = after[task.id].events[len(before[task.id].events) :]
        assert not counts_events or [event.sequence_number for event in result.events] == [
            sequence for sequence, _, _ in added
        ]
        return result

    def check_text_before_end(self, task: Expected) -> None:
        """What the worker (and the response) will keep is what the log's current attempt holds."""
        if task.item_id is not None:
            assert selectors.task_output_text(task_id=task.id) == (task.item_id, task.text), task.name

    # ------------------------------------------------------------------ #
    # Creation
    # ------------------------------------------------------------------ #

    @precondition(
        lambda self: len(self.tasks) < MAX_TASKS and len(list(filter(unfinished, self.live()))) < MAX_UNFINISHED
    )
    @rule(policy=st.sampled_from(R), notify=st.booleans())
    def create(self, policy: RestartPolicy, notify: bool) -> None:
        task = lifecycle.task_insert(
            client=self.client,
            request=REQUEST,
            generation=spec_json(REQUEST),
            model="demo",
            on_restart=policy,
            notify_webhooks=notify,
        )
        name = f"t{len(self.tasks)}"
        self.tasks[name] = Expected(name, task.id, task.response_id, policy, notify)

    # ------------------------------------------------------------------ #
    # A worker's verbs
    # ------------------------------------------------------------------ #

    @precondition(lambda self: self.some(queued))
    @rule(data=st.data())
    def claim(self, data: st.DataObject) -> None:
        task = self.pick(data, queued)
        worker = data.draw(st.sampled_from(WORKERS), label="worker")
        wins = queued(task)
        self.verb("claim", task, lambda: lifecycle.task_claim(task_id=task.id, worker=worker), wins)
        if wins:
            task.claimed(worker)

    @precondition(lambda self: self.some(waiting_for_adoption))
    @rule(data=st.data())
    def adopt(self, data: st.DataObject) -> None:
        task = self.pick(data, waiting_for_adoption)
        worker = data.draw(st.sampled_from(WORKERS), label="worker")
        wins = waiting_for_adoption(task)
        self.verb("adopt", task, lambda: lifecycle.task_adopt(task_id=task.id, worker=worker), wins)
        if wins:
            task.adopted(worker)
            # A resumed task continues its committed deltas: the adopter reads them back first.
            self.check_text_before_end(task)

    @precondition(lambda self: self.some(loading))
    @rule(data=st.data())
    def start(self, data: st.DataObject) -> None:
        task = self.pick(data, loading)
        worker = self.worker_for(data, task)
        item_id = self.new_item()
        snapshot = {"token_ids": [], "state": {"item_id": item_id, "backend": {}}}
        wins = loading(task) and worker == task.worker
        self.verb(
            "start",
            task,
            lambda: lifecycle.task_start(task_id=task.id, worker=worker, item_id=item_id, snapshot=snapshot),
            wins,
        )
        if wins:
            task.started(item_id)

    @precondition(lambda self: self.some(running_held))
    @rule(data=st.data())
    def progress(self, data: st.DataObject) -> None:
        task = self.pick(data, running_held)
        worker = self.worker_for(data, task)
        deltas = data.draw(DELTAS, label="deltas")
        with_snapshot = data.draw(st.booleans(), label="with snapshot")
        snapshot = {"token_ids": [1] * len(deltas), "state": {"item_id": task.item_id}} if with_snapshot else None
        wins = running_held(task) and worker == task.worker

        def call() -> TransitionResult:
            return lifecycle.task_progress(
                task_id=task.id,
                worker=worker,
                item_id=task.item_id or "msg_stale",
                deltas=deltas,
                output_tokens=len(task.text) + len(deltas),
                snapshot=snapshot,
            )

        self.verb("progress", task, call, wins)
        if wins:
            task.progressed(deltas, with_snapshot)

    @precondition(lambda self: self.some(held) and self.may("heartbeat"))
    @rule(data=st.data())
    def heartbeat(self, data: st.DataObject) -> None:
        self.spend("heartbeat")
        task = self.pick(data, held)
        worker = self.worker_for(data, task)
        wins = held(task) and worker == task.worker
        self.verb("heartbeat", task, lambda: lifecycle.task_heartbeat(task_id=task.id, worker=worker), wins)
        if wins:
            task.beat = Beat.FRESH

    @precondition(lambda self: self.some(running_held) and self.may("succeed"))
    @rule(data=st.data())
    def succeed(self, data: st.DataObject) -> None:
        self.spend("succeed")
        task = self.pick(data, running_held)
        worker = self.worker_for(data, task)
        deltas = data.draw(DELTAS, label="deltas")
        incomplete = data.draw(st.booleans(), label="incomplete")
        wins = running_held(task) and worker == task.worker
        if wins:
            self.check_text_before_end(task)

        def call() -> TransitionResult:
            return lifecycle.task_succeed(
                task_id=task.id,
                worker=worker,
                item_id=task.item_id or "msg_stale",
                text=task.text + "".join(deltas),
                usage={"input_tokens": 1, "output_tokens": 2, "total_tokens": 3},
                output_tokens=2,
                deltas=deltas,
                incomplete=incomplete,
            )

        self.verb("succeed", task, call, wins)
        if wins:
            task.succeeded(deltas, incomplete)

    @precondition(lambda self: self.some(lambda t: held(t) and t.status != S.CANCELLING) and self.may("worker_fail"))
    @rule(data=st.data())
    def worker_fail(self, data: st.DataObject) -> None:
        """The worker's failures: the model would not load, no snapshot to resume from, a backend error."""
        self.spend("worker_fail")
        sources = data.draw(st.sampled_from([(S.LOADING,), (S.RUNNING,), (S.LOADING, S.RUNNING)]), label="sources")
        task = self.pick(data, lambda t: held(t) and t.status in sources)
        worker = self.worker_for(data, task)
        error = FAILURES[sources[0]] if len(sources) == 1 else BACKEND_FAILURE
        wins = held(task) and task.status in sources and worker == task.worker
        if wins:
            self.check_text_before_end(task)
        partial = Partial(task.item_id or self.new_item(), task.text)
        self.verb(
            "fail",
            task,
            lambda: lifecycle.task_fail(task_id=task.id, error=error, worker=worker, sources=sources, partial=partial),
            wins,
        )
        if wins:
            task.failed(error["code"], task.text)

    @precondition(lambda self: self.some(cancelling_held))
    @rule(data=st.data())
    def finish_cancel(self, data: st.DataObject) -> None:
        task = self.pick(data, cancelling_held)
        worker = self.worker_for(data, task)
        wins = cancelling_held(task) and worker == task.worker
        if wins:
            self.check_text_before_end(task)
        # The worker keeps what it committed; cancelled while loading, its own new item holds nothing.
        partial = Partial(task.item_id or self.new_item(), task.text)
        self.verb(
            "finish cancel",
            task,
            lambda: lifecycle.task_finish_cancel(task_id=task.id, worker=worker, partial=partial),
            wins,
        )
        if wins:
            task.cancelled(task.text)

    # ------------------------------------------------------------------ #
    # Moves from outside the worker
    # ------------------------------------------------------------------ #

    @precondition(lambda self: self.some(unfinished) and self.may("from_outside"))
    @rule(data=st.data())
    def from_outside(self, data: st.DataObject) -> None:
        """A client's cancel (the service's, or the lifecycle's verbs), or a queued task failed without a worker."""
        self.spend("from_outside")
        how = data.draw(st.sampled_from(["service", "request", "queued", "fail queued"]), label="how")
        task = self.pick(data, lambda t: t.status in (S.LOADING, S.RUNNING) if how != "fail queued" else queued(t))
        if how == "service":
            self.cancel(task)
        elif how == "request":
            wins = task.status in (S.LOADING, S.RUNNING)
            self.verb("request cancel", task, lambda: lifecycle.task_request_cancel(task_id=task.id), wins)
            if wins:
                task.cancel_requested()
        elif how == "queued":
            self.verb("cancel queued", task, lambda: lifecycle.task_cancel_queued(task_id=task.id), queued(task))
            if queued(task):
                task.cancelled("")
        else:
            error = ServerRestarted("failed while queued").to_problem()
            self.verb(
                "fail queued",
                task,
                lambda: lifecycle.task_fail(task_id=task.id, error=error, sources=[S.QUEUED]),
                queued(task),
            )
            if queued(task):
                task.failed(error["code"], "")

    def cancel(self, task: Expected) -> None:
        """``POST /tasks/{id}/cancel``: the service picks the verb by the status it reads."""
        if task.status in (S.SUCCEEDED, S.FAILED):
            before = world_read()
            with pytest.raises(TaskNotCancelable):
                task_cancel(task=Task.objects.get(pk=task.id))
            assert world_read() == before
            return
        wins = task.status in (S.QUEUED, S.LOADING, S.RUNNING)
        result = self.verb("cancel (service)", task, lambda: _cancel_result(task.id), wins, counts_events=False)
        if task.status == S.QUEUED:
            task.cancelled("")
        elif wins:
            task.cancel_requested()
        assert result.task.status == task.status

    @precondition(lambda self: self.live() and self.may("refused_move"))
    @rule(data=st.data())
    def refused_move(self, data: st.DataObject) -> None:
        """A move neither table has is refused before anything is written, whatever the task's status."""
        self.spend("refused_move")
        task = self.pick(data, lambda t: True)
        found, to = data.draw(st.sampled_from(S), label="found"), data.draw(st.sampled_from(S), label="to")
        refusals: list[Callable[[], Any]] = [lambda: lifecycle.task_fail(task_id=task.id, error=None)]
        if found not in lifecycle.MOVES["task_fail"].sources:
            refusals.append(lambda: lifecycle.task_fail(task_id=task.id, error=BACKEND_FAILURE, sources=[found]))
        if found not in lifecycle.MOVES["task_request_cancel"].sources:
            refusals.append(lambda: lifecycle.task_request_cancel(task_id=task.id, sources=[found]))
        if not states.recovery_allows(found, to):
            move = RecoveryMove(task.id, found, to, task.worker, None, BACKEND_FAILURE)
            refusals.append(lambda: lifecycle.tasks_recover(moves=[move]))
        refuse = data.draw(st.sampled_from(refusals), label="refusal")
        before = world_read()
        with pytest.raises(TransitionNotAllowed):
            refuse()
        assert world_read() == before

    # ------------------------------------------------------------------ #
    # Time, deaths and recoveries
    # ------------------------------------------------------------------ #

    @precondition(lambda self: self.some(lambda t: held(t) and t.beat == Beat.FRESH))
    @rule(over=st.sampled_from([None, *WORKERS]))
    def time_passes(self, over: str | None) -> None:
        """A worker (None: every one, a host that slept) dies or freezes: time passes over its heartbeats.

        A frozen worker may write again later; a dead one never does.
        """
        self.age(over)

    def age(self, over: str | None) -> None:
        rows = Task.objects.filter(status__in=HELD, heartbeat_at__isnull=False)
        (rows if over is None else rows.filter(worker=over)).update(heartbeat_at=stale_heartbeat())
        for task in self.live():
            if held(task) and task.beat != Beat.NONE and over in (None, task.worker):
                task.beat = Beat.STALE

    def recovery(self, name: str, targets: list[Expected], run: Callable[[], RecoverySummary]) -> None:
        """Run one recovery over the tasks the model says it takes; every other task stays as it was."""
        plans = {task.id: (task.status, recovery_plan(task, max_attempts=MAX_ATTEMPTS)) for task in targets}
        for task in targets:
            if plans[task.id][1] is not None and plans[task.id][0] in SHOWS_TEXT:
                self.check_text_before_end(task)
        before = world_read()
        summary = run()
        after = world_read()
        assert not (summary.counts[RAISED] or summary.counts[BUSY] or summary.counts[LOST_RACE]), summary.lines()
        assert summary.task_ids == summary_expected(plans), f"{summary.task_ids} but expected {plans}"
        moved = {task_id for task_id, (_, to) in plans.items() if to is not None}
        for task_id, view in before.items():
            if task_id not in moved:
                assert after[task_id] == view, f"recovery touched {task_id}, which it should have left"
            else:
                assert states.recovery_allows(view.status, after[task_id].status), (view.status, after[task_id].status)
        assert summary.dispatched == len(summary.to_dispatch)
        for task in targets:
            found, to = plans[task.id]
            if to is None:
                continue
            REACHED[
                f"{name}: {found} -> {to} ({task.policy}, attempts {task.attempts}, item {bool(task.item_id)})"
            ] += 1
            if to in FINISHED and task.item_id is None and task.earlier is not None:
                # Where the machine found its defect: the earlier attempt's item must not become this one's.
                REACHED[f"{name}: ended an attempt that never started after one that showed text"] += 1
            task.recovered(to)

    @precondition(lambda self: self.some(held) and self.may("reaper"))
    @rule(data=st.data())
    def reaper(self, data: st.DataObject) -> None:
        """The reaper's round, often right after a worker stopped (so that it finds something to take)."""
        self.spend("reaper")
        dies = data.draw(st.sampled_from(["nobody", "everyone", *WORKERS]), label="stops before the round")
        if dies != "nobody":
            self.age(None if dies == "everyone" else dies)
        self.recovery("reaper", list(filter(stale, self.live())), abandoned_tasks_reap)

    @precondition(lambda self: self.some(unfinished) and self.may("startup_recovery"))
    @rule()
    def startup_recovery(self) -> None:
        self.spend("startup_recovery")
        self.recovery("startup", list(filter(unfinished, self.live())), lambda: leftover_tasks_recover(live=nobody()))

    @precondition(lambda self: self.some(held) and self.may("hand_back"))
    @rule(data=st.data())
    def hand_back(self, data: st.DataObject) -> None:
        self.spend("hand_back")
        task = self.pick(data, held)
        worker = self.worker_for(data, task)
        holds = held(task) and task.worker == worker
        self.recovery(
            "hand-back",
            [task] if holds else [],
            lambda: held_task_release(task_id=task.id, worker=worker, reason=HAND_BACK),
        )

    @precondition(lambda self: self.some(held) and self.may("pool_process_lost"))
    @rule(data=st.data())
    def pool_process_lost(self, data: st.DataObject) -> None:
        """Celery reports that a pool process of ``node`` died while it ran the task."""
        self.spend("pool_process_lost")
        task = self.pick(data, held)
        node = self.worker_for(data, task).partition("/")[0]
        holds = held(task) and task.worker.startswith(f"{node}/")
        self.recovery(
            "pool process lost", [task] if holds else [], lambda: lost_task_recover(task_id=task.id, node=node)
        )

    # ------------------------------------------------------------------ #
    # Retention and deletes
    # ------------------------------------------------------------------ #

    @precondition(lambda self: self.some(finished) and self.may("retention"))
    @rule()
    def retention(self) -> None:
        self.spend("retention")
        before = world_read()
        summary = retention_cleanup(now=timezone.now() + timedelta(days=3650))
        after = world_read()
        ended = list(filter(finished, self.live()))
        assert (summary.tasks, summary.responses) == (len(ended), len(ended)), summary.describe()
        for task in filter(unfinished, self.live()):
            assert after[task.id] == before[task.id], f"cleanup touched unfinished {task.name}"
        for task in ended:
            task.deleted = True
        check_no_orphans()

    @precondition(lambda self: self.some(finished) and self.may("delete_response"))
    @rule(data=st.data())
    def delete_response(self, data: st.DataObject) -> None:
        """``DELETE /responses/{id}``: of a finished task (often), of an unfinished or an already deleted one."""
        self.spend("delete_response")
        pool = [t.name for t in self.tasks.values() if finished(t) and not t.deleted]
        if data.draw(st.booleans(), label="any"):
            pool = sorted(self.tasks)
        task = self.tasks[data.draw(st.sampled_from(pool), label="task")]
        before = world_read()
        if task.deleted:
            with pytest.raises(ResponseNotFound):
                response_delete(response=Response(pk=task.response_id))
        elif task.status in UNFINISHED:
            with pytest.raises(ResponseNotFinished):
                response_delete(response=Response.objects.get(pk=task.response_id))
        else:
            response_delete(response=Response.objects.get(pk=task.response_id))
            task.deleted = True
            before.pop(task.id)
        assert world_read() == before
        check_no_orphans()

    @precondition(lambda self: self.gone() and self.may("verb_on_a_deleted_task"))
    @rule(data=st.data())
    def verb_on_a_deleted_task(self, data: st.DataObject) -> None:
        self.spend("verb_on_a_deleted_task")
        task = data.draw(st.sampled_from(sorted(t.name for t in self.gone())), label="task")
        verb = data.draw(st.sampled_from(sorted(lifecycle.MOVES)), label="verb")
        task_id, worker = self.tasks[task].id, WORKERS[0]
        calls: dict[str, Callable[[], Any]] = {
            "task_claim": lambda: lifecycle.task_claim(task_id=task_id, worker=worker),
            "task_adopt": lambda: lifecycle.task_adopt(task_id=task_id, worker=worker),
            "task_start": lambda: lifecycle.task_start(task_id=task_id, worker=worker, item_id="msg_gone"),
            "task_progress": lambda: lifecycle.task_progress(
                task_id=task_id, worker=worker, item_id="msg_gone", deltas=["x"], output_tokens=1
            ),
            "task_heartbeat": lambda: lifecycle.task_heartbeat(task_id=task_id, worker=worker),
            "task_succeed": lambda: lifecycle.task_succeed(
                task_id=task_id, worker=worker, item_id="msg_gone", text="", usage=None, output_tokens=0
            ),
            "task_fail": lambda: lifecycle.task_fail(task_id=task_id, error=BACKEND_FAILURE),
            "task_cancel_queued": lambda: lifecycle.task_cancel_queued(task_id=task_id),
            "task_request_cancel": lambda: lifecycle.task_request_cancel(task_id=task_id),
            "task_finish_cancel": lambda: lifecycle.task_finish_cancel(task_id=task_id, worker=worker),
        }
        before = world_read()
        with pytest.raises(TaskNotFound):
            calls[verb]()
        assert held_task_release(task_id=task_id, worker=worker, reason=HAND_BACK).task_ids == {}
        assert world_read() == before

    @precondition(lambda self: self.tasks and (self.may("read") or self.spent_all()))
    @rule(data=st.data())
    def read(self, data: st.DataObject) -> None:
        """``GET /responses/{id}``: a queued response shows its place in the line, a running one its text so far.

        Also enabled once the example has made all its tasks and they have finished, so that it can take its
        remaining steps.
        """
        self.spend("read")
        task = self.tasks[data.draw(st.sampled_from(sorted(self.tasks)), label="task")]
        if task.deleted:
            with pytest.raises(ResponseNotFound):
                selectors.response_read_visible(client=self.client, response_id=task.response_id)
            return
        live = selectors.response_read_visible(client=self.client, response_id=task.response_id).live
        if queued(task):
            line = sorted(t.id for t in self.live() if queued(t))
            assert (live.queue_position, live.output) == (line.index(task.id) + 1, None), task.name
        elif task.status in SHOWS_TEXT:
            shown = (live.output or [{}])[0].get("id"), events.output_text(live.output)
            assert live.queue_position is None and shown == (task.item_id, task.text), f"{task.name}: shows {shown}"
        else:
            assert (live.queue_position, live.output) == (None, None), task.name

    # ------------------------------------------------------------------ #
    # After every step
    # ------------------------------------------------------------------ #

    @invariant()
    def the_database_agrees_with_the_model(self) -> None:
        views = world_read()
        live = self.live()
        assert set(views) == {task.id for task in live}, "tasks in the database are not the model's"
        # One outbox row for each end of a task that asked for them, committed with the end (a delete keeps it).
        hooked = [t for t in self.tasks.values() if t.notify and finished(t) and t.events[-1] in HOOKED]
        assert webhook_deliveries() == sorted((t.id, t.response_id, t.events[-1]) for t in hooked)
        now = timezone.now()
        for task in live:
            check_task(task, views[task.id], now=now, timeout_seconds=TIMEOUT)
            if task.status in FINISHED:
                frozen = self.frozen.setdefault(task.id, views[task.id])
                assert views[task.id] == frozen, f"{task.name} changed after it finished"
        # What recovery reads for the tasks that may show text (several at once, as a page does).
        showing = [task for task in live if task.status in SHOWS_TEXT]
        texts = selectors.task_outputs_text(task_ids=[task.id for task in showing])
        for task in showing:
            # An attempt that never started (cancelled while loading) has no item: an earlier attempt's is not its.
            found = texts.get(task.id, (None, ""))
            assert found == (task.item_id, task.text), f"{task.name}: {found}, expected {(task.item_id, task.text)}"


def check_no_orphans() -> None:
    """A delete took the task's events, snapshots and response with it (only deletes can leave any behind)."""
    orphans = orphan_rows()
    assert not any(orphans.values()), orphans


def _cancel_result(task_id: str) -> TransitionResult:
    """``task_cancel`` as a verb: whether it moved the task (cancelling and cancelled ones it leaves alone)."""
    found = Task.objects.get(pk=task_id)
    after = task_cancel(task=found)
    return TransitionResult(won=after.status != found.status, task=after)


MACHINE_SETTINGS = settings(
    max_examples=EXAMPLES,
    stateful_step_count=STEPS,
    deadline=None,
    database=None,
    suppress_health_check=list(HealthCheck),
)


@pytest.fixture
def hypothesis_home(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Hypothesis keeps caches in its home (``.hypothesis`` in the working directory): this test's go elsewhere."""
    configuration.set_hypothesis_home_dir(tmp_path_factory.mktemp("hypothesis"))
    yield
    # Back to the default: the next user finds it from the environment or the working directory, as before.
    configuration.set_hypothesis_home_dir(None)


def test_the_lifecycle_as_a_state_machine(queue, settings, hypothesis_home):
    settings.LMSP_WEBHOOK_ALLOW_PRIVATE_TARGETS = True
    settings.LMSP_MAX_ATTEMPTS = MAX_ATTEMPTS
    settings.LMSP_HEARTBEAT_TIMEOUT_SECONDS = TIMEOUT
    REACHED.clear()
    run_state_machine_as_test(LifecycleMachine, settings=MACHINE_SETTINGS)
    print("\n".join(f"{count:6d}  {move}" for move, count in sorted(REACHED.items())))


# --------------------------------------------------------------------------- #
# What the machine found, as plain calls
# --------------------------------------------------------------------------- #

W1, W2 = WORKERS[0], WORKERS[2]


@pytest.fixture
def client(queue, settings):
    settings.LMSP_MAX_ATTEMPTS = MAX_ATTEMPTS
    settings.LMSP_HEARTBEAT_TIMEOUT_SECONDS = TIMEOUT
    made, _ = client_create(name="regressions", scopes="responses,read")
    return made


def new_task(client, policy: RestartPolicy) -> str:
    return lifecycle.task_insert(
        client=client, request=REQUEST, generation=spec_json(REQUEST), model="demo", on_restart=policy
    ).id


def started(task_id: str, worker: str, item_id: str, *deltas: str) -> None:
    """``worker`` claims the task, starts it and commits ``deltas``."""
    assert lifecycle.task_claim(task_id=task_id, worker=worker).won
    snapshot = {"token_ids": [], "state": {"item_id": item_id, "backend": {}}}
    assert lifecycle.task_start(task_id=task_id, worker=worker, item_id=item_id, snapshot=snapshot).won
    if deltas:
        progress = lifecycle.task_progress(
            task_id=task_id, worker=worker, item_id=item_id, deltas=list(deltas), output_tokens=len(deltas)
        )
        assert progress.won


def worker_dies(task_id: str) -> None:
    Task.objects.filter(pk=task_id).update(heartbeat_at=stale_heartbeat())


def recover(how: str) -> RecoverySummary:
    summary = abandoned_tasks_reap() if how == "reaper" else leftover_tasks_recover(live=nobody())
    assert not (summary.counts[RAISED] or summary.counts[BUSY]), summary.lines()
    return summary


def log_of(task_id: str) -> list[str]:
    return list(TaskEvent.objects.filter(task_id=task_id).order_by("sequence_number").values_list("type", flat=True))


@pytest.mark.parametrize("how", ["reaper", "startup"])
def test_a_task_cancelled_while_loading_whose_worker_died_is_recovered_to_cancelled(client, how):
    """Claimed, cancelled before it started, its worker gone: no output item in the log at all.

    Recovery used to raise ``ValueError: min() arg is an empty sequence`` in
    ``selectors.task_outputs_text`` for a page without any output item (fixed).
    """
    task_id = new_task(client, R.RESUME)
    assert lifecycle.task_claim(task_id=task_id, worker=W1).won
    assert lifecycle.task_request_cancel(task_id=task_id).won
    worker_dies(task_id)

    assert recover(how).task_ids == {"cancelled": [task_id]}

    assert log_of(task_id) == ["response.created", "response.cancelled"]
    response = Response.objects.get(task__id=task_id)
    assert (response.status, response.output) == ("cancelled", [])


# Found by the state machine: a task cancelled while loading in its second attempt (``retry``: the first
# attempt showed text, then its worker died and it was queued again) ended ``cancelled`` by recovery with the
# FIRST attempt's text as its output, although the requeue had emptied the response and the second attempt
# showed nothing; while it waited, a read of the response showed that text too. The selectors took the newest
# output item in the log for the current attempt's, and an attempt that never started has none. Fixed: a claim
# marks where its attempt's events begin (``tasks.attempt_after``), and only an item opened after it counts.


def retried_then_cancelled_while_loading(client) -> str:
    task_id = new_task(client, R.RETRY)
    started(task_id, W1, "msg_1", "first ", "attempt")
    worker_dies(task_id)
    assert recover("reaper").task_ids == {"queued": [task_id]}
    assert lifecycle.task_claim(task_id=task_id, worker=W2).won
    assert lifecycle.task_request_cancel(task_id=task_id).won
    return task_id


@pytest.mark.parametrize("how", ["reaper", "startup", "hand_back"])
def test_a_retried_task_cancelled_while_loading_keeps_no_text_of_its_earlier_attempt(client, how):
    task_id = retried_then_cancelled_while_loading(client)
    if how == "hand_back":
        summary = held_task_release(task_id=task_id, worker=W2, reason=HAND_BACK)
    else:
        worker_dies(task_id)
        summary = recover(how)

    assert summary.task_ids == {"cancelled": [task_id]}
    response = Response.objects.get(task__id=task_id)
    assert (response.status, events.output_text(response.output)) == ("cancelled", "")


def test_a_read_of_a_retried_task_cancelled_while_loading_shows_no_text_of_its_earlier_attempt(client):
    task_id = retried_then_cancelled_while_loading(client)
    response_id = Task.objects.get(pk=task_id).response_id

    assert selectors.task_output_text(task_id=task_id) == (None, "")
    assert selectors.response_read_visible(client=client, response_id=response_id).live.output == []
