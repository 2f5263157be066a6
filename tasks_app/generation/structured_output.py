"""Structured output (PROFILE.md 10.5): the one place that translates an output constraint into a grammar.

A Responses request asks with ``text.format``, a chat request with
``response_format``: their adapter (``tasks_app.openai.text_format``) reads
either into the generation spec's :class:`~tasks_app.generation.spec.Constraint`.
``{"type": "text"}`` asks for nothing; ``json_object`` for any JSON
object; ``json_schema`` for JSON that its ``schema`` accepts. Both JSON
formats are enforced by constrained decoding: the worker turns the stored
constraint into an llguidance grammar (:func:`constraint_grammar`) and every token
the model samples is one that grammar allows (``workers.backends.constraints``).
So a ``completed`` answer parses and validates; one cut by the token limit
is ``incomplete``. ``strict: false`` is enforced all the same: a client that
asks for a schema gets it.

A schema the grammar engine cannot compile (an unknown ``format``, a keyword
it does not implement, a broken pattern, a ``$ref`` to nowhere) is a ``400``
naming the schema and the engine's reason, before anything is queued
(``tasks_app.openai.text_format``), never a task that fails later or runs unconstrained.
The JSON is compact (no whitespace between tokens): a model cannot spend its
token budget on spaces, and the text is the same JSON an SDK's parser reads.

An object schema that lists ``properties`` and leaves ``additionalProperties``
unset is compiled as if it said ``false`` (:func:`grammar_schema`; the default
xgrammar gives vLLM and SGLang, docs/decisions/0011): the answer still
validates against the schema, the model only cannot invent keys past the
ones the schema names, which is what a framework's default schema (pydantic
without ``extra="forbid"``) means by its fields. A schema that sets
``additionalProperties`` itself keeps it; an object with no ``properties``
(``{"type": "object"}``, ``json_object``) still takes any keys.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from tasks_app.generation.spec import JSON_SCHEMA, Constraint

# Compact JSON, whatever the schema's own "x-guidance" says: see the module docstring.
COMPILE_OPTIONS: dict[str, Any] = {"whitespace_flexible": False}
_ANY_OBJECT = {"type": "object"}


def _matcher() -> Any:
    # Imported on the first structured request: 90 ms of every web and worker start otherwise.
    from llguidance import LLMatcher

    return LLMatcher


# Keywords beside which an object's own "additionalProperties" would not mean what the schema says (a key
# another branch or a referenced schema defines would be refused): such an object is left as it is.
_COMBINED = ("allOf", "anyOf", "oneOf", "$ref", "unevaluatedProperties", "if", "dependentSchemas")
# Where subschemas sit: a keyword holding one, a list of them, or a map of names to them. "not" is left
# out on purpose: a default inside a negation would widen what the schema accepts.
_ONE = ("items", "additionalProperties", "contains", "propertyNames", "additionalItems")
_LIST = ("anyOf", "oneOf", "prefixItems")
_MAP = ("properties", "patternProperties", "$defs", "definitions")


def _closed(schema: Any, *, in_all_of: bool = False) -> Any:
    """``schema`` with ``additionalProperties: false`` on each object that lists properties and says nothing
    about others (see the module docstring); every other keyword kept as it is."""
    if not isinstance(schema, Mapping):
        return schema
    out = {key: _closed_keyword(key, value) for key, value in schema.items()}
    if (
        not in_all_of
        and isinstance(out.get("properties"), Mapping)
        and "additionalProperties" not in out
        and not any(key in out for key in _COMBINED)
    ):
        out["additionalProperties"] = False
    return out


def _closed_keyword(key: str, value: Any) -> Any:
    """One keyword's value with its subschemas closed (see :func:`_closed`)."""
    if key in _ONE and isinstance(value, Mapping):
        return _closed(value)
    if key in (*_LIST, "items") and isinstance(value, list):
        return [_closed(item) for item in value]
    if key in _MAP and isinstance(value, Mapping):
        return {name: _closed(sub) for name, sub in value.items()}
    if key == "allOf" and isinstance(value, list):
        # A branch of allOf shares the object with its siblings: only what lies inside it is closed.
        return [_closed(item, in_all_of=True) for item in value]
    return value


def grammar_schema(schema: Mapping[str, Any]) -> dict[str, Any]:
    """``schema`` as the grammar engine gets it: no invented keys (:func:`_closed`) and compact JSON, whatever
    the schema's own "x-guidance" says. The tool-call grammars compile their arguments through it too."""
    closed = _closed(schema)
    return {**closed, "x-guidance": {**(closed.get("x-guidance") or {}), **COMPILE_OPTIONS}}


def constraint_grammar(constraint: Constraint | None) -> str | None:
    """The llguidance grammar an output under ``constraint`` must follow; None for free text.

    Called by the worker for every run and every resume of a task, so a task
    keeps the grammar its stored spec describes (the schema was checked when
    the request was accepted).
    """
    if constraint is None:
        return None
    schema = constraint.schema if constraint.kind == JSON_SCHEMA else _ANY_OBJECT
    return _matcher().grammar_from_json_schema(grammar_schema(schema or _ANY_OBJECT), overrides=COMPILE_OPTIONS)


def schema_problem(schema: Any) -> str | None:
    """Why the grammar engine cannot enforce ``schema`` (on one line), or None when it can."""
    try:
        compiled = grammar_schema(schema) if isinstance(schema, Mapping) else schema
        grammar = _matcher().grammar_from_json_schema(compiled, overrides=COMPILE_OPTIONS)
        problem = _matcher().validate_grammar(grammar)
    except (ValueError, TypeError) as exc:
        problem = str(exc)
    return _one_line(problem) if problem else None


def constraint_summary(constraint: Constraint | None) -> str:
    """The constraint a task's output runs under, in a few words (the admin's task page)."""
    if constraint is None:
        return "none: free text"
    if constraint.kind == JSON_SCHEMA:
        strict = " (strict)" if constraint.strict else ""
        return f"json_schema {constraint.name!r}{strict}: JSON its schema accepts, enforced by a grammar"
    return "json_object: any JSON object, enforced by a grammar"


def _one_line(problem: str) -> str:
    """The engine's reason on one line: a regex error spans several, with a caret line under the pattern."""
    lines = [line.strip() for line in problem.strip().splitlines()]
    return " ".join(line for line in lines if line and set(line) != {"^"})[:300]
