"""lmsp_models scan|list|pull: keep the models table in step with LMSP_MODELS_DIR; pull from Hugging Face."""

from __future__ import annotations

from pathlib import Path

from django.core.management.base import BaseCommand, CommandError, CommandParser

from tasks_app.models import ModelRecord
from tasks_app.registry.scan import model_scan


class Command(BaseCommand):
    # Django's system checks (models, admin, URLs) import every view: half a second of a 1 s command on a slow
    # machine. They check the code, not the installation: lmsp_prepare and `manage.py check` run them.
    requires_system_checks: list[str] = []

    help = (
        "Register the model folders under LMSP_MODELS_DIR (scan), show the table (list), "
        "or download one model of a Hugging Face repository and register it (pull)."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        sub = parser.add_subparsers(dest="action", required=True)
        scan = sub.add_parser("scan", help="register, refresh and drop models")
        scan.add_argument("--dir", type=Path, default=None, help="models folder (default LMSP_MODELS_DIR)")
        sub.add_parser("list", help="list registered models")
        pull = sub.add_parser("pull", help="download one model of a Hugging Face repository and register it")
        pull.add_argument("repo", help="repository id, e.g. onnx-community/Qwen2.5-0.5B-Instruct")
        pull.add_argument("--variant", default=None, help="the graph onnx/model_<variant>.onnx (default: model.onnx)")
        pull.add_argument("--revision", default=None, help="branch, tag or commit (default: main)")
        pull.add_argument("--name", default=None, help="model name (default: the repository's name)")
        pull.add_argument("--subfolder", default=None, help="the model's folder inside the repository")
        pull.add_argument("--dir", type=Path, default=None, help="models folder (default LMSP_MODELS_DIR)")

    def handle(self, *args, **options) -> None:
        if options["action"] == "pull":
            self._pull(options)
        elif options["action"] == "scan":
            try:
                report = model_scan(models_dir=options["dir"])
            except OSError as exc:
                raise CommandError(f"cannot read the models folder: {exc}") from None
            for label, names in (
                ("added", report.added),
                ("updated", report.updated),
                ("unchanged", report.unchanged),
                ("removed", report.removed),
            ):
                if names:
                    self.stdout.write(f"{label}: {', '.join(names)}")
            # What is not a model is reported, one line each, and the scan still succeeds.
            for where, message in report.problems:
                self.stdout.write(f"skipped {where}: {message}")
            self.stdout.write(f"hashed {report.hashed_files} file(s)")
        else:
            for model in ModelRecord.objects.order_by("name"):
                self.stdout.write(
                    f"{model.name}\t{model.backend}\t{model.size_bytes}\t{model.digest}\t{model.layout}\t{model.graph}"
                )

    def _pull(self, options: dict) -> None:
        # huggingface_hub loads for a pull only (it reads HF_* variables at import).
        from tasks_app.exceptions import ModelPullFailed
        from tasks_app.registry.pull import model_pull

        try:
            result = model_pull(
                repo=options["repo"],
                variant=options["variant"],
                revision=options["revision"],
                name=options["name"],
                subfolder=options["subfolder"],
                models_dir=options["dir"],
                echo=self.stdout.write,
            )
        except ModelPullFailed as exc:
            raise CommandError(str(exc)) from None
        except KeyboardInterrupt:
            raise CommandError("interrupted: run the same command again to resume the download") from None
        self.stdout.write(f"registered {result.name} ({result.graph}, {result.repo}@{result.commit[:12]})")
