"""The problem a task ends with for each error the runtime raises (``workers.run_problems.runtime_problem``).

The runtime knows nothing of HTTP; the worker gives its errors their codes.
Over HTTP, ``test_worker`` shows two of them end to end (a corrupt model,
a prompt over the context); this covers every class.
"""

from __future__ import annotations

import pytest

from tasks_app.exceptions import TaskNotCancelable
from workers.backends.errors import GenerationError, ModelLoadError, PromptRejected, RuntimeFailure
from workers.run_problems import runtime_problem


@pytest.mark.parametrize(
    ("error", "status", "code"),
    [
        (ModelLoadError("model folder 'x' has no model.onnx"), 500, "model_load_failed"),
        (PromptRejected("the chat template of model 'x' rejects this input: no system role"), 400, "invalid_request"),
        (GenerationError("inference failed: out of memory"), 500, "backend_error"),
    ],
)
def test_each_runtime_error_becomes_its_problem_with_the_message_as_detail(error, status, code):
    problem = runtime_problem(error)
    assert (problem["status"], problem["code"], problem["detail"]) == (status, code, str(error))


def test_a_runtime_failure_without_its_own_class_is_a_backend_error_with_its_message():
    problem = runtime_problem(RuntimeFailure("the runtime gave up"))
    assert (problem["code"], problem["detail"]) == ("backend_error", "the runtime gave up")


def test_an_unexpected_exception_is_a_backend_error_naming_its_type_and_cut_short():
    problem = runtime_problem(ValueError("x" * 2000))
    assert problem["code"] == "backend_error"
    assert problem["detail"].startswith("The inference backend failed (ValueError: xxx")
    assert len(problem["detail"]) < 600


def test_a_service_error_keeps_its_own_problem():
    assert runtime_problem(TaskNotCancelable("already succeeded"))["code"] == "task_not_cancelable"
