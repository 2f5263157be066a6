"""The OpenAPI 3 schema of ``/lmsp/v1`` (drf-spectacular), served at ``/lmsp/v1/openapi.json``.

drf-spectacular reads the DRF views and their ``extend_schema`` annotations.
Three things it cannot see on its own are added here:

- The plain async views of ``streams.py`` (the event streams, ``POST
  /responses``, ``GET /responses/{id}``) are not DRF views, so the generator
  documents each through a stand-in ``APIView`` below that is never routed.
- Problems: a handler names the exception classes it raises itself with
  ``operation(problems=...)``; the postprocessing hook adds the ones every
  operation shares (401/403, 405, 413, 415, 500) and builds one response per
  status whose ``code`` enum, descriptions and examples come from the
  exception classes, so the schema cannot drift from the codes we raise.
- Security: per operation from the views' ``scopes_by_method`` (``None`` is
  public), so the schema states exactly what ``HasRequiredScopes`` checks.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar

from django.conf import settings
from drf_spectacular.extensions import OpenApiAuthenticationExtension
from drf_spectacular.generators import EndpointEnumerator, SchemaGenerator
from drf_spectacular.utils import (
    OpenApiExample,
    OpenApiParameter,
    OpenApiResponse,
    extend_schema,
    extend_schema_serializer,
)
from rest_framework import serializers
from rest_framework.views import APIView

from tasks_app import exceptions as exc
from tasks_app.api.serializers import MAX_METADATA_PAIRS, ResponseRequestSerializer
from tasks_app.models import (
    TERMINAL_EVENT_TYPES,
    ResponseStatus,
    RestartPolicy,
    TaskStatus,
    TaskType,
)
from tasks_app.services.clients import SCOPES
from tasks_app.services.idempotency import MAX_KEY_LENGTH

F = TypeVar("F", bound=Callable[..., Any])

API_PREFIX = "/lmsp/v1/"
PROBLEM_MEDIA_TYPE = "application/problem+json"
EVENT_STREAM_MEDIA_TYPE = "text/event-stream"
BEARER = "bearerAuth"
STREAM_TOKEN = "streamToken"
STAFF_SESSION = "staffSession"
EXAMPLE_TASK_ID = "task_01J8M8R5X3V7B2N4Q9T1W6Y0ZC"
EXAMPLE_RESPONSE_ID = "resp_01J8M8R5X4B9D2F6H1K3N7Q0ZW"

# The order of a task's log (PROFILE.md section 4); the terminal types are the
# model's own constant, which the lifecycle and the stream reader use.
EVENT_TYPES = (
    "response.created",
    "response.in_progress",
    "response.output_item.added",
    "response.content_part.added",
    "response.output_text.delta",
    "response.output_text.done",
    "response.content_part.done",
    "response.output_item.done",
    *TERMINAL_EVENT_TYPES,
)


# --- problem codes, from the exception classes ------------------------------------------------------


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


def _meaning(cls: type[exc.LmspError]) -> str:
    """The class docstring's first line as documentation: "Raised when X." becomes "When X."."""
    text = inspect.getdoc(cls) or cls.title
    first = text.strip().splitlines()[0]
    if first.startswith("Raised when "):
        first = "When " + first.removeprefix("Raised when ")
    return first


# --- schema-only components (never used to render: ``objects.py`` and the output serializers do) ----


@extend_schema_serializer(component_name="ProblemFieldError")
class ProblemFieldErrorSchema(serializers.Serializer):
    field = serializers.CharField(
        help_text="Where: a dotted path into the body (`input.model`, `input.input[0].role`), "
        "or the query parameter or header at fault (`starting_after`, `Idempotency-Key`)."
    )
    message = serializers.CharField()


@extend_schema_serializer(component_name="Problem")
class ProblemSchema(serializers.Serializer):
    """An RFC 9457 problem (``application/problem+json``); also a failed task's or response's ``error``."""

    type = serializers.CharField(help_text="`urn:lmsp:problem:` followed by `code`.")
    title = serializers.CharField(help_text="Fixed per code.")
    status = serializers.IntegerField(help_text="The HTTP status that goes with `code`.")
    detail = serializers.CharField(help_text="What went wrong with this request, for people.")
    code = serializers.ChoiceField(choices=problem_codes(), help_text="What programs branch on.")
    instance = serializers.CharField(
        required=False, help_text="The request path. Absent in a task's or response's `error`."
    )
    errors = ProblemFieldErrorSchema(
        many=True, required=False, help_text="Validation errors, one per offending field (400 only)."
    )


