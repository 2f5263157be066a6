"""WSGI entry point (management tools and WSGI servers)."""

import os

from django.core.wsgi import get_wsgi_application

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "lmsp_project.settings")

application = get_wsgi_application()

from tasks_app.plumbing.database_outages import outage_process_set  # noqa: E402  (after setup)

outage_process_set("web")
