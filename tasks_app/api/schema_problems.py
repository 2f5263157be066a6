"""The problems of the schema, from the exception classes of ``tasks_app.exceptions``.

Every ``code`` a problem can carry, the problems one operation answers (its
handler's own, named with ``operation(problems=...)``, and the ones every
operation shares), and the response object of one status, whose ``code``
enum, descriptions and examples come from the classes, so the schema cannot
drift from the codes we raise.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from typing import Any

from tasks_app import exceptions as exc

PROBLEM_MEDIA_TYPE = "application/problem+json"
EXAMPLE_TASK_ID = "task_01J8M8R5X3V7B2N4Q9T1W6Y0ZC"
EXAMPLE_RESPONSE_ID = "resp_01J8M8R5X4B9D2F6H1K3N7Q0ZW"
EXAMPLE_MODEL_ID = "qwen2.5-0.5b-instruct:q4"


def problem_classes() -> list[type[exc.LmspError]]:
    """``LmspError`` and every subclass, each once, in definition order."""
    found: list[type[exc.LmspError]] = []
    stack = [exc.LmspError]
    while stack:
        cls = stack.pop(0)
        if cls not in found:
            found.append(cls)
            stack.extend(cls.__subclasses__())
    return found


def problem_codes() -> list[str]:
    """Every ``code`` a problem object can carry (an HTTP answer, or a task's or response's ``error``)."""
    return list(dict.fromkeys(cls.code for cls in problem_classes()))


def problem_meaning(cls: type[exc.LmspError]) -> str:
    """The class docstring's first line as documentation: "Raised when X." becomes "When X."."""
    text = inspect.getdoc(cls) or cls.title
    first = text.strip().splitlines()[0]
    if first.startswith("Raised when "):
        first = "When " + first.removeprefix("Raised when ")
    return first


_STATUS_NOTES = {
    401: "Missing, malformed, unknown or revoked credentials.",
    405: "Answered to any method this path does not serve, before authentication.",
    413: "The request size limit (`max_request_bytes` in the capabilities) applies to every request, before routing.",
    500: "Never carries a traceback.",
}
_STATUS_HEADERS = {
    401: {
        "WWW-Authenticate": {
            "schema": {"type": "string"},
            "required": True,
            "description": 'The bearer challenge, e.g. `Bearer realm="lmsp", error="invalid_token"`.',
        }
    },
    405: {"Allow": {"schema": {"type": "string"}, "required": True, "description": "The methods this path serves."}},
    429: {
        "Retry-After": {
            "schema": {"type": "integer", "minimum": 1},
            "required": True,
            "description": "Seconds to wait before trying again.",
        }
    },
}
# A 503 (the database away or locked, Redis not available in time) and a 507 (the database's disk full) ask to
# come back later, as a 429 does.
_STATUS_HEADERS[503] = _STATUS_HEADERS[507] = _STATUS_HEADERS[429]


def _example_instance(path: str) -> str:
    return (
        path.replace("{task_id}", EXAMPLE_TASK_ID)
        .replace("{response_id}", EXAMPLE_RESPONSE_ID)
        .replace("{model_id}", EXAMPLE_MODEL_ID)
    )


def _example(cls: type[exc.LmspError], path: str) -> dict[str, Any]:
    errors = [{"field": "input.model", "message": "This field is required."}] if cls is exc.InvalidRequest else None
    return {"summary": cls.title, "value": cls(errors=errors).to_http_problem(_example_instance(path))}


ErrorContent = Callable[[int, Sequence[type[exc.LmspError]]], dict[str, Any]]
"""Another protocol's error shape in the schema: a status and its problems -> the response's ``content``."""


def _problem_content(status: int, classes: Sequence[type[exc.LmspError]], path: str) -> dict[str, Any]:
    return {
        PROBLEM_MEDIA_TYPE: {
            "schema": {
                "allOf": [
                    {"$ref": "#/components/schemas/Problem"},
                    {
                        "type": "object",
                        "properties": {
                            "status": {"type": "integer", "enum": [status]},
                            "code": {"type": "string", "enum": list(dict.fromkeys(cls.code for cls in classes))},
                        },
                    },
                ]
            },
            "examples": {cls.code: _example(cls, path) for cls in classes},
        }
    }


def problem_response(
    status: int, classes: Sequence[type[exc.LmspError]], path: str, *, content: ErrorContent | None = None
) -> dict[str, Any]:
    """One status's response: the Problem schema narrowed to this status and its codes, an example per code.

    ``content``: the route answers its protocol's error shape instead; the description still names the
    problems (the LMSP codes) that lead to this status.
    """
    lines = [f"- `{cls.code}`: {problem_meaning(cls)}" for cls in classes]
    if status in _STATUS_NOTES:
        lines.append("\n" + _STATUS_NOTES[status])
    body = content(status, classes) if content is not None else _problem_content(status, classes, path)
    response: dict[str, Any] = {"description": "\n".join(lines), "content": body}
    if status in _STATUS_HEADERS:
        response["headers"] = _STATUS_HEADERS[status]
    return response


def operation_problems(
    *,
    handler_problems: Sequence[type[exc.LmspError]],
    method: str,
    public: bool,
    has_body: bool,
    any_content_type: bool = False,
) -> dict[int, list[type[exc.LmspError]]]:
    """Every problem one operation answers, by status (``any_content_type``: a body is read as JSON whatever
    its ``Content-Type`` says, so no 415)."""
    # Every operation reads or writes the database: while it is away, each answers 503 (507: its disk full).
    shared: list[type[exc.LmspError]] = [
        exc.MethodNotAllowed,
        exc.InternalError,
        exc.DatabaseUnavailable,
        exc.InsufficientStorage,
    ]
    if not public:
        shared += [exc.Unauthorized, exc.InsufficientScope]
    if method == "POST":
        shared.append(exc.PayloadTooLarge)
    if has_body:
        # The strict JSON parser's refusals (malformed JSON, not an object) and a wrong Content-Type.
        shared += [exc.InvalidRequest] if any_content_type else [exc.InvalidRequest, exc.UnsupportedMediaType]
    by_status: dict[int, list[type[exc.LmspError]]] = {}
    for cls in [*handler_problems, *shared]:
        codes = by_status.setdefault(cls.status, [])
        if cls not in codes:
            codes.append(cls)
    return dict(sorted(by_status.items()))
