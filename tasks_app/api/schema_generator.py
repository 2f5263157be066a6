"""The OpenAPI 3 schema of ``/lmsp/v1`` (drf-spectacular), served at ``/lmsp/v1/openapi.json``.

drf-spectacular reads the DRF views and their ``extend_schema`` annotations
(``schema_annotations.operation``). This module, which spectacular loads from
``SPECTACULAR_SETTINGS`` only to build the schema, adds what it cannot see
on its own:

- The plain async views (the event streams of ``tasks_app/api/stream_views.py``;
  ``POST /responses`` and ``GET /responses/{id}`` of
  ``tasks_app/openai/responses/stream_views.py``; ``POST /chat/completions``)
  are not DRF views, so the generator documents each through a stand-in
  ``APIView`` (``schema_stand_ins.py``) that is never routed.
- Problems: a handler names the exception classes it raises itself with
  ``operation(problems=...)``; the postprocessing hook adds the ones every
  operation shares (401/403, 405, 413, 415, 500) and builds one response per
  status whose ``code`` enum, descriptions and examples come from the
  exception classes (``schema_problems.py``), so the schema cannot drift from
  the codes we raise.
- Another protocol's routes (a view with ``schema_error_content``: the
  Messages routes, Ollama's ``/api/...``) answer every problem in that protocol's error shape
  (``tasks_app/edge/error_shapes.py``): their error answers are written by
  it, and the view's ``schema_components`` join the components.
- Security: per operation from the views' ``scopes_by_method`` (``None`` is
  public), so the schema states exactly what ``HasRequiredScopes`` checks;
  a view that also takes ``x-api-key`` lists it beside the bearer, and a
  view's ``schema_auth_note`` (Ollama's anonymous rule) joins the note.
- Strict requests: what the server refuses in every request (U+0000 in a
  string, an undeclared field) is stated on every request schema, so a
  request the schema allows is one the server takes.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from django.conf import settings
from drf_spectacular.extensions import OpenApiAuthenticationExtension
from drf_spectacular.generators import EndpointEnumerator, SchemaGenerator

from tasks_app.api.schema_annotations import CHAT_COMPLETION_CHUNK_SCHEMA
from tasks_app.api.schema_components import stream_event_schema
from tasks_app.api.schema_problems import operation_problems, problem_classes, problem_meaning, problem_response
from tasks_app.api.schema_stand_ins import documented_view

API_PREFIX = "/lmsp/v1/"
# Ollama's native API (tasks_app/ollama/): its clients take a bare host, so its routes sit beside /lmsp/v1.
OLLAMA_PREFIX = "/api/"
BEARER = "bearerAuth"
API_KEY = "apiKeyAuth"
STREAM_TOKEN = "streamToken"
STAFF_SESSION = "staffSession"


class LmspEndpointEnumerator(EndpointEnumerator):
    """The ``/lmsp/v1`` and Ollama's ``/api`` routes only (not the admin, not ``/metrics``), stand-ins included."""

    def should_include_endpoint(self, path: str, callback: Callable[..., Any]) -> bool:
        return path.startswith((API_PREFIX, OLLAMA_PREFIX)) and super().should_include_endpoint(
            path, documented_view(callback)
        )

    def get_allowed_methods(self, callback: Callable[..., Any]) -> list[str]:
        return super().get_allowed_methods(documented_view(callback))


class LmspSchemaGenerator(SchemaGenerator):
    endpoint_inspector_cls = LmspEndpointEnumerator

    def create_view(self, callback: Callable[..., Any], method: str, request: Any = None) -> Any:
        return super().create_view(documented_view(callback), method, request)


class BearerTokenScheme(OpenApiAuthenticationExtension):
    target_class = "tasks_app.edge.auth.BearerTokenAuthentication"
    name = BEARER

    def get_security_definition(self, auto_schema: Any) -> dict[str, Any]:
        return {
            "type": "http",
            "scheme": "bearer",
            "description": "A client's token (`lmsp_client create`, or `POST /pair`). Never in a URL.",
        }


class OllamaAuthenticationScheme(OpenApiAuthenticationExtension):
    """Ollama's routes take the same bearer: no scheme of their own (the hook writes their requirement, and
    their anonymous rule goes in each operation's note)."""

    target_class = "tasks_app.ollama.auth.OllamaAuthentication"
    name: list[str] = []

    def get_security_requirement(self, auto_schema: Any) -> None:
        return None

    def get_security_definition(self, auto_schema: Any) -> list[dict[str, Any]]:
        return []


API_KEY_AUTHENTICATION = "tasks_app.anthropic.views.ApiKeyAuthentication"


class ApiKeyScheme(OpenApiAuthenticationExtension):
    target_class = API_KEY_AUTHENTICATION
    name = API_KEY

    def get_security_definition(self, auto_schema: Any) -> dict[str, Any]:
        return {
            "type": "apiKey",
            "in": "header",
            "name": "x-api-key",
            "description": "The same client tokens as a bearer, as Anthropic's SDKs send `ANTHROPIC_API_KEY` "
            "(the Messages routes only).",
        }


