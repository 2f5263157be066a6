"""lmsp_build_demo_model: write the deterministic demo model and register it."""

from __future__ import annotations

import tempfile
from pathlib import Path

from django.conf import settings
from django.core.management.base import BaseCommand, CommandParser

from fixture_models.demo import DEMO_SIZES, build_demo_model
from tasks_app.registry.scan import model_scan

ENDLESS = "endless"


def demo_model_name(size: str, *, endless: bool) -> tuple[str, Path]:
    """The name a demo model registers as, and its folder under LMSP_MODELS_DIR.

    The default size is ``demo``; another registers as ``demo:<size>``, the
    endless variant as ``demo:endless`` (``demo:<size>-endless``).
    """
    tag = "" if size == "demo" else size
    if endless:
        tag = f"{tag}-{ENDLESS}" if tag else ENDLESS
    folder = settings.LMSP_MODELS_DIR / "demo"
    return (f"demo:{tag}", folder / tag) if tag else ("demo", folder)


def _is_current(folder: Path, size: str, endless: bool) -> bool:
    """Whether ``folder`` holds exactly what this version of the builder writes (the build is deterministic)."""
    if not (folder / "model.onnx").is_file():
        return False
    with tempfile.TemporaryDirectory() as scratch:
        fresh = build_demo_model(Path(scratch), size=size, endless=endless)
        return all(
            (folder / path.name).is_file() and (folder / path.name).read_bytes() == path.read_bytes() for path in fresh
        )


class Command(BaseCommand):
    help = "Build the demo ONNX model (no download) into LMSP_MODELS_DIR and register it."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--size", choices=sorted(DEMO_SIZES), default="demo")
        parser.add_argument(
            "--endless", action="store_true", help="the variant that never ends by itself (demo:endless)"
        )
        parser.add_argument(
            "--if-missing",
            action="store_true",
            help="do nothing when the folder already holds this model (one an older version built is replaced)",
        )

    def handle(self, *args, **options) -> None:
        size, endless = options["size"], options["endless"]
        name, folder = demo_model_name(size, endless=endless)
        if options["if_missing"] and _is_current(folder, size, endless):
            self.stdout.write(f"{name} already present in {folder}")
        else:
            paths = build_demo_model(folder, size=size, endless=endless)
            self.stdout.write(f"wrote {len(paths)} files to {folder}")
        report = model_scan()
        if name in report.added or name in report.updated or name in report.unchanged:
            self.stdout.write(f"registered {name}")
