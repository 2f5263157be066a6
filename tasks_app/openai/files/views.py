"""Thin views of the files (docs/batches.md): the shapes of the openai package's ``files``.

``client.files.create/list/retrieve/delete/content`` with
``base_url=<server>/lmsp/v1`` call these. Files are the client's own:
another client's id is ``404 file_not_found``.
"""

from __future__ import annotations

from django.http import FileResponse
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiParameter, OpenApiResponse
from rest_framework.parsers import MultiPartParser
from rest_framework.request import Request
from rest_framework.response import Response

from tasks_app import exceptions as exc
from tasks_app.api.pagination import list_body
from tasks_app.api.schema_annotations import operation
from tasks_app.edge.scoped_views import READ, WRITE, ScopedAPIView, validated
from tasks_app.models import FilePurpose
from tasks_app.openai.files.serializers import (
    FILE_AFTER_SCHEMA,
    FileCreateInputSerializer,
    FileDeletedSchema,
    FileListQuerySerializer,
    FileListSchema,
    FileOutputSerializer,
    FileSchema,
    FileUploadSchema,
    file_deleted,
)
from tasks_app.openai.files.uploads import StagedFile, StagingUploadHandler
from tasks_app.selectors.files import file_get_own, file_list_own
from tasks_app.services.files import file_create, file_delete, file_path

FILE_ID = OpenApiParameter("file_id", str, OpenApiParameter.PATH, description="`file-` + ULID.")
MULTIPART = "multipart/form-data"


class FileCollectionView(ScopedAPIView):
    scopes_by_method = {"GET": READ, "POST": WRITE}
    parser_classes = [MultiPartParser]

    @operation(
        operation_id="files_create",
        summary="Upload a file",
        description="A multipart form with `file` and `purpose` (`batch`). The bytes are streamed to disk, with "
        "their SHA-256, never held in memory or stored in the database; at most LMSP_MAX_FILE_BYTES "
        "(200 MiB by default). docs/batches.md.",
        request={MULTIPART: FileUploadSchema},
        responses={200: OpenApiResponse(FileSchema, description="Stored.")},
        problems=[exc.InvalidRequest, exc.PayloadTooLarge, exc.UnsupportedMediaType, exc.DatabaseBusy],
    )
    def post(self, request: Request) -> Response:
        if (request.content_type or "").split(";")[0].strip().lower() != MULTIPART:
            raise exc.UnsupportedMediaType("POST /files takes multipart/form-data (a file and its purpose)")
        handler = StagingUploadHandler(request._request)
        request._request.upload_handlers = [handler]
        try:
            upload = request.FILES.get("file")
            if not isinstance(upload, StagedFile):
                message = "required, as a part with a filename (the file's bytes)"
                raise exc.InvalidRequest(f"file: {message}", errors=[{"field": "file", "message": message}])
            if len(request.FILES) > 1:
                extra = next(name for name in request.FILES if name != "file")
                raise exc.InvalidRequest(
                    f"{extra}: unknown field", errors=[{"field": extra, "message": "unknown field"}]
                )
            data = validated(FileCreateInputSerializer, {k: v for k, v in request.data.items() if k != "file"})
            file = file_create(
                client=request.user,
                filename=upload.name,
                purpose=FilePurpose(data["purpose"]),
                staged=upload.path,
                size=upload.size,
                sha256=upload.sha256,
            )
        finally:
            handler.discard()
        return Response(FileOutputSerializer(file).data)

    @operation(
        operation_id="files_list",
        summary="List the client's files",
        description="Newest first (`order=desc`, the default) or oldest first. Unknown query parameters are refused.",
        parameters=[
            FileListQuerySerializer,
            OpenApiParameter("after", FILE_AFTER_SCHEMA, description="A file id: the page after it."),
        ],
        request=None,
        responses={200: FileListSchema},
        problems=[exc.InvalidRequest],
    )
    def get(self, request: Request) -> Response:
        query = validated(FileListQuerySerializer, request.query_params.dict())
        page = file_list_own(
            client=request.user,
            after=query.get("after"),
            limit=query["limit"],
            order=query["order"],
            purpose=query.get("purpose"),
        )
        return Response(list_body(FileOutputSerializer(page.items, many=True).data, page.has_more))


class FileDetailView(ScopedAPIView):
    scopes_by_method = {"GET": READ, "DELETE": WRITE}

    @operation(
        operation_id="files_retrieve",
        summary="Read a file's description",
        parameters=[FILE_ID],
        request=None,
        responses={200: FileSchema},
        problems=[exc.FileNotFound],
    )
    def get(self, request: Request, file_id: str) -> Response:
        return Response(FileOutputSerializer(file_get_own(client=request.user, file_id=file_id)).data)

    @operation(
        operation_id="files_delete",
        summary="Delete a file",
        description="Its row and its bytes. The input file of a batch that has not ended is `409 file_in_use`.",
        parameters=[FILE_ID],
        request=None,
        responses={200: FileDeletedSchema},
        problems=[exc.FileNotFound, exc.FileInUse, exc.DatabaseBusy],
    )
    def delete(self, request: Request, file_id: str) -> Response:
        file_delete(file=file_get_own(client=request.user, file_id=file_id))
        return Response(file_deleted(file_id))


class FileContentView(ScopedAPIView):
    scopes_by_method = {"GET": READ}

    @operation(
        operation_id="files_content",
        summary="Read a file's bytes",
        description="Streamed from disk as they were uploaded (or, for a batch's output, written).",
        parameters=[FILE_ID],
        request=None,
        responses={(200, "application/octet-stream"): OpenApiResponse(OpenApiTypes.BINARY, description="The bytes.")},
        problems=[exc.FileNotFound],
    )
    def get(self, request: Request, file_id: str) -> FileResponse:
        file = file_get_own(client=request.user, file_id=file_id)
        try:
            handle = file_path(file).open("rb")
        except FileNotFoundError:
            raise exc.FileNotFound(f"file {file_id} has no bytes on disk any more") from None
        return FileResponse(handle, content_type="application/octet-stream", filename=file.filename)
