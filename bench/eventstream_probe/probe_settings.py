"""Scratch settings for the django-eventstream probe; independent of lmsp_project.settings.

The driver (run.py) passes the SQLite file and the private Redis port through
the environment, so the server process and the sender processes share them.
"""

import os

SECRET_KEY = "eventstream-probe-only"
DEBUG = False
ALLOWED_HOSTS = ["127.0.0.1", "localhost"]
USE_TZ = True
ROOT_URLCONF = "probe_urls"
INSTALLED_APPS = [
    "django.contrib.contenttypes",
    "django.contrib.auth",
    "django_eventstream",
]
MIDDLEWARE: list[str] = []
DATABASES = {
    "default": {
        "ENGINE": "django.db.backends.sqlite3",
        "NAME": os.environ["PROBE_DB"],
        # The server and the sender processes write the same file.
        # synchronous=OFF: the timings in check f then measure statements, not fsync.
        "OPTIONS": {"timeout": 30, "init_command": "PRAGMA synchronous=OFF"},
    }
}
DEFAULT_AUTO_FIELD = "django.db.models.AutoField"

# The library's documented multi-process setup: its own model storage plus
# Redis pub/sub between the processes.
EVENTSTREAM_STORAGE_CLASS = "django_eventstream.storage.DjangoModelStorage"
EVENTSTREAM_REDIS = {"host": "127.0.0.1", "port": int(os.environ["PROBE_REDIS_PORT"]), "db": 0}

LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "handlers": {"console": {"class": "logging.StreamHandler"}},
    "root": {"handlers": ["console"], "level": "WARNING"},
    # DEBUG shows the library's "could not queue event" (MAX_PENDING overflow) lines.
    "loggers": {"django_eventstream": {"handlers": ["console"], "level": "DEBUG", "propagate": False}},
}
