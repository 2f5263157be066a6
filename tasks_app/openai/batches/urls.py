"""The routes of ``/batches``, included by ``tasks_app.api.urls`` (names unprefixed, as every route's)."""

from django.urls import path

from tasks_app.openai.batches import views

urlpatterns = [
    path("batches", views.BatchCollectionView.as_view(), name="batches"),
    path("batches/<str:batch_id>", views.BatchDetailView.as_view(), name="batch-detail"),
    path("batches/<str:batch_id>/cancel", views.BatchCancelView.as_view(), name="batch-cancel"),
]
