#!/usr/bin/env python
"""Django's command-line utility for the LMSP service."""

import os
import sys
from pathlib import Path

QUICKSTART_ENV = "quickstart.env"


def quickstart_settings_load() -> None:
    """Fill the variables this shell does not set from the last quick start's settings.

    ``scripts/quickstart`` writes what it resolved to
    ``$LMSP_DATA_DIR/quickstart.env``; without it, a command run from another
    shell would quietly use the defaults (another database, another Redis
    prefix: ``lmsp_recover`` would see no live worker). Only manage.py reads
    the file: the processes the quick start runs get its environment, and the
    tests configure themselves (a manage.py they start leaves it alone too).
    """
    if "PYTEST_CURRENT_TEST" in os.environ:
        return
    data_dir = Path(os.environ.get("LMSP_DATA_DIR") or "data")
    if not data_dir.is_absolute():
        data_dir = Path(__file__).resolve().parent / data_dir
    path = data_dir / QUICKSTART_ENV
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return
    taken = []
    for line in lines:
        name, equals, value = line.partition("=")
        if equals and not name.startswith("#") and name not in os.environ:
            os.environ[name] = value
            taken.append(name)
    if taken:
        print(f"manage.py: {', '.join(taken)} from {path} (the quick start's settings)", file=sys.stderr)


def main() -> None:
    quickstart_settings_load()
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "lmsp_project.settings")
    from django.core.management import execute_from_command_line

    execute_from_command_line(sys.argv)


if __name__ == "__main__":
    main()