@extend_schema_serializer(component_name="Usage")
class UsageSchema(serializers.Serializer):
    input_tokens = serializers.IntegerField()
    output_tokens = serializers.IntegerField()
    total_tokens = serializers.IntegerField()


@extend_schema_serializer(component_name="OutputText")
class OutputTextSchema(serializers.Serializer):
    type = serializers.ChoiceField(choices=["output_text"])
    text = serializers.CharField()
    annotations = serializers.ListField(child=serializers.DictField())


@extend_schema_serializer(component_name="OutputMessage")
class OutputMessageSchema(serializers.Serializer):
    id = serializers.CharField(help_text="`msg_` + ULID.")
    type = serializers.ChoiceField(choices=["message"])
    status = serializers.ChoiceField(choices=["in_progress", "completed", "incomplete"])
    role = serializers.ChoiceField(choices=["assistant"])
    content = OutputTextSchema(many=True)


@extend_schema_serializer(component_name="IncompleteDetails")
class IncompleteDetailsSchema(serializers.Serializer):
    reason = serializers.ChoiceField(choices=["max_output_tokens"])


@extend_schema_serializer(component_name="Response")
class ResponseSchema(serializers.Serializer):
    """The response object (PROFILE.md section 3)."""

    id = serializers.CharField(help_text="`resp_` + ULID.")
    object = serializers.ChoiceField(choices=["response"])
    created_at = serializers.IntegerField(help_text="Unix seconds.")
    status = serializers.ChoiceField(choices=ResponseStatus.values)
    model = serializers.CharField()
    output = OutputMessageSchema(many=True)
    usage = UsageSchema(allow_null=True)
    error = ProblemSchema(allow_null=True, help_text="Set when `status` is `failed`.")
    incomplete_details = IncompleteDetailsSchema(allow_null=True)
    instructions = serializers.CharField(allow_null=True)
    max_output_tokens = serializers.IntegerField(allow_null=True)
    temperature = serializers.FloatField(allow_null=True)
    top_p = serializers.FloatField(allow_null=True)
    metadata = serializers.DictField(child=serializers.CharField(), help_text=f"At most {MAX_METADATA_PAIRS} pairs.")


@extend_schema_serializer(component_name="Task")
class TaskSchema(serializers.Serializer):
    """The task object (chapter 7.1)."""

    id = serializers.CharField(help_text="`task_` + ULID.")
    object = serializers.ChoiceField(choices=["task"])
    type = serializers.ChoiceField(choices=TaskType.values)
    status = serializers.ChoiceField(choices=TaskStatus.values)
    created_at = serializers.IntegerField(help_text="Unix seconds.")
    updated_at = serializers.IntegerField(help_text="Unix seconds.")
    response_id = serializers.CharField(help_text="`resp_` + ULID, fixed at creation.")
    events_url = serializers.CharField(help_text="Path of the task's event stream.")
    on_restart = serializers.ChoiceField(choices=RestartPolicy.values)
    response = ResponseSchema(allow_null=True, help_text="The response once `status` is `succeeded`, else null.")
    error = ProblemSchema(allow_null=True, help_text="Why the task failed once `status` is `failed`, else null.")


class _PageSchema(serializers.Serializer):
    """The list envelope every page shares; subclasses add ``data``."""

    object = serializers.ChoiceField(choices=["list"])
    first_id = serializers.CharField(allow_null=True)
    last_id = serializers.CharField(allow_null=True, help_text="Pass as `after` for the next page.")
    has_more = serializers.BooleanField()


@extend_schema_serializer(component_name="TaskList")
class TaskListSchema(_PageSchema):
    data = TaskSchema(many=True)


@extend_schema_serializer(component_name="ModelCapabilities")
class ModelCapabilitiesSchema(serializers.Serializer):
    resumable_snapshots = serializers.BooleanField(help_text="`on_restart: resume` is accepted for this model.")
    chat_template = serializers.BooleanField()


@extend_schema_serializer(component_name="Model")
class ModelSchema(serializers.Serializer):
    id = serializers.CharField(help_text="`name` or `name:tag`.")
    object = serializers.ChoiceField(choices=["model"])
    created = serializers.IntegerField(help_text="Unix seconds.")
    owned_by = serializers.CharField()
    backend = serializers.CharField()
    digest = serializers.CharField(help_text="`sha256:` of the model's files.")
    size_bytes = serializers.IntegerField()
    capabilities = ModelCapabilitiesSchema()
    context_length = serializers.IntegerField(allow_null=True)


