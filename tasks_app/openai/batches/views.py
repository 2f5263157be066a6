"""Thin views of the batches (docs/batches.md): the shapes of the openai package's ``batches``.

``client.batches.create/retrieve/list/cancel`` with ``base_url=<server>/lmsp/v1``
call these. Batches are the client's own: another client's id is
``404 batch_not_found``.
"""

from __future__ import annotations

from django.conf import settings
from drf_spectacular.utils import OpenApiParameter, OpenApiResponse
from rest_framework.request import Request
from rest_framework.response import Response

from tasks_app import exceptions as exc
from tasks_app.api.pagination import list_body
from tasks_app.api.schema_annotations import operation
from tasks_app.edge.scoped_views import READ, WRITE, ScopedAPIView, validated
from tasks_app.models import FilePurpose
from tasks_app.openai.batches.lines import batch_file_read
from tasks_app.openai.batches.serializers import (
    BATCH_AFTER_SCHEMA,
    BatchCreateInputSerializer,
    BatchListQuerySerializer,
    BatchListSchema,
    BatchOutputSerializer,
    BatchSchema,
)
from tasks_app.selectors.batches import batch_get_own, batch_list_own
from tasks_app.selectors.files import file_get_own
from tasks_app.services.batches import batch_cancel, batch_create
from tasks_app.services.files import file_path

BATCH_ID = OpenApiParameter("batch_id", str, OpenApiParameter.PATH, description="`batch_` + ULID.")


def _input_file(request: Request, file_id: str):
    try:
        file = file_get_own(client=request.user, file_id=file_id)
    except exc.FileNotFound:
        # As a previous_response_id that names nothing: 404, naming the field.
        message = f"no file {file_id!r} of this client"
        raise exc.FileNotFound(
            f"input_file_id: {message}", errors=[{"field": "input_file_id", "message": message}]
        ) from None
    if file.purpose != FilePurpose.BATCH:
        message = f"file {file_id} was not uploaded with purpose 'batch'"
        raise exc.InvalidRequest(f"input_file_id: {message}", errors=[{"field": "input_file_id", "message": message}])
    return file


class BatchCollectionView(ScopedAPIView):
    scopes_by_method = {"GET": READ, "POST": WRITE}

    @operation(
        operation_id="batches_create",
        summary="Create a batch from an uploaded file",
        description="The file is validated at once: a bad line (not JSON, no or a repeated `custom_id`, another "
        "`url` than `endpoint`) fails the batch (`failed`, `errors` names the lines); a line whose request is "
        "refused is a failed line of the error file. The rest run as durable tasks in the workers' free rows, "
        "one row of each worker kept for interactive requests (or LMSP_BATCH_ACTIVE_LINES at a time). "
        "docs/batches.md.",
        request=BatchCreateInputSerializer,
        responses={200: OpenApiResponse(BatchSchema, description="`in_progress`, or `failed` validation.")},
        problems=[exc.InvalidRequest, exc.FileNotFound, exc.DatabaseBusy],
    )
    def post(self, request: Request) -> Response:
        data = validated(BatchCreateInputSerializer, request.data)
        file = _input_file(request, data["input_file_id"])
        try:
            read = batch_file_read(
                path=file_path(file), endpoint=data["endpoint"], max_lines=settings.LMSP_BATCH_MAX_LINES
            )
        except FileNotFoundError:
            raise exc.InvalidRequest(
                "input_file_id: the file has no bytes on disk any more",
                errors=[{"field": "input_file_id", "message": "the file's bytes are gone"}],
            ) from None
        batch = batch_create(
            client=request.user,
            input_file=file,
            endpoint=data["endpoint"],
            completion_window=data["completion_window"],
            metadata=data.get("metadata") or {},
            lines=read.lines,
            errors=read.errors,
        )
        return Response(BatchOutputSerializer(batch).data)

    @operation(
        operation_id="batches_list",
        summary="List the client's batches, newest first",
        description="Unknown query parameters are refused.",
        parameters=[
            BatchListQuerySerializer,
            OpenApiParameter("after", BATCH_AFTER_SCHEMA, description="A batch id: the page after it."),
        ],
        request=None,
        responses={200: BatchListSchema},
        problems=[exc.InvalidRequest],
    )
    def get(self, request: Request) -> Response:
        query = validated(BatchListQuerySerializer, request.query_params.dict())
        page = batch_list_own(client=request.user, after=query.get("after"), limit=query["limit"])
        return Response(list_body(BatchOutputSerializer(page.items, many=True).data, page.has_more))


class BatchDetailView(ScopedAPIView):
    scopes_by_method = {"GET": READ}

    @operation(
        operation_id="batches_retrieve",
        summary="Read a batch and its progress",
        parameters=[BATCH_ID],
        request=None,
        responses={200: BatchSchema},
        problems=[exc.BatchNotFound],
    )
    def get(self, request: Request, batch_id: str) -> Response:
        return Response(BatchOutputSerializer(batch_get_own(client=request.user, batch_id=batch_id)).data)


class BatchCancelView(ScopedAPIView):
    scopes_by_method = {"POST": WRITE}

    @operation(
        operation_id="batches_cancel",
        summary="Cancel a batch",
        description="`cancelling` at once: the lines not started are cancelled, the running ones finish, then "
        "`cancelled` with what finished in the output file. An ended batch is `409 batch_not_cancelable`.",
        parameters=[BATCH_ID],
        request=None,
        responses={200: BatchSchema},
        problems=[exc.BatchNotFound, exc.BatchNotCancelable, exc.DatabaseBusy],
    )
    def post(self, request: Request, batch_id: str) -> Response:
        batch = batch_cancel(batch=batch_get_own(client=request.user, batch_id=batch_id))
        return Response(BatchOutputSerializer(batch).data)
