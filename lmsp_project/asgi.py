"""ASGI entry point: uvicorn serves the API; event-stream bodies are written beside Django."""

import os

from django.core.asgi import get_asgi_application

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "lmsp_project.settings")

django_application = get_asgi_application()

from tasks_app.api.sse import EventStreamMiddleware  # noqa: E402  (needs the apps loaded)

application = EventStreamMiddleware(django_application)