@extend_schema_serializer(component_name="ModelList")
class ModelListSchema(_PageSchema):
    data = ModelSchema(many=True)


@extend_schema_serializer(component_name="Capabilities")
class CapabilitiesSchema(serializers.Serializer):
    object = serializers.ChoiceField(choices=["capabilities"])
    lmsp_version = serializers.CharField()
    service_id = serializers.CharField(help_text="This installation's stable id.")
    event_resume = serializers.BooleanField()
    task_types = serializers.ListField(child=serializers.ChoiceField(choices=TaskType.values))
    on_restart = serializers.ListField(child=serializers.ChoiceField(choices=RestartPolicy.values))
    idempotency = serializers.BooleanField()
    pairing = serializers.BooleanField()
    scopes = serializers.ListField(child=serializers.ChoiceField(choices=SCOPES))
    max_request_bytes = serializers.IntegerField(help_text="Larger request bodies are refused with 413.")


@extend_schema_serializer(component_name="StreamToken")
class StreamTokenSchema(serializers.Serializer):
    object = serializers.ChoiceField(choices=["stream_token"])
    token = serializers.CharField(help_text="Read-only, for this task's event stream only.")
    task_id = serializers.CharField()
    expires_at = serializers.IntegerField(help_text="Unix seconds.")
    events_url = serializers.CharField(help_text="The event stream's path with `?token=`, for `EventSource`.")


@extend_schema_serializer(component_name="PairedClient")
class PairedClientSchema(serializers.Serializer):
    object = serializers.ChoiceField(choices=["client"])
    name = serializers.CharField()
    scopes = serializers.ListField(child=serializers.ChoiceField(choices=SCOPES))
    token = serializers.CharField(help_text="The bearer token. Shown this once; only its hash is stored.")


def stream_event_schema() -> dict[str, Any]:
    """One event as the ``data:`` line of a frame carries it (and as the event log stores it)."""

    def ref(name: str) -> dict[str, str]:
        return {"$ref": f"#/components/schemas/{name}"}

    return {
        "type": "object",
        "description": "One event of a task's log: the JSON of an SSE frame's `data:` line.",
        "required": ["type", "sequence_number"],
        "properties": {
            "type": {"type": "string", "enum": list(EVENT_TYPES)},
            "sequence_number": {"type": "integer", "minimum": 0, "description": "0 for `response.created`, +1 each."},
            "response": {
                **ref("Response"),
                "description": "On `response.created`, `response.in_progress` and the terminal events.",
            },
            "item": ref("OutputMessage"),
            "item_id": {"type": "string"},
            "output_index": {"type": "integer"},
            "content_index": {"type": "integer"},
            "delta": {"type": "string", "description": "On `response.output_text.delta`: the next text."},
            "text": {"type": "string", "description": "On `response.output_text.done`: the whole text."},
            "part": ref("OutputText"),
        },
    }


# --- parameters and headers shared by several operations ---------------------------------------------

TASK_ID = OpenApiParameter("task_id", str, OpenApiParameter.PATH, description="`task_` + ULID.")
RESPONSE_ID = OpenApiParameter("response_id", str, OpenApiParameter.PATH, description="`resp_` + ULID.")
IDEMPOTENCY_KEY = OpenApiParameter(
    "Idempotency-Key",
    {"type": "string", "minLength": 1, "maxLength": MAX_KEY_LENGTH, "pattern": "^[ -~]+$"},
    OpenApiParameter.HEADER,
    description="1-255 printable ASCII characters, scoped to the client and the endpoint, kept 24 h by default. "
    "The same key with the same body answers the first reply again (with `Idempotent-Replayed: true`); "
    "with another body `422 idempotency_key_reused`; while the first is still being served "
    "`409 idempotency_key_in_use`.",
)
_CURSOR_RULES = (
    "Send only events with a greater `sequence_number`. A cursor at the terminal event of a finished task "
    "answers `204`; one past the newest event `400 invalid_request`; one before the oldest kept event "
    "`410 event_history_expired`."
)
LAST_EVENT_ID = OpenApiParameter(
    "Last-Event-ID",
    {"type": "integer", "minimum": 0, "maximum": 2**31 - 1},
    OpenApiParameter.HEADER,
    description="Resume cursor, as an `EventSource` sends it on reconnect; wins over `starting_after`. "
    + _CURSOR_RULES,
)
STARTING_AFTER = OpenApiParameter(
    "starting_after",
    {"type": "integer", "minimum": 0, "maximum": 2**31 - 1},
    OpenApiParameter.QUERY,
    description="Resume cursor, as the `openai` package sends it. " + _CURSOR_RULES,
)
LOCATION = OpenApiParameter(
    "Location", str, OpenApiParameter.HEADER, response=[202], description="Path of the new task."
)


