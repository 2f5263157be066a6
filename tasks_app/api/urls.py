from django.urls import include, path
from drf_spectacular.renderers import OpenApiJsonRenderer2
from drf_spectacular.views import SpectacularJSONAPIView, SpectacularSwaggerView

from tasks_app.api import stream_views, views
from tasks_app.openai.chat_completions import views as chat_completions_views

urlpatterns = [
    path("tasks", views.TaskCollectionView.as_view(), name="tasks"),
    path("tasks/<str:task_id>", views.TaskDetailView.as_view(), name="task-detail"),
    path("tasks/<str:task_id>/cancel", views.TaskCancelView.as_view(), name="task-cancel"),
    path("tasks/<str:task_id>/events", stream_views.task_events, name="task-events"),
    path("tasks/<str:task_id>/stream_token", views.TaskStreamTokenView.as_view(), name="task-stream-token"),
    path("responses", stream_views.responses_create, name="responses"),
    path("responses/<str:response_id>", stream_views.response_detail, name="response-detail"),
    path("responses/<str:response_id>/cancel", stream_views.response_cancel, name="response-cancel"),
    path("chat/completions", chat_completions_views.chat_completions_create, name="chat-completions"),
    path("capabilities", views.CapabilitiesView.as_view(), name="capabilities"),
    path("models", views.ModelListView.as_view(), name="models"),
    path("models/<str:model_id>", views.ModelDetailView.as_view(), name="model-detail"),
    path("pair", views.PairView.as_view(), name="pair"),
    path("", include("tasks_app.api.webhook_urls")),
    # The schema (as plain application/json) and Swagger UI over it; both public.
    path("openapi.json", SpectacularJSONAPIView.as_view(renderer_classes=[OpenApiJsonRenderer2]), name="openapi"),
    path("docs", SpectacularSwaggerView.as_view(url_name="openapi"), name="openapi-docs"),
]
