"""The output serializer of ``/models``."""

from __future__ import annotations

from typing import Any

from rest_framework import serializers

from tasks_app.api.pagination import MAX_AFTER

# The ``after`` query parameter's schema: a plain string would say less than the server checks.
MODEL_AFTER_SCHEMA = {"type": "string", "minLength": 1, "maxLength": MAX_AFTER}


class ModelOutputSerializer(serializers.BaseSerializer):
    def to_representation(self, instance: Any) -> dict[str, Any]:
        return {
            "id": instance.name,
            "object": "model",
            "created": int(instance.created_at.timestamp()),
            "owned_by": "local",
            "backend": instance.backend,
            "digest": instance.digest,
            "size_bytes": instance.size_bytes,
            "capabilities": instance.capabilities,
            "context_length": instance.config.get("max_position_embeddings"),
            "layout": instance.layout,
        }
