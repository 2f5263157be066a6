"""The conversations' admin (PROFILE.md 12.1): each conversation with its items, pending ones marked."""

from __future__ import annotations

from django.contrib import admin
from django.db.models import Count, QuerySet
from django.http import HttpRequest
from django.urls import reverse
from django.utils.html import format_html, format_html_join

from tasks_app.admin.access import ReadOnlyAdmin
from tasks_app.admin.display import pretty_json, status_badge
from tasks_app.models import Conversation, ConversationItem, ConversationItemState
from tasks_app.selectors.conversations import conversation_items_shown

# A conversation page shows its newest items; a longer one says how many are left out.
SHOWN_ITEMS = 200
PREVIEW_CHARACTERS = 300


@admin.register(Conversation)
class ConversationAdmin(ReadOnlyAdmin):
    list_display = ("id", "client", "item_count", "last_worker", "created_at", "updated_at")
    list_filter = ("client",)
    search_fields = ("id__exact",)
    search_help_text = "A conversation id (conv_…), exactly."
    list_select_related = ("client",)
    ordering = ("-id",)
    fields = ("id", "client", "metadata_shown", "last_worker", "created_at", "updated_at", "items_shown")
    readonly_fields = fields

    def get_queryset(self, request: HttpRequest) -> QuerySet[Conversation]:
        return super().get_queryset(request).annotate(item_total=Count("items"))

    @admin.display(description="items", ordering="item_total")
    def item_count(self, conversation: Conversation) -> int:
        return conversation.item_total

    @admin.display(description="metadata")
    def metadata_shown(self, conversation: Conversation) -> str:
        return pretty_json(conversation.metadata)

    @admin.display(description="items")
    def items_shown(self, conversation: Conversation) -> str:
        items, total = conversation_items_shown(conversation=conversation, limit=SHOWN_ITEMS)
        if not items:
            return "-"
        rows = format_html_join("", "<tr>{}</tr>", ((_item_cells(item),) for item in items))
        left_out = total - len(items)
        note = format_html("<p>The {} older items are not shown.</p>", left_out) if left_out else ""
        header = "<tr><th>#</th><th>item</th><th>type</th><th>text</th><th>added by</th><th>state</th></tr>"
        return format_html('{}<table class="lmsp-items">{}{}</table>', note, format_html(header), rows)


def _item_cells(item: ConversationItem) -> str:
    body = item.item
    kind = body.get("type", "message")
    if kind == "message":
        kind = f"message · {body.get('role')}"
        text = "".join(part.get("text", "") for part in body.get("content", ()))
    elif kind == "function_call":
        text = f"{body.get('name')}({body.get('arguments')})"
    else:
        text = str(body.get("output", ""))
    if len(text) > PREVIEW_CHARACTERS:
        text = text[:PREVIEW_CHARACTERS] + "…"
    added_by = (
        format_html(
            '<a href="{}">{}</a>', reverse("admin:tasks_app_response_change", args=[item.response_id]), item.response_id
        )
        if item.response_id
        else "client"
    )
    pending = item.state == ConversationItemState.PENDING
    state = status_badge("running" if pending else "succeeded", "pending" if pending else "added")
    return format_html(
        "<td>{}</td><td><code>{}</code></td><td>{}</td><td>{}</td><td>{}</td><td>{}</td>",
        item.pk,
        item.item_id,
        kind,
        text,
        added_by,
        state,
    )
