from django.urls import include, path
from drf_spectacular.renderers import OpenApiJsonRenderer2
from drf_spectacular.views import SpectacularJSONAPIView, SpectacularSwaggerView

from tasks_app.api import capabilities_view, model_views, pair_view, stream_views, task_views

urlpatterns = [
    path("tasks", task_views.TaskCollectionView.as_view(), name="tasks"),
    path("tasks/<str:task_id>", task_views.TaskDetailView.as_view(), name="task-detail"),
    path("tasks/<str:task_id>/cancel", task_views.TaskCancelView.as_view(), name="task-cancel"),
    path("tasks/<str:task_id>/events", stream_views.task_events, name="task-events"),
    path("tasks/<str:task_id>/stream_token", task_views.TaskStreamTokenView.as_view(), name="task-stream-token"),
    # The OpenAI protocols' routes (their own packages), in their place among ours.
    path("", include("tasks_app.openai.responses.urls")),
    path("", include("tasks_app.openai.chat_completions.urls")),
    path("", include("tasks_app.openai.files.urls")),
    path("", include("tasks_app.openai.batches.urls")),
    path("", include("tasks_app.openai.conversations.urls")),
    # Anthropic's Messages API (its own package).
    path("", include("tasks_app.anthropic.urls")),
    path("capabilities", capabilities_view.CapabilitiesView.as_view(), name="capabilities"),
    path("models", model_views.ModelListView.as_view(), name="models"),
    path("models/<str:model_id>", model_views.ModelDetailView.as_view(), name="model-detail"),
    path("pair", pair_view.PairView.as_view(), name="pair"),
    path("", include("tasks_app.api.webhook_urls")),
    # The schema (as plain application/json) and Swagger UI over it; both public.
    path("openapi.json", SpectacularJSONAPIView.as_view(renderer_classes=[OpenApiJsonRenderer2]), name="openapi"),
    path("docs", SpectacularSwaggerView.as_view(url_name="openapi"), name="openapi-docs"),
]
