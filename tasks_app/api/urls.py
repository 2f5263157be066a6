from django.urls import path

from tasks_app.api import streams, views

urlpatterns = [
    path("tasks", views.TaskCollectionView.as_view(), name="tasks"),
    path("tasks/<str:task_id>", views.TaskDetailView.as_view(), name="task-detail"),
    path("tasks/<str:task_id>/cancel", views.TaskCancelView.as_view(), name="task-cancel"),
    path("tasks/<str:task_id>/events", streams.task_events, name="task-events"),
    path("tasks/<str:task_id>/stream_token", views.TaskStreamTokenView.as_view(), name="task-stream-token"),
    path("responses", streams.responses_create, name="responses"),
    path("responses/<str:response_id>", streams.response_detail, name="response-detail"),
    path("capabilities", views.CapabilitiesView.as_view(), name="capabilities"),
    path("models", views.ModelListView.as_view(), name="models"),
    path("pair", views.PairView.as_view(), name="pair"),
]
