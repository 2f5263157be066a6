"""Fixtures built once per test run, however many parallel workers (pytest-xdist) the run has."""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
from filelock import FileLock


def run_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The folder the whole run shares: xdist gives each worker a base folder inside it."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


def built_once(tmp_path_factory: pytest.TempPathFactory, name: str, build: Callable[[Path], object]) -> Path:
    """``run_root/built/name``, made by ``build(folder)`` in the first worker that asks; the others wait for it.

    The folder appears only complete (built beside it, then renamed), so a
    worker never sees half of it. It is shared: tests copy it to change it.
    """
    shared = run_root(tmp_path_factory) / "built"
    shared.mkdir(exist_ok=True)
    folder = shared / name
    with FileLock(str(shared / f"{name}.lock")):
        if not folder.exists():
            partial = shared / f"{name}.partial"
            shutil.rmtree(partial, ignore_errors=True)
            partial.mkdir()
            build(partial)
            partial.rename(folder)
    return folder
