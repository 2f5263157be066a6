"""Input and output serializers of the files (docs/batches.md), in the openai package's shapes.

Inputs refuse unknown fields by name; outputs only render. The schema-only
components (what spectacular documents) are at the end.
"""

from __future__ import annotations

import re
from typing import Any

from drf_spectacular.utils import extend_schema_serializer
from rest_framework import serializers

from tasks_app.api.pagination import ListQuerySerializer
from tasks_app.api.schema_components import _PageSchema
from tasks_app.core.wire import unix_seconds
from tasks_app.edge.strict_json import StrictChoiceField, StrictSerializer
from tasks_app.ids import FILE_PREFIX
from tasks_app.models import File, FilePurpose

FILE_ID_PATTERN = rf"^{FILE_PREFIX}[0-7][0-9A-HJKMNP-TV-Z]{{25}}$"
FILE_AFTER_SCHEMA = {"type": "string", "pattern": FILE_ID_PATTERN}
# What a client may upload: a batch's input (the only purpose this service reads).
UPLOAD_PURPOSES = [FilePurpose.BATCH.value]


class FileCreateInputSerializer(StrictSerializer):
    """The form's fields besides the file. Unknown fields (``expires_after``) are refused by name."""

    purpose = StrictChoiceField(
        choices=UPLOAD_PURPOSES, help_text="`batch`: the input of a batch (the only purpose this service reads)."
    )


class FileListQuerySerializer(ListQuerySerializer):
    order = StrictChoiceField(choices=["asc", "desc"], required=False, default="desc")
    purpose = StrictChoiceField(choices=FilePurpose.values, required=False)

    def validate_after(self, value: str) -> str:
        if not re.fullmatch(FILE_ID_PATTERN, value):
            raise serializers.ValidationError("must be a file id")
        return value


def file_object(file: File) -> dict[str, Any]:
    return {
        "id": file.id,
        "object": "file",
        "bytes": file.bytes,
        "created_at": unix_seconds(file.created_at),
        "expires_at": unix_seconds(file.expires_at) if file.expires_at else None,
        "filename": file.filename,
        "purpose": file.purpose,
        "status": "processed",
        "status_details": None,
        "sha256": file.sha256,
    }


class FileOutputSerializer(serializers.BaseSerializer):
    def to_representation(self, instance: Any) -> dict[str, Any]:
        return file_object(instance)


def file_deleted(file_id: str) -> dict[str, Any]:
    return {"id": file_id, "object": "file", "deleted": True}


# --------------------------------------------------------------------------- #
# Schema-only components
# --------------------------------------------------------------------------- #


@extend_schema_serializer(component_name="FileUpload")
class FileUploadSchema(serializers.Serializer):
    file = serializers.FileField(help_text="The file's bytes (JSONL for a batch), at most LMSP_MAX_FILE_BYTES.")
    purpose = serializers.ChoiceField(choices=UPLOAD_PURPOSES)


@extend_schema_serializer(component_name="File")
class FileSchema(serializers.Serializer):
    id = serializers.CharField(help_text="`file-` + ULID.")
    object = serializers.ChoiceField(choices=["file"])
    bytes = serializers.IntegerField()
    created_at = serializers.IntegerField(help_text="Unix seconds.")
    expires_at = serializers.IntegerField(allow_null=True)
    filename = serializers.CharField()
    purpose = serializers.ChoiceField(choices=FilePurpose.values)
    status = serializers.ChoiceField(choices=["processed"], help_text="Deprecated by OpenAI; always `processed`.")
    status_details = serializers.CharField(allow_null=True)
    sha256 = serializers.CharField(help_text="Extension: the SHA-256 of the bytes, hex.")


@extend_schema_serializer(component_name="FileList")
class FileListSchema(_PageSchema):
    data = FileSchema(many=True)


@extend_schema_serializer(component_name="FileDeleted")
class FileDeletedSchema(serializers.Serializer):
    id = serializers.CharField()
    object = serializers.ChoiceField(choices=["file"])
    deleted = serializers.BooleanField()
