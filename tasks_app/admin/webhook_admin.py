"""The webhook admins: endpoints (never their secret, only its hint) and the outbox, with "Retry now"."""

from __future__ import annotations

from django.contrib import admin, messages
from django.db.models import QuerySet
from django.http import HttpRequest

from tasks_app.admin.access import ReadOnlyAdmin
from tasks_app.admin.bounded_counts import BoundedCountAdmin
from tasks_app.admin.display import admin_link, task_link
from tasks_app.models import WebhookDelivery, WebhookEndpoint
from tasks_app.plumbing.webhook_http import signing_secret_hint
from tasks_app.services.webhook_delivery import webhook_deliveries_retry_now


@admin.register(WebhookEndpoint)
class WebhookEndpointAdmin(ReadOnlyAdmin):
    list_display = ("id", "client", "name", "url", "event_types", "secret_hint", "created_at", "updated_at")
    list_filter = ("client",)
    search_fields = ("id__exact",)
    search_help_text = "A webhook endpoint id (whep_…), exactly."
    list_select_related = ("client",)
    ordering = ("-id",)
    # Never the secret itself: deliveries need it, people do not.
    fields = ("id", "client", "name", "url", "event_types", "secret_hint", "created_at", "updated_at")
    readonly_fields = fields

    @admin.display(description="signing secret")
    def secret_hint(self, endpoint: WebhookEndpoint) -> str:
        return signing_secret_hint(endpoint.secret)


@admin.register(WebhookDelivery)
class WebhookDeliveryAdmin(BoundedCountAdmin, ReadOnlyAdmin):
    list_display = (
        "id",
        "endpoint",
        "event_type",
        "status",
        "attempts",
        "last_status_code",
        "last_error",
        "next_attempt_at",
        "delivered_at",
        "created_at",
    )
    # No event type filter: its choices would be a DISTINCT over the whole table.
    list_filter = ("status",)
    search_fields = ("id__exact", "task_id__exact", "response_id__exact")
    search_help_text = "A delivery id (the webhook-id, whmsg_…), a task id or a response id, exactly."
    list_select_related = ("endpoint",)
    list_defer = ("payload", "endpoint__secret", "endpoint__previous_secret")
    ordering = ("-id",)
    actions = ("retry_now",)
    fields = (
        "id",
        "endpoint_link",
        "event_id",
        "event_type",
        "task_column",
        "response_id",
        "status",
        "attempts",
        "next_attempt_at",
        "last_attempt_at",
        "last_status_code",
        "last_error",
        "delivered_at",
        "created_at",
        "payload",
    )
    readonly_fields = fields

    @admin.display(description="endpoint")
    def endpoint_link(self, delivery: WebhookDelivery) -> str:
        return admin_link(delivery.endpoint)

    @admin.display(description="task")
    def task_column(self, delivery: WebhookDelivery) -> str:
        return task_link(delivery.task_id)

    def has_retry_permission(self, request: HttpRequest) -> bool:
        """Retrying changes the delivery: Django's "Can change webhook delivery" permission."""
        opts = self.opts
        return request.user.has_perm(f"{opts.app_label}.change_{opts.model_name}")

    @admin.action(description="Retry now (pending and given-up deliveries)", permissions=["retry"])
    def retry_now(self, request: HttpRequest, queryset: QuerySet[WebhookDelivery]) -> None:
        ids = list(queryset.values_list("id", flat=True))
        due = webhook_deliveries_retry_now(delivery_ids=ids)
        self.message_user(
            request, f"{due} of {len(ids)} deliveries are due now (delivered ones are left alone).", messages.SUCCESS
        )
