"""Thin views of the Conversations API (PROFILE.md 12.1; docs/conversations.md): the openai package's
``conversations`` and ``conversations.items`` resources with ``base_url=<server>/lmsp/v1`` call these.

Conversations are the client's own: another client's id is ``404 conversation_not_found``.
"""

from __future__ import annotations

from typing import Any

from drf_spectacular.utils import OpenApiParameter
from rest_framework.request import Request
from rest_framework.response import Response

from tasks_app import exceptions as exc
from tasks_app.api.pagination import list_body
from tasks_app.api.schema_annotations import operation
from tasks_app.edge.scoped_views import READ, WRITE, ScopedAPIView, validated
from tasks_app.openai.conversations.serializers import (
    CONVERSATION_ITEM_SCHEMA,
    ConversationCreateInputSerializer,
    ConversationItemListQuerySerializer,
    ConversationItemListSchema,
    ConversationItemQuerySerializer,
    ConversationItemsCreateInputSerializer,
    ConversationSchema,
    ConversationUpdateInputSerializer,
    DeletedConversationSchema,
)
from tasks_app.openai.conversations.translate import (
    conversation_deleted,
    conversation_entries,
    conversation_item_object,
    conversation_object,
)
from tasks_app.selectors.conversations import conversation_get_own, conversation_item_get, conversation_items_list
from tasks_app.services.conversations import (
    conversation_create,
    conversation_delete,
    conversation_item_delete,
    conversation_items_add,
    conversation_update,
)

CONVERSATION_ID = OpenApiParameter("conversation_id", str, OpenApiParameter.PATH, description="`conv_` + ULID.")
ITEM_ID = OpenApiParameter("item_id", str, OpenApiParameter.PATH, description="The item's `id`.")
INCLUDE = OpenApiParameter(
    "include",
    {"type": "array", "items": {"type": "string", "enum": ["reasoning.encrypted_content"]}},
    description="Only `reasoning.encrypted_content` (accepted: the models here have no reasoning items); "
    "anything else asks for output this service does not produce and is refused by name.",
)
_WRITES = (exc.DatabaseBusy,)


def _query(request: Request) -> dict[str, Any]:
    """The query string as one value per name; ``include`` (or the SDKs' ``include[]``) as a list."""
    query: dict[str, Any] = request.query_params.dict()
    included = request.query_params.getlist("include") + request.query_params.getlist("include[]")
    query.pop("include[]", None)
    if included:
        query["include"] = included
    return query


class ConversationCollectionView(ScopedAPIView):
    scopes_by_method = {"POST": WRITE}

    @operation(
        operation_id="conversations_create",
        summary="Create a conversation",
        description="With up to 20 first items and metadata. A response names it in `conversation` to read its "
        "items as context and add its own when it finishes (PROFILE.md 12.1).",
        request=ConversationCreateInputSerializer,
        responses={200: ConversationSchema},
        problems=[exc.InvalidRequest, exc.UnsupportedParameter, *_WRITES],
    )
    def post(self, request: Request) -> Response:
        data = validated(ConversationCreateInputSerializer, request.data)
        conversation = conversation_create(
            client=request.user, metadata=data.get("metadata"), entries=conversation_entries(data.get("items") or ())
        )
        return Response(conversation_object(conversation))


class ConversationDetailView(ScopedAPIView):
    scopes_by_method = {"GET": READ, "POST": WRITE, "DELETE": WRITE}

    @operation(
        operation_id="conversations_retrieve",
        summary="Read a conversation",
        parameters=[CONVERSATION_ID],
        request=None,
        responses={200: ConversationSchema},
        problems=[exc.ConversationNotFound],
    )
    def get(self, request: Request, conversation_id: str) -> Response:
        conversation = conversation_get_own(client=request.user, conversation_id=conversation_id)
        return Response(conversation_object(conversation))

    @operation(
        operation_id="conversations_update",
        summary="Replace a conversation's metadata",
        parameters=[CONVERSATION_ID],
        request=ConversationUpdateInputSerializer,
        responses={200: ConversationSchema},
        problems=[exc.InvalidRequest, exc.ConversationNotFound, *_WRITES],
    )
    def post(self, request: Request, conversation_id: str) -> Response:
        conversation = conversation_get_own(client=request.user, conversation_id=conversation_id)
        data = validated(ConversationUpdateInputSerializer, request.data)
        return Response(conversation_object(conversation_update(conversation=conversation, metadata=data["metadata"])))

    @operation(
        operation_id="conversations_delete",
        summary="Delete a conversation and its items",
        description="The responses that used it stay; one still running adds nothing when it finishes.",
        parameters=[CONVERSATION_ID],
        request=None,
        responses={200: DeletedConversationSchema},
        problems=[exc.ConversationNotFound, *_WRITES],
    )
    def delete(self, request: Request, conversation_id: str) -> Response:
        conversation = conversation_get_own(client=request.user, conversation_id=conversation_id)
        conversation_delete(conversation=conversation)
        return Response(conversation_deleted(conversation_id))


