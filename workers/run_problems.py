"""The problem a task ends with for each error its run raised: where the runtime's errors get their codes."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from tasks_app.exceptions import BackendError, ContextLengthExceeded, InvalidRequest, LmspError, ModelLoadFailed
from workers.backends.errors import ContextTooLong, ModelLoadError, PromptRejected, RuntimeFailure

_DETAIL_LIMIT = 500


def runtime_problem(exc: BaseException) -> dict[str, Any]:
    """The problem a task ends with when the runtime raised ``exc``.

    The runtime knows nothing of HTTP; this is where its errors get their
    problem codes: a model that does not load is ``model_load_failed``, an
    input the chat template refuses is ``invalid_request``, anything else
    the backend did is ``backend_error``.
    """
    if isinstance(exc, ModelLoadError):
        return ModelLoadFailed(str(exc)).to_problem()
    if isinstance(exc, PromptRejected):
        return InvalidRequest(str(exc)).to_problem()
    if isinstance(exc, ContextTooLong):
        return ContextLengthExceeded(str(exc)).to_problem()
    if isinstance(exc, RuntimeFailure):  # GenerationError, and any the runtime adds later
        return BackendError(str(exc)).to_problem()
    if isinstance(exc, LmspError):
        return exc.to_problem()
    detail = f"{type(exc).__name__}: {exc}"
    if len(detail) > _DETAIL_LIMIT:
        detail = detail[: _DETAIL_LIMIT - 3] + "..."
    return BackendError(f"The inference backend failed ({detail})").to_problem()


def is_fault(problem: Mapping[str, Any]) -> bool:
    return int(problem.get("status") or 500) >= 500