def _takes_api_key(view_cls: type) -> bool:
    return any(
        f"{auth.__module__}.{auth.__qualname__}" == API_KEY_AUTHENTICATION
        for auth in getattr(view_cls, "authentication_classes", ())
    )


# --- the postprocessing hook ------------------------------------------------------------------------


def _security(view_cls: type, method: str) -> tuple[list[dict[str, list[str]]], str]:
    scopes = view_cls.scopes_by_method[method]
    if scopes is None:
        return [], "**Auth:** public, no token."
    # OpenAPI 3.1 lets a non-OAuth requirement list the roles it needs: here the scopes.
    requirements = [{BEARER: list(scopes)}]
    named = ", ".join(f"`{scope}`" for scope in scopes)
    note = f"**Auth:** a bearer token with the scope {named} (or `admin`)." if scopes else "**Auth:** a bearer token."
    if _takes_api_key(view_cls):
        requirements.append({API_KEY: list(scopes)})
        note += " The token may come as `x-api-key` instead."
    note += getattr(view_cls, "schema_auth_note", "")
    if getattr(view_cls, "stream_readers", False):
        requirements += [{STREAM_TOKEN: []}, {STAFF_SESSION: []}]
        note += " For the event stream also a stream token (`?token=`) or a logged-in staff session."
    return requirements, note


def _endpoints(generator: SchemaGenerator) -> Iterator[tuple[str, str, type]]:
    for path, _regex, method, callback in generator.endpoints:
        yield path, method, documented_view(callback).cls


def lmsp_postprocess(result: dict[str, Any], generator: SchemaGenerator, **kwargs: Any) -> dict[str, Any]:
    """POSTPROCESSING_HOOKS: security, problems and the shared components (see the module docstring)."""
    answered: set[str] = set()
    components: dict[str, Any] = {}
    for path, method, view_cls in _endpoints(generator):
        op = result["paths"].get(path, {}).get(method.lower())
        if op is None:
            continue
        body = op.get("requestBody", {})
        if any(media.get("schema", {}).get("required") for media in body.get("content", {}).values()):
            # A body written out as a schema (not a serializer) with required fields is itself required.
            body["required"] = True
        security, note = _security(view_cls, method)
        op["security"] = security
        op["description"] = f"{op.get('description', '').strip()}\n\n{note}".strip()
        handler = getattr(view_cls, method.lower())
        problems = operation_problems(
            handler_problems=getattr(handler, "lmsp_problems", ()),
            method=method,
            public=not security,
            has_body="requestBody" in op,
            any_content_type=getattr(view_cls, "schema_any_content_type", False),
        )
        responses = dict(op["responses"])
        # A protocol adapter's routes answer problems in its own error shape (tasks_app/edge/error_shapes.py).
        error_content = getattr(view_cls, "schema_error_content", None)
        for status, classes in problems.items():
            responses[str(status)] = problem_response(status, classes, path, content=error_content)
            if error_content is None:
                answered.update(cls.code for cls in classes)
        components.update(getattr(view_cls, "schema_components", {}))
        op["responses"] = dict(sorted(responses.items()))

    result.setdefault("components", {}).setdefault("schemas", {}).update(components)
    components = result["components"]
    components["schemas"]["StreamEvent"] = stream_event_schema()
    components["schemas"]["ChatCompletionChunk"] = CHAT_COMPLETION_CHUNK_SCHEMA
    components["schemas"][JSON_VALUE] = JSON_VALUE_SCHEMA
    components["schemas"] = dict(sorted(components["schemas"].items()))
    schemes = components.setdefault("securitySchemes", {})
    schemes[STREAM_TOKEN] = {
        "type": "apiKey",
        "in": "query",
        "name": "token",
        "description": "A short-lived read-only token for one task's event stream "
        "(`POST /tasks/{task_id}/stream_token`).",
    }
    schemes[STAFF_SESSION] = {
        "type": "apiKey",
        "in": "cookie",
        "name": settings.SESSION_COOKIE_NAME,
        "description": "A logged-in, active staff user of the Django admin; reads every task's events.",
    }
    result["info"]["description"] = service_description(answered)
    _strict_request_schemas(result)
    return _without_enum_ids(result)


# What the strict JSON parser (``parsers.check_strings``) and DRF's ``CharField`` refuse in any string a
# client sends, as a pattern, so the schema allows exactly the strings the server takes.
NO_NUL_PATTERN = "^[^\\u0000]*$"


