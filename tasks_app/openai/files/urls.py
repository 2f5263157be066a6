"""The routes of ``/files``, included by ``tasks_app.api.urls`` (names unprefixed, as every route's)."""

from django.urls import path

from tasks_app.openai.files import views

urlpatterns = [
    path("files", views.FileCollectionView.as_view(), name="files"),
    path("files/<str:file_id>", views.FileDetailView.as_view(), name="file-detail"),
    path("files/<str:file_id>/content", views.FileContentView.as_view(), name="file-content"),
]
