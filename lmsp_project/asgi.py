"""ASGI entry point: uvicorn serves the API; event-stream bodies are written beside Django."""

import os

from django.contrib.staticfiles.handlers import ASGIStaticFilesHandler
from django.core.asgi import get_asgi_application

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "lmsp_project.settings")

# The admin's and the API docs page's files (/static/) come from the apps'
# folders: a local service has no separate web server in front of it.
django_application = ASGIStaticFilesHandler(get_asgi_application())

from tasks_app.api.sse import EventStreamMiddleware  # noqa: E402  (needs the apps loaded)

application = EventStreamMiddleware(django_application)