def idempotent_replayed(*statuses: int) -> OpenApiParameter:
    """The response header that marks a replay, on these statuses."""
    return OpenApiParameter(
        "Idempotent-Replayed",
        {"type": "string", "enum": ["true"]},
        OpenApiParameter.HEADER,
        response=list(statuses),
        description="Present on a reply that repeats the first reply to this `Idempotency-Key`.",
    )


EVENT_STREAM = OpenApiResponse(
    {"type": "string"},
    description=(
        "Server-sent events, one frame per event: `id: <sequence_number>`, `event: <type>`, "
        "`data: <the event as JSON, see the StreamEvent schema>`, a blank line. Types in order: "
        + ", ".join(f"`{name}`" for name in EVENT_TYPES[: -len(TERMINAL_EVENT_TYPES)])
        + " (many deltas), then exactly one of "
        + ", ".join(f"`{name}`" for name in TERMINAL_EVENT_TYPES)
        + ", after which the server closes the stream. It opens with the comment `: stream opened` and "
        "sends `: keepalive` while idle. A `retry` policy's rerun appends a new `response.in_progress` "
        "with empty output: drop the text of earlier attempts when it comes."
    ),
    examples=[
        OpenApiExample(
            "frames",
            value=(
                ": stream opened\n\n"
                "id: 0\nevent: response.created\n"
                'data: {"type":"response.created","sequence_number":0,"response":{"id":"resp_…","status":"queued"}}\n\n'
                "id: 4\nevent: response.output_text.delta\n"
                'data: {"type":"response.output_text.delta","sequence_number":4,"item_id":"msg_…",'
                '"output_index":0,"content_index":0,"delta":"Hel"}\n\n'
            ),
            media_type=EVENT_STREAM_MEDIA_TYPE,
            status_codes=[200],
            response_only=True,
        )
    ],
)
STREAM_FINISHED = OpenApiResponse(
    description="The cursor is the task's terminal event: nothing is left to send, so an `EventSource` "
    "stops reconnecting."
)


def operation(*, problems: Sequence[type[exc.LmspError]] = (), **schema: Any) -> Callable[[F], F]:
    """``extend_schema`` for one handler, plus the problems it raises itself.

    The postprocessing hook adds the problems every operation shares and
    renders all of them (see the module docstring).
    """

    def decorate(handler: F) -> F:
        handler.lmsp_problems = tuple(problems)  # type: ignore[attr-defined]
        return extend_schema(**schema)(handler)

    return decorate


# --- stand-ins for the plain async views of streams.py (never routed) ------------------------------


class TaskEventsOperations(APIView):
    """``streams.task_events`` as the schema shows it."""

    scopes_by_method = {"GET": ("read",)}
    # Besides a bearer token: a stream token (``?token=``) or a staff session.
    stream_readers = True

    @operation(
        operation_id="tasks_events",
        summary="Stream a task's events (SSE)",
        description="Every event from `response.created` on, then live ones until the terminal event. "
        "A client that connects late gets what it missed first. Resume with `Last-Event-ID` or "
        "`starting_after`. Browsers, whose `EventSource` cannot send a header, use a stream token "
        "(`?token=`, see `POST /tasks/{task_id}/stream_token`) or a staff session of the admin.",
        parameters=[TASK_ID, LAST_EVENT_ID, STARTING_AFTER],
        request=None,
        responses={(200, EVENT_STREAM_MEDIA_TYPE): EVENT_STREAM, 204: STREAM_FINISHED},
        problems=[exc.InvalidRequest, exc.TaskNotFound, exc.EventHistoryExpired],
    )
    def get(self, request: Any, task_id: str) -> None:
        """Schema only."""


