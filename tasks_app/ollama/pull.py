"""``POST /api/pull``: Ollama's pull, as the service's own (``tasks_app.registry.pull``, ``lmsp_models pull``).

Ollama pulls from its own library; this service pulls ONNX models from
Hugging Face. The name says the repository: ``hf.co/<owner>/<repo>[:<variant>]``
(Ollama's own spelling for a Hugging Face model) or ``<owner>/<repo>[:<variant>]``;
the variant is a graph's quantization (``model_q4.onnx``: ``q4``), none or
``latest`` the default ``model.onnx``. It is registered under the repository's
name (``<repo>`` or ``<repo>:<variant>``), as ``lmsp_models pull`` names it.

The pull runs in a thread of the web process, into the web's
``LMSP_MODELS_DIR`` (which must be the workers' folder, as for the command),
and its progress lines go out as Ollama's ``{"status": ...}`` lines, ending
``{"status": "success"}`` or one ``{"error": ...}`` line. A client that
leaves does not stop it: an interrupted download is resumed by the next pull.
Pulling writes files: it needs the ``admin`` scope.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Callable
from typing import Any

from asgiref.sync import sync_to_async
from django.db import connection
from django.http import HttpRequest, HttpResponse, JsonResponse, StreamingHttpResponse
from django.views.decorators.csrf import csrf_exempt
from rest_framework.request import Request
from rest_framework.response import Response

from tasks_app import exceptions as exc
from tasks_app.api.schema_annotations import operation
from tasks_app.edge.scoped_views import validated
from tasks_app.exceptions import InvalidRequest, ModelPullFailed
from tasks_app.ollama import schema
from tasks_app.ollama.serializers import PullRequestSerializer
from tasks_app.ollama.translate import line
from tasks_app.ollama.views import NDJSON, OllamaView

ADMIN = ("admin",)
_HUB_PREFIXES = ("https://", "http://", "hf.co/", "huggingface.co/")


def pull_target(name: str) -> tuple[str, str | None]:
    """(repository, variant) of an Ollama model name (module docstring)."""
    rest = name.strip()
    for prefix in _HUB_PREFIXES:
        rest = rest.removeprefix(prefix)
    repo, _, variant = rest.rpartition(":") if ":" in rest.rpartition("/")[2] else (rest, "", "")
    if repo.count("/") != 1 or not all(repo.split("/")):
        raise InvalidRequest(
            f"model {name!r}: a pull takes a Hugging Face repository, hf.co/<owner>/<repo>[:<variant>]",
            errors=[{"field": "model", "message": "hf.co/<owner>/<repo>[:<variant>]"}],
        )
    return repo, None if variant in ("", "latest") else variant


class PullView(OllamaView):
    """``POST /api/pull``'s synchronous half; the schema documents the async ``pull`` through it."""

    scopes_by_method = {"POST": ADMIN}

    @operation(
        operation_id="ollama_pull",
        tags=[schema.TAG],
        summary="Pull a model from Hugging Face (Ollama's pull)",
        description="The service's own pull (`lmsp_models pull`, docs/models.md) of an ONNX model: the name "
        "says the repository, `hf.co/<owner>/<repo>[:<variant>]` (or without `hf.co/`), the variant a graph's "
        "quantization; an Ollama library name is `400`. It runs in the web process; a client that leaves does "
        'not stop it. A pull that fails after it began is a stream\'s last `{"error"}` line, or (`stream: '
        "false`) `500` with the failure's text.",
        request={"application/json": schema.PULL_REQUEST},
        responses={(200, "application/json"): schema.PULL_ANSWER, (200, NDJSON): schema.PULL_STREAM},
        problems=[exc.InvalidRequest],
    )
    def post(self, request: Request) -> Response:
        data = validated(PullRequestSerializer, request.data)
        name = data.get("model") or data.get("name")
        if not name:
            raise InvalidRequest("a pull needs a model", errors=[{"field": "model", "message": "required"}])
        repo, variant = pull_target(name)
        answer = Response(status=202)
        answer.lmsp_pull = (repo, variant, data.get("stream") is not False)
        return answer


_pull_accept = PullView.as_view()


def _accepted(request: HttpRequest) -> HttpResponse:
    response = _pull_accept(request)
    response.render()
    return response


def _run_pull(repo: str, variant: str | None, echo: Callable[[str], None]) -> str:
    # huggingface_hub loads for a pull only (it reads HF_* variables at import).
    from tasks_app.registry.pull import model_pull

    try:
        return model_pull(repo=repo, variant=variant, echo=echo).name
    finally:
        # A thread of its own: its connection is closed here, not by a request's end.
        connection.close()


async def _lines(repo: str, variant: str | None) -> AsyncIterator[bytes]:
    loop = asyncio.get_running_loop()
    said: asyncio.Queue[dict[str, Any]] = asyncio.Queue()

    def say(status: str) -> None:
        loop.call_soon_threadsafe(said.put_nowait, {"status": status})

    def run() -> None:
        try:
            name = _run_pull(repo, variant, say)
        except ModelPullFailed as exc:
            end: dict[str, Any] = {"error": str(exc)}
        except Exception as exc:  # said to the client, as Ollama says a failed pull: one error line
            end = {"error": f"the pull failed: {exc}"}
        else:
            say(f"registered {name}")
            end = {"status": "success"}
        loop.call_soon_threadsafe(said.put_nowait, {**end, "end": True})

    yield line({"status": "pulling manifest"})
    threading.Thread(target=run, name="lmsp-ollama-pull", daemon=True).start()
    while True:
        item = await said.get()
        ended = item.pop("end", False)
        yield line(item)
        if ended:
            return


@csrf_exempt
async def pull(request: HttpRequest) -> HttpResponse:
    """``POST /api/pull``: progress lines, or (``stream: false``) one status when it ended."""
    response = await sync_to_async(_accepted)(request)
    target = getattr(response, "lmsp_pull", None)
    if target is None:
        return response
    repo, variant, stream = target
    if stream:
        return StreamingHttpResponse(_lines(repo, variant), content_type=NDJSON)
    try:
        await sync_to_async(_run_pull, thread_sensitive=False)(repo, variant, lambda status: None)
    except ModelPullFailed as exc:
        return JsonResponse({"error": str(exc)}, status=500)
    return JsonResponse({"status": "success"})
