"""The routes of Ollama's native API, at ``/api/...`` (its clients take a host, never a path prefix)."""

from django.urls import path

from tasks_app.ollama import pull, views

urlpatterns = [
    path("version", views.VersionView.as_view(), name="ollama-version"),
    path("tags", views.TagsView.as_view(), name="ollama-tags"),
    path("show", views.ShowView.as_view(), name="ollama-show"),
    path("ps", views.PsView.as_view(), name="ollama-ps"),
    path("chat", views.chat, name="ollama-chat"),
    path("generate", views.generate, name="ollama-generate"),
    path("pull", pull.pull, name="ollama-pull"),
]
