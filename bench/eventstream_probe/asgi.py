"""ASGI entry point for ``uvicorn asgi:application`` (run from this directory)."""

import os

from django.core.asgi import get_asgi_application

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "probe_settings")
application = get_asgi_application()
