"""Routes of the webhook endpoints (docs/webhooks.md), as the openai package's ``webhooks`` resource calls them."""

from django.urls import path

from tasks_app.api import webhook_views

urlpatterns = [
    path("webhook_endpoints", webhook_views.WebhookEndpointCollectionView.as_view(), name="webhook-endpoints"),
    path(
        "webhook_endpoints/<str:webhook_endpoint_id>",
        webhook_views.WebhookEndpointDetailView.as_view(),
        name="webhook-endpoint-detail",
    ),
    path(
        "webhook_endpoints/<str:webhook_endpoint_id>/rotate_secret",
        webhook_views.WebhookEndpointRotateView.as_view(),
        name="webhook-endpoint-rotate",
    ),
    path(
        "webhook_endpoints/<str:webhook_endpoint_id>/test",
        webhook_views.WebhookEndpointTestView.as_view(),
        name="webhook-endpoint-test",
    ),
    path("webhook_event_types", webhook_views.WebhookEventTypeListView.as_view(), name="webhook-event-types"),
]
