"""lmsp_prepare: everything a node needs before its processes start, in one process (scripts/prepare)."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

from django.conf import settings
from django.core.management import call_command
from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.db import connection
from django.db.utils import OperationalError

from tasks_app.services.clients import client_local_token_ensure


class Command(BaseCommand):
    help = (
        "Migrate the database, build and register the demo models (demo, demo:endless) when they are missing or an "
        "older version built them, make sure a local client token exists ($LMSP_DATA_DIR/local-token), then apply "
        "the restart policies to the tasks a previous run left unfinished (lmsp_recover). Every step is idempotent. "
        "One process for all of them: each Django start costs about a second of CPU."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--no-token", action="store_true", help="skip the local token")
        parser.add_argument(
            "--wait-db",
            type=float,
            default=0,
            metavar="SECONDS",
            help="wait that long for the database to accept connections first (a container that is still starting)",
        )

    def handle(self, *args, **options) -> None:
        if options["wait_db"]:
            _database_wait(options["wait_db"], self.stderr.write)
        self.stderr.write("prepare: migrating the database")
        call_command("migrate", interactive=False, verbosity=0)
        call_command("lmsp_build_demo_model", if_missing=True, stdout=self.stdout, stderr=self.stderr)
        # The same weights without the EOS head, for generations as long as asked.
        call_command("lmsp_build_demo_model", endless=True, if_missing=True, stdout=self.stdout, stderr=self.stderr)
        if not options["no_token"]:
            path = Path(settings.DATA_DIR) / "local-token"
            kept = path.is_file() and path.stat().st_size > 0
            token = client_local_token_ensure(path=path)
            if token is not None:
                if kept:
                    self.stderr.write(f"prepare: {path} does not belong to this database; created a new client")
                self.stderr.write(f"prepare: a client token for this machine is in {path}:")
                self.stderr.write(token)
        # Before any worker takes work: leftover tasks fail, run again or resume.
        call_command("lmsp_recover", stdout=self.stdout, stderr=self.stderr)


def _database_wait(seconds: float, say: Callable[[str], object]) -> None:
    deadline = time.monotonic() + seconds
    while True:
        try:
            connection.ensure_connection()
            return
        except OperationalError as exc:
            reason = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
            if time.monotonic() > deadline:
                raise CommandError(
                    f"prepare: the database did not accept connections within {seconds:g} s: {reason}"
                ) from None
            say(f"prepare: waiting for the database ({reason})")
            time.sleep(2)
