"""The Conversations API's inputs and outputs (PROFILE.md 12.1), in the openai package's shapes.

Inputs check shape and JSON types strictly and refuse unknown fields by name;
an item is checked as a Responses input item is (``input_items``). The
schema-only components (what spectacular documents) are at the end.
"""

from __future__ import annotations

import re
from typing import Any

from drf_spectacular.utils import extend_schema_field, extend_schema_serializer
from rest_framework import serializers

from tasks_app.api.pagination import ListQuerySerializer
from tasks_app.api.schema_components import _PageSchema
from tasks_app.edge.strict_json import StrictCharField, StrictChoiceField, StrictSerializer
from tasks_app.ids import CONVERSATION_PREFIX
from tasks_app.openai import surface
from tasks_app.openai.responses.input_items import _INPUT_ITEM_SCHEMA, input_item
from tasks_app.openai.responses.serializers import MetadataField

# OpenAI's limit on the items of one create (openai-agents sends at most this many per request).
MAX_ITEMS_PER_REQUEST = 20
CONVERSATION_ID_PATTERN = rf"^{CONVERSATION_PREFIX}[0-7][0-9A-HJKMNP-TV-Z]{{25}}$"


def _items_schema(min_items: int) -> dict[str, Any]:
    return {
        "type": "array",
        "minItems": min_items,
        "maxItems": MAX_ITEMS_PER_REQUEST,
        "items": _INPUT_ITEM_SCHEMA,
        "description": "Items as a response request's `input` takes them (messages, `function_call`, "
        "`function_call_output`; `reasoning` items are accepted and left out). Each gets a new id.",
    }


class ConversationItemsField(serializers.Field):
    """A list of input items, ``min_items`` to 20 (reasoning items accepted and left out)."""

    def __init__(self, *, min_items: int, **kwargs: Any) -> None:
        self.min_items = min_items
        super().__init__(**kwargs)

    def to_internal_value(self, data: Any) -> list[dict[str, Any]]:
        if not isinstance(data, list) or not self.min_items <= len(data) <= MAX_ITEMS_PER_REQUEST:
            raise serializers.ValidationError(
                f"must be a list of {self.min_items} to {MAX_ITEMS_PER_REQUEST} items (send more in several requests)"
            )
        errors, items = [], []
        for index, element in enumerate(data):
            try:
                items.append(input_item(index, element, path="items"))
                errors.append({})
            except serializers.ValidationError as error:
                errors.append(error.detail)
        if any(errors):
            raise serializers.ValidationError(errors)
        return [item for item in items if item is not None]

    def to_representation(self, value: Any) -> Any:
        return value


@extend_schema_field({**_items_schema(0), "nullable": True})
class InitialItemsField(ConversationItemsField):
    def __init__(self, **kwargs: Any) -> None:
        super().__init__(min_items=0, **kwargs)


@extend_schema_field(_items_schema(1))
class AddedItemsField(ConversationItemsField):
    def __init__(self, **kwargs: Any) -> None:
        super().__init__(min_items=1, **kwargs)


class ConversationCreateInputSerializer(StrictSerializer):
    items = InitialItemsField(required=False, allow_null=True)
    metadata = MetadataField(required=False, allow_null=True)


class ConversationUpdateInputSerializer(StrictSerializer):
    metadata = MetadataField(allow_null=True, help_text="Replaces the conversation's metadata (null empties it).")


class _IncludeQuery(StrictSerializer):
    """``include``: only what a response request accepts; everything else asks for output not produced here."""

    include = serializers.ListField(child=StrictCharField(max_length=200), required=False)

    def validate_include(self, values: list[str]) -> list[str]:
        for value in values:
            if value not in surface.ACCEPTED_INCLUDES:
                raise serializers.ValidationError(f"{value!r} asks for output this service does not produce")
        return values


class ConversationItemsCreateInputSerializer(StrictSerializer):
    items = AddedItemsField()


class ConversationItemListQuerySerializer(ListQuerySerializer, _IncludeQuery):
    order = StrictChoiceField(choices=("asc", "desc"), required=False, default="desc")


class ConversationItemQuerySerializer(_IncludeQuery):
    pass


def conversation_id_valid(value: str) -> bool:
    return re.fullmatch(CONVERSATION_ID_PATTERN, value) is not None


# --- schema-only components -----------------------------------------------------------------------


@extend_schema_serializer(component_name="Conversation")
class ConversationSchema(serializers.Serializer):
    id = serializers.CharField(help_text="`conv_` + ULID.")
    object = serializers.ChoiceField(choices=["conversation"])
    created_at = serializers.IntegerField(help_text="Unix seconds.")
    metadata = serializers.DictField(child=serializers.CharField())


@extend_schema_serializer(component_name="DeletedConversation")
class DeletedConversationSchema(serializers.Serializer):
    id = serializers.CharField()
    object = serializers.ChoiceField(choices=["conversation.deleted"])
    deleted = serializers.BooleanField()


_ITEM_STATUS = {"type": "string", "enum": ["in_progress", "completed", "incomplete"]}
CONVERSATION_ITEM_SCHEMA = {
    "oneOf": [
        {
            "type": "object",
            "required": ["id", "type", "role", "status", "content"],
            "properties": {
                "id": {"type": "string"},
                "type": {"type": "string", "enum": ["message"]},
                "role": {"type": "string", "enum": ["user", "system", "developer", "assistant"]},
                "status": _ITEM_STATUS,
                "content": {
                    "type": "array",
                    "items": {
                        "type": "object",
                        "required": ["type", "text"],
                        "properties": {
                            "type": {"type": "string", "enum": ["input_text", "output_text"]},
                            "text": {"type": "string"},
                            "annotations": {"type": "array"},
                        },
                    },
                },
            },
        },
        {
            "type": "object",
            "required": ["id", "type", "call_id", "name", "arguments", "status"],
            "properties": {
                "id": {"type": "string"},
                "type": {"type": "string", "enum": ["function_call"]},
                "call_id": {"type": "string"},
                "name": {"type": "string"},
                "arguments": {"type": "string"},
                "status": _ITEM_STATUS,
            },
        },
        {
            "type": "object",
            "required": ["id", "type", "call_id", "output", "status"],
            "properties": {
                "id": {"type": "string"},
                "type": {"type": "string", "enum": ["function_call_output"]},
                "call_id": {"type": "string"},
                "output": {"type": "string"},
                "status": _ITEM_STATUS,
            },
        },
    ],
    "description": "An item with its `id`: a message, a `function_call` or a `function_call_output`.",
}


@extend_schema_field(CONVERSATION_ITEM_SCHEMA)
class ConversationItemSchema(serializers.Field):
    def to_representation(self, value: Any) -> Any:
        return value


@extend_schema_serializer(component_name="ConversationItemList")
class ConversationItemListSchema(_PageSchema):
    data = serializers.ListField(child=ConversationItemSchema())
