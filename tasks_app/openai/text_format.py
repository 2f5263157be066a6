"""OpenAI's output formats on a request (PROFILE.md 10.5): ``text.format`` of a Responses request, a chat
request's ``response_format`` (translated to ``text.format``, the shape a task stores), read into the
generation spec's constraint, and refused by name where they cannot be enforced."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from tasks_app.exceptions import InvalidRequest, UnsupportedParameter
from tasks_app.generation.spec import ANY_JSON_OBJECT, JSON_SCHEMA, Constraint
from tasks_app.generation.structured_output import schema_problem

TEXT = "text"
JSON_OBJECT = ANY_JSON_OBJECT
STRUCTURED = (JSON_OBJECT, JSON_SCHEMA)
_ANY_OBJECT = {"type": "object"}


def text_format_of(request: Mapping[str, Any]) -> Mapping[str, Any]:
    """The output format a stored request asks for (``{"type": "text"}`` when it names none)."""
    return (request.get("text") or {}).get("format") or {"type": TEXT}


def spec_constraint(request: Mapping[str, Any]) -> Constraint | None:
    """The constraint a checked request's format asks for; None for free text."""
    text_format = text_format_of(request)
    kind = text_format.get("type", TEXT)
    if kind == JSON_SCHEMA:
        return Constraint(
            JSON_SCHEMA,
            schema=text_format.get("schema"),
            name=text_format.get("name"),
            strict=bool(text_format.get("strict")),
        )
    return Constraint(JSON_OBJECT) if kind == JSON_OBJECT else None


def format_check(request: Mapping[str, Any], *, param: str = "text.format") -> None:
    """Refuse a structured format that cannot be enforced, naming the field (``param`` is where the format
    sits in the request the client sent: ``text.format``, or ``response_format`` for a chat request)."""
    text_format = text_format_of(request)
    kind = text_format.get("type", TEXT)
    if kind not in STRUCTURED:
        return
    schema_param = f"{param}.schema" if param == "text.format" else f"{param}.json_schema.schema"
    if kind == JSON_SCHEMA:
        if not text_format.get("name"):
            name_param = f"{param}.name" if param == "text.format" else f"{param}.json_schema.name"
            raise InvalidRequest(
                "a json_schema format needs a name", errors=[{"field": name_param, "message": "required"}]
            )
        if not isinstance(text_format.get("schema"), Mapping):
            raise InvalidRequest(
                "a json_schema format needs a schema (a JSON Schema object)",
                errors=[{"field": schema_param, "message": "required"}],
            )
    if request.get("stop"):
        raise UnsupportedParameter(
            f"stop: a stop string would cut the JSON a structured format asks for; send no stop with {param} {kind}",
            param="stop",
        )
    problem = schema_problem(text_format.get("schema") if kind == JSON_SCHEMA else _ANY_OBJECT)
    if problem:
        raise InvalidRequest(
            f"the schema cannot be enforced: {problem}", errors=[{"field": schema_param, "message": problem}]
        )


def chat_response_format_as_text_format(response_format: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """A chat request's ``response_format`` as the ``text.format`` of the response request it runs as."""
    if not response_format:
        return None
    kind = response_format.get("type", TEXT)
    if kind != JSON_SCHEMA:
        return {"type": kind}
    nested = response_format.get("json_schema") or {}
    kept = ("name", "schema", "strict", "description")
    return {"type": JSON_SCHEMA, **{key: nested[key] for key in kept if key in nested}}