class ResponsesOperations(APIView):
    """``streams.responses_create`` (with ``views.ResponseCreateView``) as the schema shows it."""

    scopes_by_method = {"POST": ("responses",)}

    @operation(
        operation_id="responses_create",
        summary="Create a response: wait for it, or stream its events",
        description="The request becomes a task (policy `fail`, listed by `GET /tasks`). With `stream: false` "
        "the call waits until the task ends and answers the response object, whatever its status "
        "(`completed`, `incomplete`, `failed`, `cancelled`). With `stream: true` it answers the task's "
        "events as `GET /tasks/{task_id}/events` does. A retry with the same `Idempotency-Key` never runs "
        "a second generation: it answers the stored response again, or streams the same task's events "
        "again, from `Last-Event-ID` / `starting_after` when given.",
        parameters=[IDEMPOTENCY_KEY, LAST_EVENT_ID, STARTING_AFTER, idempotent_replayed(200, 204)],
        request=ResponseRequestSerializer,
        responses={
            (200, "application/json"): OpenApiResponse(ResponseSchema, description="`stream: false`."),
            (200, EVENT_STREAM_MEDIA_TYPE): EVENT_STREAM,
            204: OpenApiResponse(
                description="`stream: true`, retried with its key and a cursor at the terminal event: "
                "nothing is left to send."
            ),
        },
        problems=[
            exc.InvalidRequest,
            exc.ModelNotFound,
            exc.IdempotencyKeyInUse,
            exc.EventHistoryExpired,
            exc.IdempotencyKeyReused,
            exc.QueueFull,
        ],
    )
    def post(self, request: Any) -> None:
        """Schema only."""


class ResponseDetailOperations(APIView):
    """``streams.response_detail`` (with ``views.ResponseDetailView``) as the schema shows it."""

    scopes_by_method = {"GET": ("read",)}
    stream_readers = True

    @operation(
        operation_id="responses_retrieve",
        summary="Read a response, or (stream=true) stream its task's events",
        description="The stored response object; with `stream=true` the events of the task that produces "
        "it, resumable like `GET /tasks/{task_id}/events`. A stream token or a staff session is accepted "
        "only with `stream=true`.",
        parameters=[
            RESPONSE_ID,
            OpenApiParameter(
                "stream",
                {"type": "string", "enum": ["true", "false"]},
                default="false",
                description="`true`: the events instead of the object (anything but `true`/`false` is `400`).",
            ),
            LAST_EVENT_ID,
            STARTING_AFTER,
        ],
        request=None,
        responses={
            (200, "application/json"): OpenApiResponse(ResponseSchema, description="`stream=false`."),
            (200, EVENT_STREAM_MEDIA_TYPE): EVENT_STREAM,
            204: STREAM_FINISHED,
        },
        problems=[exc.InvalidRequest, exc.ResponseNotFound, exc.EventHistoryExpired],
    )
    def get(self, request: Any, response_id: str) -> None:
        """Schema only."""


@functools.cache
def _stand_ins() -> dict[Callable[..., Any], Callable[..., Any]]:
    # Imported here: streams imports views, which import this module.
    from tasks_app.api import streams

    return {
        streams.task_events: TaskEventsOperations.as_view(),
        streams.responses_create: ResponsesOperations.as_view(),
        streams.response_detail: ResponseDetailOperations.as_view(),
    }


def documented_view(callback: Callable[..., Any]) -> Callable[..., Any]:
    """The DRF view the schema documents for a URL pattern's callback."""
    return _stand_ins().get(callback, callback)


class LmspEndpointEnumerator(EndpointEnumerator):
    """The ``/lmsp/v1`` routes only (not the admin, not ``/metrics``), stand-ins included."""

    def should_include_endpoint(self, path: str, callback: Callable[..., Any]) -> bool:
        return path.startswith(API_PREFIX) and super().should_include_endpoint(path, documented_view(callback))

    def get_allowed_methods(self, callback: Callable[..., Any]) -> list[str]:
        return super().get_allowed_methods(documented_view(callback))


class LmspSchemaGenerator(SchemaGenerator):
    endpoint_inspector_cls = LmspEndpointEnumerator

    def create_view(self, callback: Callable[..., Any], method: str, request: Any = None) -> Any:
        return super().create_view(documented_view(callback), method, request)


class BearerTokenScheme(OpenApiAuthenticationExtension):
    target_class = "tasks_app.auth.BearerTokenAuthentication"
    name = BEARER

    def get_security_definition(self, auto_schema: Any) -> dict[str, Any]:
        return {
            "type": "http",
            "scheme": "bearer",
            "description": "A client's token (`lmsp_client create`, or `POST /pair`). Never in a URL.",
        }


# --- the postprocessing hook ------------------------------------------------------------------------

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


def _example_instance(path: str) -> str:
    return path.replace("{task_id}", EXAMPLE_TASK_ID).replace("{response_id}", EXAMPLE_RESPONSE_ID)


