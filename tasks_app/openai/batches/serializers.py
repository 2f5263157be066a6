"""Input and output serializers of the batches (docs/batches.md), in the openai package's shapes.

Inputs refuse unknown fields by name (``output_expires_after`` among them:
output files are kept until deleted); outputs only render. The schema-only
components (what spectacular documents) are at the end.
"""

from __future__ import annotations

import re
from typing import Any

from drf_spectacular.utils import extend_schema_serializer
from rest_framework import serializers

from tasks_app.api.pagination import ListQuerySerializer
from tasks_app.api.schema_components import UsageSchema, _PageSchema
from tasks_app.core.wire import unix_seconds, usage_object
from tasks_app.edge.strict_json import StrictCharField, StrictChoiceField, StrictSerializer
from tasks_app.ids import BATCH_PREFIX
from tasks_app.models import Batch, BatchStatus
from tasks_app.openai.batches.lines import ENDPOINTS
from tasks_app.openai.responses.serializers import MetadataField
from tasks_app.services.batches import COMPLETION_WINDOWS

BATCH_ID_PATTERN = rf"^{BATCH_PREFIX}[0-7][0-9A-HJKMNP-TV-Z]{{25}}$"
BATCH_AFTER_SCHEMA = {"type": "string", "pattern": BATCH_ID_PATTERN}


class BatchCreateInputSerializer(StrictSerializer):
    input_file_id = StrictCharField(
        min_length=1, max_length=64, help_text="A file of this client uploaded with `purpose: batch` (JSONL)."
    )
    endpoint = StrictChoiceField(
        choices=list(ENDPOINTS), help_text="What every line runs: Responses or Chat Completions."
    )
    completion_window = StrictChoiceField(
        choices=list(COMPLETION_WINDOWS), help_text="The lines not finished by then are cancelled (`expired`)."
    )
    metadata = MetadataField(required=False, allow_null=True)


class BatchListQuerySerializer(ListQuerySerializer):
    def validate_after(self, value: str) -> str:
        if not re.fullmatch(BATCH_ID_PATTERN, value):
            raise serializers.ValidationError("must be a batch id")
        return value


def _seconds(value: Any) -> int | None:
    return unix_seconds(value) if value is not None else None


def batch_object(batch: Batch) -> dict[str, Any]:
    """OpenAI's batch object: one row, its counts included."""
    return {
        "id": batch.id,
        "object": "batch",
        "endpoint": batch.endpoint,
        "model": batch.model or None,
        "errors": batch.errors,
        "input_file_id": batch.input_file_id,
        "completion_window": batch.completion_window,
        "status": batch.status,
        "output_file_id": batch.output_file_id or None,
        "error_file_id": batch.error_file_id or None,
        "created_at": unix_seconds(batch.created_at),
        "in_progress_at": _seconds(batch.in_progress_at),
        "expires_at": unix_seconds(batch.expires_at),
        "finalizing_at": _seconds(batch.finalizing_at),
        "completed_at": _seconds(batch.completed_at),
        "failed_at": _seconds(batch.failed_at),
        "expired_at": _seconds(batch.expired_at),
        "cancelling_at": _seconds(batch.cancelling_at),
        "cancelled_at": _seconds(batch.cancelled_at),
        "request_counts": {"total": batch.total, "completed": batch.completed, "failed": batch.failed},
        "usage": usage_object(batch.input_tokens, batch.output_tokens, cached_tokens=batch.cached_tokens),
        "metadata": batch.metadata or None,
    }


class BatchOutputSerializer(serializers.BaseSerializer):
    def to_representation(self, instance: Any) -> dict[str, Any]:
        return batch_object(instance)


# --------------------------------------------------------------------------- #
# Schema-only components
# --------------------------------------------------------------------------- #


@extend_schema_serializer(component_name="BatchError")
class BatchErrorSchema(serializers.Serializer):
    code = serializers.CharField()
    message = serializers.CharField()
    param = serializers.CharField(allow_null=True)
    line = serializers.IntegerField(allow_null=True, help_text="The input file's line (1 for the first).")


@extend_schema_serializer(component_name="BatchErrors")
class BatchErrorsSchema(serializers.Serializer):
    object = serializers.ChoiceField(choices=["list"])
    data = BatchErrorSchema(many=True)


@extend_schema_serializer(component_name="BatchRequestCounts")
class BatchRequestCountsSchema(serializers.Serializer):
    total = serializers.IntegerField()
    completed = serializers.IntegerField(help_text="Lines in the output file.")
    failed = serializers.IntegerField(help_text="Lines in the error file (refused, failed, cancelled, expired).")


@extend_schema_serializer(component_name="Batch")
class BatchSchema(serializers.Serializer):
    id = serializers.CharField(help_text="`batch_` + ULID.")
    object = serializers.ChoiceField(choices=["batch"])
    endpoint = serializers.ChoiceField(choices=list(ENDPOINTS))
    model = serializers.CharField(allow_null=True, help_text="The model of every line, when they name one.")
    errors = BatchErrorsSchema(allow_null=True, help_text="Why the input file did not validate.")
    input_file_id = serializers.CharField()
    completion_window = serializers.ChoiceField(choices=list(COMPLETION_WINDOWS))
    status = serializers.ChoiceField(choices=BatchStatus.values)
    output_file_id = serializers.CharField(allow_null=True)
    error_file_id = serializers.CharField(allow_null=True)
    created_at = serializers.IntegerField(help_text="Unix seconds, as every time below.")
    in_progress_at = serializers.IntegerField(allow_null=True)
    expires_at = serializers.IntegerField()
    finalizing_at = serializers.IntegerField(allow_null=True)
    completed_at = serializers.IntegerField(allow_null=True)
    failed_at = serializers.IntegerField(allow_null=True)
    expired_at = serializers.IntegerField(allow_null=True)
    cancelling_at = serializers.IntegerField(allow_null=True)
    cancelled_at = serializers.IntegerField(allow_null=True)
    request_counts = BatchRequestCountsSchema()
    usage = UsageSchema(help_text="The tokens of every line that ran, grown as each line ends.")
    metadata = serializers.DictField(child=serializers.CharField(), allow_null=True)


@extend_schema_serializer(component_name="BatchList")
class BatchListSchema(_PageSchema):
    data = BatchSchema(many=True)
