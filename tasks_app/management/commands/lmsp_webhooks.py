"""lmsp_webhooks: the webhook deliverer (docs/webhooks.md), the Procfile's ``webhooks`` process."""

from __future__ import annotations

import logging
import signal
import threading
from typing import Any

from django.conf import settings
from django.core.management.base import BaseCommand, CommandParser

from tasks_app.plumbing.database_outages import outage_process_set
from tasks_app.services.webhook_delivery import webhook_deliveries_run

logger = logging.getLogger("tasks_app.webhooks")


class Command(BaseCommand):
    # Django's system checks (models, admin, URLs) import every view: half a second of a 1 s command on a slow
    # machine. They check the code, not the installation: lmsp_prepare and `manage.py check` run them.
    requires_system_checks: list[str] = []

    help = (
        "Deliver the webhook outbox: POST each due delivery, signed, to its endpoint, retrying with backoff "
        "until LMSP_WEBHOOK_MAX_AGE_SECONDS. Runs until SIGTERM or Ctrl-C; several may run, on several hosts."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--once", action="store_true", help="one round: send what is due now, then exit")

    def handle(self, *args: Any, **options: Any) -> None:
        outage_process_set("webhooks")
        stop = threading.Event()

        def request_stop(signum: int, frame: Any) -> None:
            # The loop ends within a poll slice; attempts under way are left to their leases.
            stop.set()

        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, request_stop)
        if not options["once"]:
            logger.info(
                "webhooks: delivering the outbox, %d at once, polling every %.1f s",
                settings.LMSP_WEBHOOK_CONCURRENCY,
                settings.LMSP_WEBHOOK_POLL_SECONDS,
            )
        counts = webhook_deliveries_run(stop=stop, once=options["once"])
        logger.info(
            "webhooks: stopped: %d delivered, %d to retry, %d given up",
            counts.delivered,
            counts.retrying,
            counts.failed,
        )
