"""What the service can do (PROFILE.md section 6)."""

from __future__ import annotations

from typing import Any

from django.conf import settings

from tasks_app.ids import new_ulid
from tasks_app.models import ServiceConfig, TaskType
from tasks_app.services.clients import SCOPES
from tasks_app.states import RestartPolicy

LMSP_VERSION = "1.0"
# This project's extensions beyond LMSP 1.0 (PROFILE.md section 9), for clients that look before they use.
EXTENSIONS = (
    "background_responses",
    "response_cancel",
    "response_delete",
    "queue_position",
    "webhooks",
    "models_retrieve",
    "sdk_errors",
    "chat_completions",
    "previous_response_id",
    "anthropic_messages",
    "ollama_api",
    "stop_sequence",
)
# The protocols this service speaks (PROFILE.md sections 10 and 11), each with the base URL its clients are
# given, relative to this host: the SDKs append their own paths (the OpenAI SDK ``/responses``, Anthropic's
# ``/v1/messages``, Ollama's clients ``/api/...``).
PROTOCOLS = {
    "lmsp": "/lmsp/v1",
    "openai": "/lmsp/v1",
    "anthropic": "/lmsp",
    "ollama": "",
}


def service_id_get() -> str:
    """This installation's stable id, created on first use."""
    row, _ = ServiceConfig.objects.get_or_create(key="service_id", defaults={"value": "svc_" + new_ulid()})
    return str(row.value)


def capabilities_describe() -> dict[str, Any]:
    return {
        "object": "capabilities",
        "lmsp_version": LMSP_VERSION,
        "service_id": service_id_get(),
        "event_resume": True,
        "task_types": list(TaskType.values),
        "on_restart": list(RestartPolicy.values),
        "idempotency": True,
        "pairing": True,
        "scopes": list(SCOPES),
        "max_request_bytes": settings.LMSP_MAX_REQUEST_BYTES,
        "extensions": list(EXTENSIONS),
        "protocols": dict(PROTOCOLS),
    }
