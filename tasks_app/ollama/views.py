"""Ollama's native API (PROFILE.md 11.2) at ``/api/...``: thin views over the catalog and the generations.

A chat or generate request is validated and translated
(``tasks_app.ollama.translate``) and accepted as a task by a synchronous DRF
view; the async half streams the task's events as NDJSON lines (the SSE
transport with Ollama's ``StreamFormat``) or waits and answers one object.
``stream`` defaults to true, as Ollama's does. A client that goes away before
the end cancels the generation: an Ollama answer has no id to come back for.
"""

from __future__ import annotations

import json
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from typing import Any

from asgiref.sync import sync_to_async
from django.db import connection
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.views.decorators.csrf import csrf_exempt
from rest_framework.request import Request
from rest_framework.response import Response

from tasks_app import exceptions as exc
from tasks_app.api.schema_annotations import operation
from tasks_app.api.task_waits import task_end_wait, task_response_read
from tasks_app.edge.negotiation import JSONOnlyNegotiation
from tasks_app.edge.parsers import StrictJSONParser
from tasks_app.edge.problems import problem_json_response
from tasks_app.edge.scoped_views import READ, WRITE, ScopedAPIView, validated
from tasks_app.edge.sse import StreamSlot, event_stream, stream_slot_take
from tasks_app.exceptions import LmspError
from tasks_app.models import ModelRecord
from tasks_app.ollama import catalog, schema
from tasks_app.ollama.auth import OllamaAuthentication, ollama_client
from tasks_app.ollama.errors import OllamaModelNotFound
from tasks_app.ollama.serializers import ChatRequestSerializer, GenerateRequestSerializer, ModelNameSerializer
from tasks_app.ollama.service import ollama_generation_start, ollama_timings
from tasks_app.ollama.translate import (
    CHAT,
    GENERATE,
    OllamaLines,
    chat_spec,
    failure_text,
    final_object,
    generate_spec,
    is_load_only,
    line,
    now_iso,
    output_text,
)
from tasks_app.plumbing.dbpool import run_db, run_db_through_outages
from tasks_app.selectors import tasks as selectors
from tasks_app.services.responses import ResponseStarted
from tasks_app.services.tasks import task_abandon

NDJSON = "application/x-ndjson"
# keep_alive values that ask to unload the model (with nothing to generate): ``ollama stop`` sends 0.
_UNLOAD = (0, "0", "0s", "0m", "0h")


class AnyContentJSONParser(StrictJSONParser):
    """The strict JSON parser under any content type: Ollama's documented ``curl -d`` sends a form's."""

    media_type = "*/*"


class AnyContentNegotiation(JSONOnlyNegotiation):
    """The body is JSON whatever its ``Content-Type`` says (Ollama's server reads it so)."""

    def select_parser(self, request, parsers):
        return parsers[0]


class OllamaView(ScopedAPIView):
    """A route of ``/api/...``: the bearer token, or the anonymous client of a local request."""

    authentication_classes = [OllamaAuthentication]
    parser_classes = [AnyContentJSONParser]
    content_negotiation_class = AnyContentNegotiation
    # The schema (tasks_app/api/schema_generator.py): Ollama's components, its error shape for every problem,
    # no 415 (a body is JSON whatever its Content-Type says), and the anonymous rule beside the bearer.
    schema_components = schema.SCHEMA_COMPONENTS
    schema_error_content = staticmethod(schema.error_content)
    schema_any_content_type = True
    schema_auth_note = schema.ANONYMOUS_NOTE


def model_named(name: str | None) -> ModelRecord:
    """The registered model ``name``; Ollama's 404 ``model 'x' not found`` otherwise."""
    record = selectors.model_find_by_name(name or "")
    if record is None:
        raise OllamaModelNotFound(f"model {name!r} not found")
    return record


class VersionView(OllamaView):
    """``GET /api/version``: public, as Ollama's (a version says nothing about the models or tasks)."""

    scopes_by_method = {"GET": None}
    authentication_classes: list[type] = []

    @operation(
        operation_id="ollama_version",
        tags=[schema.TAG],
        summary="Ollama's version (Ollama's native API)",
        description="The Ollama release whose API the `/api/...` routes follow (docs/ollama.md); clients gate "
        "features on it. This service's own version is in `GET /lmsp/v1/capabilities`.",
        request=None,
        responses={200: schema.VERSION_ANSWER},
    )
    def get(self, request: Request) -> Response:
        return Response({"version": catalog.OLLAMA_VERSION})


