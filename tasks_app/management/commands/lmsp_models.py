"""lmsp_models scan|list: keep the models table in step with LMSP_MODELS_DIR."""

from __future__ import annotations

from pathlib import Path

from django.core.management.base import BaseCommand, CommandParser

from tasks_app.models import ModelRecord
from tasks_app.services.model_scan import model_scan


class Command(BaseCommand):
    help = "Register the model folders under LMSP_MODELS_DIR (scan) or show the table (list)."

    def add_arguments(self, parser: CommandParser) -> None:
        sub = parser.add_subparsers(dest="action", required=True)
        scan = sub.add_parser("scan", help="register, refresh and drop models")
        scan.add_argument("--dir", type=Path, default=None, help="models folder (default LMSP_MODELS_DIR)")
        sub.add_parser("list", help="list registered models")

    def handle(self, *args, **options) -> None:
        if options["action"] == "scan":
            report = model_scan(models_dir=options["dir"])
            for label, names in (
                ("added", report.added),
                ("updated", report.updated),
                ("unchanged", report.unchanged),
                ("removed", report.removed),
                ("skipped", report.skipped),
            ):
                if names:
                    self.stdout.write(f"{label}: {', '.join(names)}")
            self.stdout.write(f"hashed {report.hashed_files} file(s)")
        else:
            for model in ModelRecord.objects.order_by("name"):
                self.stdout.write(f"{model.name}\t{model.backend}\t{model.size_bytes}\t{model.digest}")
