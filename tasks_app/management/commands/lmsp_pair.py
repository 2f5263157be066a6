"""lmsp_pair: print a one-time pairing code."""

from __future__ import annotations

from django.core.management.base import BaseCommand, CommandError, CommandParser

from tasks_app.exceptions import LmspError
from tasks_app.services.clients import pairing_code_create


class Command(BaseCommand):
    # Django's system checks (models, admin, URLs) import every view: half a second of a 1 s command on a slow
    # machine. They check the code, not the installation: lmsp_prepare and `manage.py check` run them.
    requires_system_checks: list[str] = []

    help = "Print a one-time code that POST /lmsp/v1/pair trades for a token."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--scopes", default="responses,read", help="comma-separated: responses,read,admin")
        parser.add_argument("--ttl", type=int, default=None, help="seconds the code stays valid (default 600)")

    def handle(self, *args, **options) -> None:
        try:
            pairing, code = pairing_code_create(scopes=options["scopes"], ttl_seconds=options["ttl"])
        except LmspError as error:
            raise CommandError(error.detail) from None
        self.stdout.write(code)
        self.stderr.write(
            f"valid until {pairing.expires_at:%Y-%m-%d %H:%M:%S %Z} for scopes {','.join(pairing.scopes)}"
        )
