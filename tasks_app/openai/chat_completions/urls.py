"""The route of ``/chat/completions``, included by ``tasks_app.api.urls``."""

from django.urls import path

from tasks_app.openai.chat_completions import views

urlpatterns = [
    path("chat/completions", views.chat_completions_create, name="chat-completions"),
]