class TagsView(OllamaView):
    scopes_by_method = {"GET": READ}

    @operation(
        operation_id="ollama_tags",
        tags=[schema.TAG],
        summary="List the models (Ollama's tags)",
        description="Every registered model, by name, in Ollama's shape.",
        request=None,
        responses={200: schema.TAGS_ANSWER},
    )
    def get(self, request: Request) -> Response:
        return Response(catalog.tags())


class ShowView(OllamaView):
    scopes_by_method = {"POST": READ}

    @operation(
        operation_id="ollama_show",
        tags=[schema.TAG],
        summary="Show a model (Ollama's show)",
        description="The model's details, its facts under Ollama's `model_info` keys, its chat template and "
        'what it can do. An unknown model (or none named) is `404 {"error": "model \'x\' not found"}`.',
        request={"application/json": schema.SHOW_REQUEST},
        responses={200: schema.SHOW_ANSWER},
        problems=[exc.InvalidRequest, OllamaModelNotFound],
    )
    def post(self, request: Request) -> Response:
        data = validated(ModelNameSerializer, request.data)
        return Response(catalog.show(model_named(data.get("model") or data.get("name"))))


class PsView(OllamaView):
    scopes_by_method = {"GET": READ}

    @operation(
        operation_id="ollama_ps",
        tags=[schema.TAG],
        summary="List the running models (Ollama's ps)",
        description="The models a worker holds loaded to run a task now (an idle loaded model is not known, "
        "so not listed).",
        request=None,
        responses={200: schema.PS_ANSWER},
    )
    def get(self, request: Request) -> Response:
        return Response(catalog.running())


class _GenerationView(OllamaView):
    """Validate, translate, accept; the async view serves what was started."""

    scopes_by_method = {"POST": WRITE}
    kind = CHAT

    def post(self, request: Request) -> Response:
        serializer, translate = (
            (ChatRequestSerializer, chat_spec) if self.kind == CHAT else (GenerateRequestSerializer, generate_spec)
        )
        data = validated(serializer, request.data)
        record = model_named(data["model"])
        spec = translate(data, context_length=catalog.context_length(record))
        if is_load_only(data, self.kind):
            # Ollama's load (or unload) request: the model is loaded by the worker that runs a task of it.
            reason = "unload" if data.get("keep_alive") in _UNLOAD else "load"
            body: dict[str, Any] = {"model": record.name, "created_at": now_iso()}
            body.update({"message": {"role": "assistant", "content": ""}} if self.kind == CHAT else {"response": ""})
            return Response({**body, "done": True, "done_reason": reason})
        started = ollama_generation_start(
            client=request.user,
            request=request.data,
            spec=spec,
            stream=data.get("stream") is not False,
            endpoint=self.kind,
        )
        answer = Response(status=202)
        answer.lmsp_ollama = (started, record.name)
        return answer


# What a chat or generate request can be answered besides its 200 (the async half's too).
_GENERATION_PROBLEMS = [
    exc.InvalidRequest,
    exc.UnsupportedParameter,
    OllamaModelNotFound,
    exc.ContextLengthExceeded,
    exc.ResponseCancelled,
    exc.QueueFull,
    exc.TooManyStreams,
    exc.DatabaseBusy,
    exc.BackendError,
    exc.ModelLoadFailed,
    exc.ServerRestarted,
]
_GENERATION_DESCRIPTION = (
    "Extension (PROFILE.md 11.2, for Ollama's clients): the request runs as a response task on the same workers "
    "(listed by `GET /lmsp/v1/tasks`). `stream` defaults to true: NDJSON lines; `stream: false` waits and "
    'answers one object, or the failure\'s `{"error"}` with its status (`409` for a cancelled generation). '
    "A client that leaves before the end cancels the generation. A request with nothing to generate is "
    "Ollama's load (or, with `keep_alive: 0`, unload) request, answered at once. `format`, `options.stop` and "
    "`options.num_predict` are enforced; what asks for what this service lacks is `400` naming the field. "
    'Every error is Ollama\'s `{"error": "..."}` as `application/json`.'
)


class ChatView(_GenerationView):
    """``POST /api/chat``'s synchronous half; the schema documents the async ``chat`` through it."""

    kind = CHAT

    @operation(
        operation_id="ollama_chat",
        tags=[schema.TAG],
        summary="Chat (Ollama's chat)",
        description=_GENERATION_DESCRIPTION,
        request={"application/json": schema.CHAT_REQUEST},
        responses={(200, "application/json"): schema.CHAT_ANSWER, (200, NDJSON): schema.CHAT_STREAM},
        problems=_GENERATION_PROBLEMS,
    )
    def post(self, request: Request) -> Response:
        return super().post(request)


