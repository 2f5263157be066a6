from django.contrib import admin
from django.urls import include, path

from tasks_app.api.health_view import health_view
from tasks_app.api.landing import landing_view
from tasks_app.api.metrics_view import metrics_view

urlpatterns = [
    # The address the quick start prints, and the bare host: links for a newcomer (no schema entry).
    path("", landing_view, name="landing"),
    path("lmsp/v1", landing_view, name="api-landing"),
    path("lmsp/v1/", include("tasks_app.api.urls")),
    # Ollama's native API (docs/ollama.md): its clients append /api/... to a bare host.
    path("api/", include("tasks_app.ollama.urls")),
    path("admin/", admin.site.urls),
    path("metrics", metrics_view, name="metrics"),
    # Whether this web process can serve now (the database, Redis); docs/recovery.md.
    path("healthz", health_view, name="health"),
]

handler400 = "tasks_app.edge.problems.handler400"
handler403 = "tasks_app.edge.problems.handler403"
handler404 = "tasks_app.edge.problems.handler404"
handler500 = "tasks_app.edge.problems.handler500"
