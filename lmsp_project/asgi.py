"""ASGI entry point: uvicorn serves the API and, later, the event streams."""

import os

from django.core.asgi import get_asgi_application

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "lmsp_project.settings")

application = get_asgi_application()