class GenerateView(_GenerationView):
    """``POST /api/generate``'s synchronous half; the schema documents the async ``generate`` through it."""

    kind = GENERATE

    @operation(
        operation_id="ollama_generate",
        tags=[schema.TAG],
        summary="Generate from a prompt (Ollama's generate)",
        description=_GENERATION_DESCRIPTION,
        request={"application/json": schema.GENERATE_REQUEST},
        responses={(200, "application/json"): schema.GENERATE_ANSWER, (200, NDJSON): schema.GENERATE_STREAM},
        problems=_GENERATION_PROBLEMS,
    )
    def post(self, request: Request) -> Response:
        return super().post(request)


_chat_accept = ChatView.as_view()
_generate_accept = GenerateView.as_view()


def _accepted(view: Callable[[HttpRequest], HttpResponse], request: HttpRequest) -> HttpResponse:
    response = view(request)
    response.render()
    if getattr(response, "lmsp_ollama", None) is not None and not connection.in_atomic_block:
        # The wait or stream reads through the pool: the request's own connection goes back now.
        connection.close()
    return response


def _stream_holder(request: HttpRequest) -> str | None:
    try:
        client = ollama_client(request)
    except LmspError:
        return None  # the view answers the 401
    return None if client is None else f"client:{client.pk}"


async def _stream_slot(request: HttpRequest) -> StreamSlot | None:
    """The slot a streaming request takes before its task exists (``stream`` is true unless it says false)."""
    try:
        body = json.loads(request.body or b"{}")
    except ValueError:
        return None
    if not isinstance(body, dict) or body.get("stream") is False:
        return None
    holder = await run_db(_stream_holder, request)
    return stream_slot_take(request, holder) if holder is not None else None


async def _serve(request: HttpRequest, view: Callable[[HttpRequest], HttpResponse], kind: str) -> HttpResponse:
    try:
        slot = await _stream_slot(request)
    except LmspError as error:
        return problem_json_response(error, request)
    response = await sync_to_async(_accepted)(view, request)
    accepted = getattr(response, "lmsp_ollama", None)
    if accepted is None:
        if slot is not None:
            slot.release()
        return response
    started, model = accepted
    if started.stream:
        if slot is None:
            slot = stream_slot_take(request, f"task:{started.task_id}")
        stream_format = OllamaStreamFormat(kind, model, started.task_id)
        answer = event_stream(request, started.task_id, -1, slot, stream_format=stream_format)
        answer["Content-Type"] = NDJSON
        return answer
    if slot is not None:
        slot.release()
    return await _wait(started, kind, model)


@csrf_exempt
async def chat(request: HttpRequest) -> HttpResponse:
    """``POST /api/chat``."""
    return await _serve(request, _chat_accept, CHAT)


@csrf_exempt
async def generate(request: HttpRequest) -> HttpResponse:
    """``POST /api/generate``."""
    return await _serve(request, _generate_accept, GENERATE)


class OllamaStreamFormat:
    """An Ollama stream, for the SSE transport (``sse.StreamFormat``): the task's events as NDJSON lines."""

    def __init__(self, kind: str, model: str, task_id: str) -> None:
        self.lines = OllamaLines(kind, model)
        self.task_id = task_id
        self._done = False

    @property
    def finished(self) -> bool:
        return self._done

    async def encode(self, events: AsyncIterator[bytes]) -> AsyncGenerator[bytes, None]:
        async for data in events:
            out = self.lines.feed(data)
            if out:
                yield out
            if self.lines.ended is not None:
                self._done = True
                timings = await run_db_through_outages(ollama_timings, task_id=self.task_id)
                yield self.lines.end(timings)
                return
        # The log ended early (its events were deleted under it): said in the stream's own words.
        yield line({"error": "the task's events ended before its end"})

    def abandon(self, task_id: str) -> None:
        task_abandon(task_id=task_id)


def _finished(task_id: str) -> tuple[dict[str, Any], dict[str, int]]:
    return task_response_read(task_id), ollama_timings(task_id=task_id)


async def _wait(started: ResponseStarted, kind: str, model: str) -> HttpResponse:
    await task_end_wait(started.task_id)
    body, timings = await run_db_through_outages(_finished, started.task_id)
    failure = failure_text(body)
    if failure is not None:
        status = int((body.get("error") or {}).get("status") or 500) if body.get("error") else 409
        return JsonResponse({"error": failure}, status=status)
    answer = final_object(kind, body, timings, model=model, text=output_text(body))
    return JsonResponse(answer, json_dumps_params={"ensure_ascii": False})
