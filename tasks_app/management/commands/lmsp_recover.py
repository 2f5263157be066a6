"""lmsp_recover: apply the restart policies (chapter 11.3) to leftover tasks; run at service start."""

from __future__ import annotations

from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.db import DatabaseError, connection

from tasks_app.plumbing.db_locks import is_database_unavailable
from tasks_app.services.recovery import RecoverySummary, leftover_tasks_recover, live_workers_inspect


class Command(BaseCommand):
    # Django's system checks (models, admin, URLs) import every view: half a second of a 1 s command on a slow
    # machine. They check the code, not the installation: lmsp_prepare and `manage.py check` run them.
    requires_system_checks: list[str] = []

    help = (
        "Move every unfinished task that no live worker holds as its on_restart policy says "
        "(fail, retry, resume), a page of tasks per transaction, each with its event. Run it before workers start; "
        "running it again changes nothing. A task whose recovery raises is logged, counted and left for the next "
        "run; the exit status is non-zero only when the database cannot be reached."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument(
            "--inspect-timeout",
            type=float,
            default=None,
            help="seconds to wait for live workers to say what they run (default LMSP_RECOVER_INSPECT_SECONDS)",
        )
        parser.add_argument("--batch-size", type=int, default=500, help="tasks read per query of the scan")

    def handle(self, *args, **options) -> None:
        if options["batch_size"] < 1:
            raise CommandError("--batch-size must be at least 1")
        try:
            connection.ensure_connection()
            live = live_workers_inspect(timeout=options["inspect_timeout"])
            summary = leftover_tasks_recover(live=live, batch_size=options["batch_size"])
        except DatabaseError as exc:
            if not is_database_unavailable(exc):
                raise
            raise CommandError(
                f"the database cannot be reached ({_one_line(exc)}): recovery stopped; pages committed before stay "
                "moved, every other task is as it was; run it again once the database answers"
            ) from exc
        self._report(summary)

    def _report(self, summary: RecoverySummary) -> None:
        workers = ", ".join(summary.live_workers) or "none"
        self.stdout.write(f"lmsp_recover: live workers: {workers}")
        for line in summary.lines():
            self.stdout.write(f"lmsp_recover: {line}")


def _one_line(exc: BaseException) -> str:
    return " ".join(line.strip() for line in str(exc).splitlines() if line.strip()) or type(exc).__name__
