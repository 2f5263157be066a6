"""The routes of Anthropic's Messages API, included by ``tasks_app.api.urls`` (so ``ANTHROPIC_BASE_URL=<host>/lmsp``
works: the SDKs and Claude Code append ``/v1/messages``)."""

from django.urls import path

from tasks_app.anthropic import views

urlpatterns = [
    path("messages", views.messages_create, name="messages"),
    path("messages/count_tokens", views.CountTokensView.as_view(), name="messages-count-tokens"),
]
