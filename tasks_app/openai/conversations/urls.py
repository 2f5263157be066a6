"""The routes of ``/conversations`` (PROFILE.md 12.1), included by ``tasks_app.api.urls``."""

from django.urls import path

from tasks_app.openai.conversations import views

urlpatterns = [
    path("conversations", views.ConversationCollectionView.as_view(), name="conversations"),
    path("conversations/<str:conversation_id>", views.ConversationDetailView.as_view(), name="conversation-detail"),
    path(
        "conversations/<str:conversation_id>/items",
        views.ConversationItemCollectionView.as_view(),
        name="conversation-items",
    ),
    path(
        "conversations/<str:conversation_id>/items/<str:item_id>",
        views.ConversationItemDetailView.as_view(),
        name="conversation-item-detail",
    ),
]