def _example(cls: type[exc.LmspError], path: str) -> dict[str, Any]:
    errors = [{"field": "input.model", "message": "This field is required."}] if cls is exc.InvalidRequest else None
    return {"summary": cls.title, "value": cls(errors=errors).to_problem(_example_instance(path))}


def problem_response(status: int, classes: Sequence[type[exc.LmspError]], path: str) -> dict[str, Any]:
    """One status's response: the Problem schema narrowed to this status and its codes, an example per code."""
    lines = [f"- `{cls.code}`: {_meaning(cls)}" for cls in classes]
    if status in _STATUS_NOTES:
        lines.append("\n" + _STATUS_NOTES[status])
    response: dict[str, Any] = {
        "description": "\n".join(lines),
        "content": {
            PROBLEM_MEDIA_TYPE: {
                "schema": {
                    "allOf": [
                        {"$ref": "#/components/schemas/Problem"},
                        {
                            "type": "object",
                            "properties": {
                                "status": {"type": "integer", "enum": [status]},
                                "code": {"type": "string", "enum": [cls.code for cls in classes]},
                            },
                        },
                    ]
                },
                "examples": {cls.code: _example(cls, path) for cls in classes},
            }
        },
    }
    if status in _STATUS_HEADERS:
        response["headers"] = _STATUS_HEADERS[status]
    return response


def operation_problems(
    *, handler_problems: Sequence[type[exc.LmspError]], method: str, public: bool, has_body: bool
) -> dict[int, list[type[exc.LmspError]]]:
    """Every problem one operation answers, by status."""
    shared: list[type[exc.LmspError]] = [exc.MethodNotAllowed, exc.InternalError]
    if not public:
        shared += [exc.Unauthorized, exc.InsufficientScope]
    if method == "POST":
        shared.append(exc.PayloadTooLarge)
    if has_body:
        # The strict JSON parser's refusals (malformed JSON, not an object) and a wrong Content-Type.
        shared += [exc.InvalidRequest, exc.UnsupportedMediaType]
    by_status: dict[int, list[type[exc.LmspError]]] = {}
    for cls in [*handler_problems, *shared]:
        codes = by_status.setdefault(cls.status, [])
        if cls not in codes:
            codes.append(cls)
    return dict(sorted(by_status.items()))


def _security(view_cls: type, method: str) -> tuple[list[dict[str, list[str]]], str]:
    scopes = view_cls.scopes_by_method[method]
    if scopes is None:
        return [], "**Auth:** public, no token."
    # OpenAPI 3.1 lets a non-OAuth requirement list the roles it needs: here the scopes.
    requirements = [{BEARER: list(scopes)}]
    named = ", ".join(f"`{scope}`" for scope in scopes)
    note = f"**Auth:** a bearer token with the scope {named} (or `admin`)." if scopes else "**Auth:** a bearer token."
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
    for path, method, view_cls in _endpoints(generator):
        op = result["paths"].get(path, {}).get(method.lower())
        if op is None:
            continue
        security, note = _security(view_cls, method)
        op["security"] = security
        op["description"] = f"{op.get('description', '').strip()}\n\n{note}".strip()
        handler = getattr(view_cls, method.lower())
        problems = operation_problems(
            handler_problems=getattr(handler, "lmsp_problems", ()),
            method=method,
            public=not security,
            has_body="requestBody" in op,
        )
        responses = dict(op["responses"])
        for status, classes in problems.items():
            responses[str(status)] = problem_response(status, classes, path)
            answered.update(cls.code for cls in classes)
        op["responses"] = dict(sorted(responses.items()))

    components = result.setdefault("components", {})
    components.setdefault("schemas", {})["StreamEvent"] = stream_event_schema()
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
    return _without_enum_ids(result)


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
        rows = "\n".join(f"| `{cls.code}` | {cls.status} | {cls.title} | {_meaning(cls)} |" for cls in classes)
        return f"| code | status | title | meaning |\n|---|---|---|---|\n{rows}"

    others = [code for code in by_code if code not in answered]
    return f"""LMSP 1.0 with durable tasks: a task is committed to the database before its `202`, and is
found in a defined state after any crash or restart.

**Auth.** `Authorization: Bearer <token>` on every operation except `GET /capabilities` and `POST /pair`.
Scopes: `responses` (create responses and tasks, cancel own tasks), `read` (read own tasks, responses,
events, models), `admin` (every scope, every client's tasks). Another client's task or response is `404`.

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
