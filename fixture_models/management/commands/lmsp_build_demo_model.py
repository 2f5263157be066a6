"""lmsp_build_demo_model: write the deterministic demo model and register it."""

from __future__ import annotations

from django.conf import settings
from django.core.management.base import BaseCommand, CommandParser

from fixture_models.demo import DEMO_SIZES, build_demo_model
from tasks_app.services.model_scan import model_scan


class Command(BaseCommand):
    help = "Build the demo ONNX model (no download) into LMSP_MODELS_DIR and register it."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--size", choices=sorted(DEMO_SIZES), default="demo")
        parser.add_argument("--if-missing", action="store_true", help="do nothing when the folder has a model")

    def handle(self, *args, **options) -> None:
        size = options["size"]
        # The default size is `demo`; others register as `demo:<size>`.
        folder = settings.LMSP_MODELS_DIR / "demo"
        if size != "demo":
            folder = folder / size
        name = "demo" if size == "demo" else f"demo:{size}"
        if options["if_missing"] and (folder / "model.onnx").is_file():
            self.stdout.write(f"{name} already present in {folder}")
        else:
            paths = build_demo_model(folder, size=size)
            self.stdout.write(f"wrote {len(paths)} files to {folder}")
        report = model_scan()
        if name in report.added or name in report.updated or name in report.unchanged:
            self.stdout.write(f"registered {name}")
