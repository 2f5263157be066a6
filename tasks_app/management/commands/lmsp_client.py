"""lmsp_client create|list|revoke: manage API clients."""

from __future__ import annotations

from django.core.management.base import BaseCommand, CommandError, CommandParser

from tasks_app.exceptions import LmspError
from tasks_app.models import Client
from tasks_app.services.clients import client_create, client_revoke


class Command(BaseCommand):
    # Django's system checks (models, admin, URLs) import every view: half a second of a 1 s command on a slow
    # machine. They check the code, not the installation: lmsp_prepare and `manage.py check` run them.
    requires_system_checks: list[str] = []

    help = "Create, list or revoke API clients. `create` prints only the token on stdout."

    def add_arguments(self, parser: CommandParser) -> None:
        sub = parser.add_subparsers(dest="action", required=True)
        create = sub.add_parser("create", help="create a client and print its token once")
        create.add_argument("name")
        create.add_argument("--scopes", default="responses,read", help="comma-separated: responses,read,admin")
        sub.add_parser("list", help="list clients")
        revoke = sub.add_parser("revoke", help="revoke a client's token")
        revoke.add_argument("name")

    def handle(self, *args, **options) -> None:
        action = options["action"]
        if action == "create":
            try:
                client, token = client_create(name=options["name"], scopes=options["scopes"])
            except LmspError as error:
                raise CommandError(error.detail) from None
            # stdout carries the token alone, so `TOKEN=$(... create x)` works.
            self.stdout.write(token)
            self.stderr.write(f"created client {client.name!r} with scopes {','.join(client.scopes)}")
        elif action == "list":
            for client in Client.objects.order_by("created_at"):
                state = f"revoked {client.revoked_at:%Y-%m-%d %H:%M}" if client.revoked_at else "active"
                used = f"{client.last_used_at:%Y-%m-%d %H:%M}" if client.last_used_at else "never"
                self.stdout.write(f"{client.name}\t{','.join(client.scopes)}\t{state}\tlast used {used}")
        elif action == "revoke":
            client = client_revoke(name=options["name"])
            if client is None:
                raise CommandError(f"no active client named {options['name']!r}")
            self.stderr.write(f"revoked client {client.name!r}")
