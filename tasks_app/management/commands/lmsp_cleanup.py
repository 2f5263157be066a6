"""lmsp_cleanup: delete finished tasks, events and keys past their retention (PROFILE.md section 8)."""

from __future__ import annotations

from django.core.management.base import BaseCommand, CommandError, CommandParser

from tasks_app.services.retention import retention_cleanup


class Command(BaseCommand):
    # Django's system checks (models, admin, URLs) import every view: half a second of a 1 s command on a slow
    # machine. They check the code, not the installation: lmsp_prepare and `manage.py check` run them.
    requires_system_checks: list[str] = []

    help = (
        "Delete events and finished tasks (with their responses) past LMSP_EVENT_RETENTION_SECONDS / "
        "LMSP_TASK_RETENTION_SECONDS, and expired idempotency keys and pairing codes. "
        "Unfinished tasks are never touched."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument(
            "--batch-size",
            type=int,
            default=None,
            help="rows deleted per transaction (default LMSP_CLEANUP_BATCH_SIZE)",
        )

    def handle(self, *args, **options) -> None:
        batch_size = options["batch_size"]
        if batch_size is not None and batch_size < 1:
            raise CommandError("--batch-size must be at least 1")
        summary = retention_cleanup(batch_size=batch_size)
        self.stdout.write(summary.describe())