def _strict_request_schemas(result: dict[str, Any]) -> None:
    """Make the request bodies and query parameters refuse what the server refuses everywhere.

    Every free string gets ``NO_NUL_PATTERN`` (also the keys of a map), and
    every object with declared fields ``additionalProperties: false``: every
    input serializer is a ``StrictSerializer``, which refuses undeclared
    fields by name.
    """
    schemas = result.get("components", {}).get("schemas", {})
    pending: list[Any] = []
    for operations in result["paths"].values():
        for op in operations.values():
            pending += [media.get("schema") for media in op.get("requestBody", {}).get("content", {}).values()]
            pending += [p.get("schema") for p in op.get("parameters", []) if p.get("in") == "query"]
    seen: set[str] = set()
    while pending:
        node = pending.pop()
        if not isinstance(node, dict):
            continue
        ref = node.get("$ref", "")
        if ref.startswith("#/components/schemas/") and ref not in seen:
            seen.add(ref)
            pending.append(schemas.get(ref.rsplit("/", 1)[1]))
        _make_strict(node)
        pending += _subschemas(node)


# Any JSON value the parser takes: what a free-form object (a tool's `parameters`, a hint) or list may hold.
JSON_VALUE = "JsonValue"
JSON_VALUE_REF = {"$ref": f"#/components/schemas/{JSON_VALUE}"}
JSON_VALUE_SCHEMA = {
    "description": "Any JSON value without U+0000 in its strings or keys.",
    "anyOf": [
        {"type": ["null", "boolean", "number"]},
        {"type": "string", "pattern": NO_NUL_PATTERN},
        {"type": "array", "items": JSON_VALUE_REF},
        {"type": "object", "propertyNames": {"pattern": NO_NUL_PATTERN}, "additionalProperties": JSON_VALUE_REF},
    ],
}


def _of_type(node: dict[str, Any], name: str) -> bool:
    types = node.get("type")
    return types == name or (isinstance(types, list) and name in types)


def _make_strict(node: dict[str, Any]) -> None:
    is_string = _of_type(node, "string")
    if is_string and not {"enum", "const", "pattern"} & set(node):
        node["pattern"] = NO_NUL_PATTERN
    if _of_type(node, "array") and "items" not in node:
        node["items"] = JSON_VALUE_REF
    if _of_type(node, "object") and not {"properties", "additionalProperties", "oneOf", "anyOf"} & set(node):
        node["additionalProperties"] = JSON_VALUE_REF
    if isinstance(node.get("additionalProperties"), dict):
        node.setdefault("propertyNames", {}).setdefault("pattern", NO_NUL_PATTERN)
    elif "properties" in node:
        node.setdefault("additionalProperties", False)


def _subschemas(node: dict[str, Any]) -> list[Any]:
    found = list((node.get("properties") or {}).values())
    for key in ("items", "oneOf", "anyOf", "allOf", "additionalProperties"):
        value = node.get(key)
        found += value if isinstance(value, list) else [value]
    return found


def _without_enum_ids(node: Any) -> Any:
    """Drop spectacular's ``x-spec-enum-id`` markers, which only its own enum hook (not used) consumes."""
    if isinstance(node, dict):
        return {key: _without_enum_ids(value) for key, value in node.items() if key != "x-spec-enum-id"}
    if isinstance(node, list):
        return [_without_enum_ids(value) for value in node]
    return node


def service_description(answered: set[str]) -> str:
    """``info.description``: the rules every operation shares, and every problem code."""
    # The most specific class of each code (``InternalError`` over the base ``LmspError``).
    by_code = {cls.code: cls for cls in problem_classes()}

    def table(codes: list[str]) -> str:
        classes = sorted((by_code[code] for code in codes), key=lambda cls: (cls.status, cls.code))
        rows = "\n".join(f"| `{cls.code}` | {cls.status} | {cls.title} | {problem_meaning(cls)} |" for cls in classes)
        return f"| code | status | title | meaning |\n|---|---|---|---|\n{rows}"

    others = [code for code in by_code if code not in answered]
    return f"""LMSP 1.0 with durable tasks: a task is committed to the database before its `202`, and is
found in a defined state after any crash or restart.

**Auth.** `Authorization: Bearer <token>` on every operation except `GET /capabilities` and `POST /pair`.
Scopes: `responses` (create responses and tasks, cancel own tasks), `read` (read own tasks, responses,
events, models), `admin` (every scope, every client's tasks). Another client's task or response is `404`.

**Ollama's native API** (tag `Ollama`, docs/ollama.md) sits at `/api/...` beside `/lmsp/v1`, as its clients
take a bare host: the same tokens and scopes, its own shapes, and every error as Ollama's
`{{"error": "..."}}` (`application/json`) with the status the problem below has.

**Errors** are RFC 9457 problems (`application/problem+json`) with a `code`; each operation lists, per
status, the codes it answers. The codes the operations answer:

{table(sorted(answered))}

The other codes the service defines appear in the `error` of a failed task or response, answer an unknown
path (`not_found`), or belong to endpoints outside this API:

{table(others)}

Requests are JSON only (`Content-Type: application/json`); the `Accept` header is not negotiated, so no
operation answers `406`. Every `GET` that answers JSON also answers `HEAD`. Bodies larger than
`max_request_bytes` are refused with `413` before routing.
"""