class ConversationItemCollectionView(ScopedAPIView):
    scopes_by_method = {"GET": READ, "POST": WRITE}

    @operation(
        operation_id="conversations_items_list",
        summary="List a conversation's items",
        description="Newest first by default (`order=asc`: oldest first); `after` is the last item id of the "
        "previous page (an item the conversation no longer has is `404 conversation_item_not_found`). A running "
        "response's input is listed once it finishes, with its output.",
        parameters=[CONVERSATION_ID, ConversationItemListQuerySerializer, INCLUDE],
        request=None,
        responses={200: ConversationItemListSchema},
        problems=[exc.InvalidRequest, exc.ConversationNotFound, exc.ConversationItemNotFound],
    )
    def get(self, request: Request, conversation_id: str) -> Response:
        query = validated(ConversationItemListQuerySerializer, _query(request))
        conversation = conversation_get_own(client=request.user, conversation_id=conversation_id)
        page = conversation_items_list(
            conversation=conversation, after=query.get("after"), limit=query["limit"], order=query["order"]
        )
        return Response(list_body([conversation_item_object(item) for item in page.items], page.has_more))

    @operation(
        operation_id="conversations_items_create",
        summary="Add items to a conversation",
        description="1 to 20 items, at its end, in order; each gets a new id.",
        parameters=[CONVERSATION_ID, INCLUDE],
        request=ConversationItemsCreateInputSerializer,
        responses={200: ConversationItemListSchema},
        problems=[exc.InvalidRequest, exc.UnsupportedParameter, exc.ConversationNotFound, *_WRITES],
    )
    def post(self, request: Request, conversation_id: str) -> Response:
        validated(ConversationItemQuerySerializer, _query(request))
        conversation = conversation_get_own(client=request.user, conversation_id=conversation_id)
        data = validated(ConversationItemsCreateInputSerializer, request.data)
        rows = conversation_items_add(conversation=conversation, entries=conversation_entries(data["items"]))
        return Response(list_body([conversation_item_object(row) for row in rows], False))


class ConversationItemDetailView(ScopedAPIView):
    scopes_by_method = {"GET": READ, "DELETE": WRITE}

    @operation(
        operation_id="conversations_items_retrieve",
        summary="Read one item of a conversation",
        parameters=[CONVERSATION_ID, ITEM_ID, INCLUDE],
        request=None,
        responses={200: CONVERSATION_ITEM_SCHEMA},
        problems=[exc.InvalidRequest, exc.ConversationNotFound, exc.ConversationItemNotFound],
    )
    def get(self, request: Request, conversation_id: str, item_id: str) -> Response:
        validated(ConversationItemQuerySerializer, _query(request))
        conversation = conversation_get_own(client=request.user, conversation_id=conversation_id)
        return Response(conversation_item_object(conversation_item_get(conversation=conversation, item_id=item_id)))

    @operation(
        operation_id="conversations_items_delete",
        summary="Delete one item of a conversation",
        description="Answers the conversation. Later responses no longer read the item.",
        parameters=[CONVERSATION_ID, ITEM_ID],
        request=None,
        responses={200: ConversationSchema},
        problems=[exc.ConversationNotFound, exc.ConversationItemNotFound, *_WRITES],
    )
    def delete(self, request: Request, conversation_id: str, item_id: str) -> Response:
        conversation = conversation_get_own(client=request.user, conversation_id=conversation_id)
        return Response(conversation_object(conversation_item_delete(conversation=conversation, item_id=item_id)))
