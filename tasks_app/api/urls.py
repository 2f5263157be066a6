from django.urls import path

from tasks_app.api import views

urlpatterns = [
    path("tasks", views.TaskCollectionView.as_view(), name="tasks"),
    path("tasks/<str:task_id>", views.TaskDetailView.as_view(), name="task-detail"),
    path("tasks/<str:task_id>/cancel", views.TaskCancelView.as_view(), name="task-cancel"),
    path("responses", views.responses_create, name="responses"),
    path("responses/<str:response_id>", views.ResponseDetailView.as_view(), name="response-detail"),
    path("capabilities", views.CapabilitiesView.as_view(), name="capabilities"),
    path("models", views.ModelListView.as_view(), name="models"),
    path("pair", views.PairView.as_view(), name="pair"),
]
