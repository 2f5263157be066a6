"""A throwaway Django setup for the in-process benchmarks: a temp dir, a fresh database, migrated.

Each benchmark calls :func:`django_in_scratch` before importing anything of
the project; its Redis keys live under their own prefix (``lmsp-bench-<pid>``).
"""

from __future__ import annotations

import atexit
import os
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def django_in_scratch(name: str, *, database_url: str | None = None, env: dict[str, str] | None = None) -> Path:
    """Point Django at a new temp dir (and a new SQLite file there unless ``database_url``), set it up, migrate."""
    scratch = Path(tempfile.mkdtemp(prefix=f"lmsp-{name}-bench-"))
    prefix = f"lmsp-bench-{os.getpid()}"
    os.environ.update(
        {
            "DJANGO_SETTINGS_MODULE": "lmsp_project.settings",
            "DATABASE_URL": database_url or f"sqlite:///{scratch / 'bench.sqlite3'}",
            "LMSP_DATA_DIR": str(scratch),
            "LMSP_MODELS_DIR": str(scratch / "models"),
            "LMSP_REDIS_PREFIX": prefix,
            "LMSP_TASK_QUEUE": f"{prefix}-idle",
            "LMSP_LOG_LEVEL": "WARNING",
            # Django's test client, which the in-process benches use, sends Host: testserver.
            "LMSP_ALLOWED_HOSTS": "testserver,localhost,127.0.0.1",
            **(env or {}),
        }
    )
    sys.path.insert(0, str(REPO))
    import django

    django.setup()
    from django.core.management import call_command

    call_command("migrate", verbosity=0)
    atexit.register(_redis_namespace_drop, prefix)
    return scratch


def _redis_namespace_drop(prefix: str) -> None:
    """Leave nothing of the bench in Redis: its keys and queues, and kombu's bindings of its queues."""
    try:
        from tasks_app.plumbing.notify import redis_client

        client = redis_client()
        for pattern in (f"{prefix}*", f"_kombu.binding.{prefix}*"):
            for key in client.scan_iter(match=pattern, count=1000):
                client.delete(key)
    except Exception as exc:  # a bench's cleanup must not hide its figures
        print(f"could not clean the bench's Redis keys: {exc}", file=sys.stderr)


def demo_model_register(scratch: Path) -> None:
    """Build the never-ending demo model as ``demo`` under ``scratch/models`` and register it (on any commit)."""
    try:
        from fixture_models.demo import build_demo_model
        from tasks_app.registry.scan import model_scan
    except ImportError:  # before issue 13 gave the builders and the scan their own names
        from tasks_app.services.models import model_scan  # type: ignore[no-redef]
        from workers.demo_model import build_demo_model  # type: ignore[no-redef]

    try:
        # Generations that run to max_output_tokens, as before the demo model learnt to end by itself.
        build_demo_model(scratch / "models" / "demo", size="demo", endless=True)
    except TypeError:  # a commit whose demo model never ends anyway
        build_demo_model(scratch / "models" / "demo", size="demo")
    model_scan(models_dir=scratch / "models")
