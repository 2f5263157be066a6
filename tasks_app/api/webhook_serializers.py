"""Input and output serializers of the webhook endpoints (docs/webhooks.md), in the openai package's shapes.

As in ``serializers.py``: inputs check shape and JSON types strictly and
refuse unknown fields by name; outputs only render. The schema-only
components (what spectacular documents) are at the end.
"""

from __future__ import annotations

import re
from typing import Any

from drf_spectacular.utils import extend_schema_field, extend_schema_serializer
from rest_framework import serializers

from tasks_app.api.pagination import ListQuerySerializer
from tasks_app.api.schema_components import _PageSchema
from tasks_app.core.wire import unix_seconds
from tasks_app.edge.strict_json import StrictBooleanField, StrictCharField, StrictChoiceField, StrictSerializer
from tasks_app.ids import WEBHOOK_ENDPOINT_PREFIX
from tasks_app.models import WebhookEndpoint
from tasks_app.plumbing.webhook_http import signing_secret_hint
from tasks_app.services.webhooks import EVENT_TYPES

MAX_NAME = 200
MAX_URL = 2048
WEBHOOK_ENDPOINT_ID_PATTERN = rf"^{WEBHOOK_ENDPOINT_PREFIX}[0-7][0-9A-HJKMNP-TV-Z]{{25}}$"
WEBHOOK_ENDPOINT_AFTER_SCHEMA = {"type": "string", "pattern": WEBHOOK_ENDPOINT_ID_PATTERN}
_URL_HELP = (
    "An absolute `http` or `https` URL with a host and no credentials. A host that resolves to a private, "
    "loopback, link-local, multicast, reserved or unspecified address is refused (unless the service allows "
    "private targets), here and again at each delivery."
)


@extend_schema_field(
    {
        "type": "array",
        "minItems": 1,
        "maxItems": len(EVENT_TYPES),
        "uniqueItems": True,
        "items": {"type": "string", "enum": list(EVENT_TYPES)},
        "description": "The event types delivered to the endpoint, each once.",
    }
)
class EventTypesField(serializers.ListField):
    def __init__(self, **kwargs: Any) -> None:
        super().__init__(child=StrictChoiceField(choices=EVENT_TYPES), min_length=1, **kwargs)


# The URL's shape as the schema can state it; the rest of the target rule (the addresses) is the service's.
_URL_PATTERN = r"^https?://[^\s\u0000-\u001f/?#@]+(?:[/?#][^\s\u0000-\u001f]*)?$"


@extend_schema_field({"type": "string", "minLength": 1, "maxLength": MAX_URL, "pattern": _URL_PATTERN})
class WebhookUrlField(StrictCharField):
    def __init__(self, **kwargs: Any) -> None:
        super().__init__(min_length=1, max_length=MAX_URL, trim_whitespace=False, help_text=_URL_HELP, **kwargs)


class WebhookEndpointCreateInputSerializer(StrictSerializer):
    """A new endpoint: its name, its URL and the event types it gets. Unknown fields are refused by name."""

    name = StrictCharField(min_length=1, max_length=MAX_NAME, trim_whitespace=False)
    url = WebhookUrlField()
    event_types = EventTypesField()


class WebhookEndpointUpdateInputSerializer(StrictSerializer):
    """What is sent changes; what is left out stays."""

    name = StrictCharField(required=False, min_length=1, max_length=MAX_NAME, trim_whitespace=False)
    url = WebhookUrlField(required=False)
    event_types = EventTypesField(required=False, help_text="The complete set of event types to deliver.")


class WebhookSecretRotateInputSerializer(StrictSerializer):
    """How to rotate; an empty object rotates at once."""

    keep_old_secret_active_for_24_hours = StrictBooleanField(
        required=False,
        default=False,
        help_text="Whether deliveries are also signed with the previous secret for 24 hours "
        "(a second `v1,` signature). Default: the previous secret stops at once.",
    )


class WebhookEndpointTestInputSerializer(StrictSerializer):
    """Which event to send as a sample."""

    event_type = StrictChoiceField(choices=EVENT_TYPES)


class WebhookEndpointListQuerySerializer(ListQuerySerializer):
    def validate_after(self, value: str) -> str:
        if not re.fullmatch(WEBHOOK_ENDPOINT_ID_PATTERN, value):
            raise serializers.ValidationError("must be a webhook endpoint id")
        return value


