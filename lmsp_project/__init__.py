"""Django project of the LMSP service; the Celery app loads with it so that
``transaction.on_commit`` dispatches use the configured broker."""

from lmsp_project.celery import app as celery_app

__all__ = ("celery_app",)
