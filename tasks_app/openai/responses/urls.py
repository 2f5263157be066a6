"""The routes of ``/responses``, included by ``tasks_app.api.urls`` (names unprefixed, as every route's)."""

from django.urls import path

from tasks_app.openai.responses import stream_views

urlpatterns = [
    path("responses", stream_views.responses_create, name="responses"),
    path("responses/<str:response_id>", stream_views.response_detail, name="response-detail"),
    path("responses/<str:response_id>/cancel", stream_views.response_cancel, name="response-cancel"),
]