def webhook_endpoint_object(endpoint: WebhookEndpoint) -> dict[str, Any]:
    return {
        "id": endpoint.id,
        "object": "webhook_endpoint",
        "created_at": unix_seconds(endpoint.created_at),
        "updated_at": unix_seconds(endpoint.updated_at),
        "name": endpoint.name,
        "url": endpoint.url,
        "event_types": list(endpoint.event_types),
        "signing_secret_hint": signing_secret_hint(endpoint.secret),
    }


class WebhookEndpointOutputSerializer(serializers.BaseSerializer):
    def to_representation(self, instance: Any) -> dict[str, Any]:
        return webhook_endpoint_object(instance)


class WebhookEndpointWithSecretOutputSerializer(serializers.BaseSerializer):
    """The replies of create and rotate: the only ones that show the signing secret."""

    def to_representation(self, instance: Any) -> dict[str, Any]:
        return {**webhook_endpoint_object(instance), "signing_secret": instance.secret}


def webhook_endpoint_deleted(endpoint_id: str) -> dict[str, Any]:
    return {"id": endpoint_id, "object": "webhook_endpoint.deleted", "deleted": True}


def webhook_endpoint_test_result(*, endpoint_id: str, event_type: str, status_code: int) -> dict[str, Any]:
    return {
        "object": "webhook_endpoint.test",
        "webhook_endpoint_id": endpoint_id,
        "event_type": event_type,
        "status_code": status_code,
        "success": True,
    }


def webhook_event_type_list() -> dict[str, Any]:
    return {"object": "list", "data": list(EVENT_TYPES)}


# --- schema-only components -----------------------------------------------------------------------


@extend_schema_serializer(component_name="WebhookEndpoint")
class WebhookEndpointSchema(serializers.Serializer):
    """A webhook endpoint (docs/webhooks.md), as the openai package's ``webhooks`` resource reads it."""

    id = serializers.CharField(help_text="`whep_` + ULID.")
    object = serializers.ChoiceField(choices=["webhook_endpoint"])
    created_at = serializers.IntegerField(help_text="Unix seconds.")
    updated_at = serializers.IntegerField(help_text="Unix seconds of the last change of its settings or secret.")
    name = serializers.CharField()
    url = serializers.CharField()
    event_types = serializers.ListField(child=serializers.ChoiceField(choices=EVENT_TYPES))
    signing_secret_hint = serializers.CharField(help_text="The secret's last characters, as `whsec_...ab12`.")


@extend_schema_serializer(component_name="WebhookEndpointWithSecret")
class WebhookEndpointWithSecretSchema(WebhookEndpointSchema):
    signing_secret = serializers.CharField(
        help_text="`whsec_` + base64 of 32 random bytes: the key of the deliveries' signatures. Shown only in "
        "the replies of create and rotate_secret."
    )


@extend_schema_serializer(component_name="WebhookEndpointList")
class WebhookEndpointListSchema(_PageSchema):
    data = WebhookEndpointSchema(many=True)


@extend_schema_serializer(component_name="DeletedWebhookEndpoint")
class DeletedWebhookEndpointSchema(serializers.Serializer):
    id = serializers.CharField()
    object = serializers.ChoiceField(choices=["webhook_endpoint.deleted"])
    deleted = serializers.BooleanField()


@extend_schema_serializer(component_name="WebhookEndpointTestResult")
class WebhookEndpointTestResultSchema(serializers.Serializer):
    object = serializers.ChoiceField(choices=["webhook_endpoint.test"])
    webhook_endpoint_id = serializers.CharField()
    event_type = serializers.ChoiceField(choices=EVENT_TYPES)
    status_code = serializers.IntegerField(help_text="The HTTP status the endpoint answered (any status).")
    success = serializers.ChoiceField(
        choices=[True], help_text="Always true: an answer came; `status_code` says what it was."
    )


@extend_schema_serializer(component_name="WebhookEventTypeList")
class WebhookEventTypeListSchema(serializers.Serializer):
    object = serializers.ChoiceField(choices=["list"])
    data = serializers.ListField(child=serializers.ChoiceField(choices=EVENT_TYPES))
