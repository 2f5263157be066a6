"""What a newcomer runs first: the README's shell examples and the requirements, on every supported platform."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest
from packaging.requirements import Requirement

from tests.support.server import REPO

# No database of the pass here: the PostgreSQL pass of scripts/test leaves these out (tests/conftest.py).
pytestmark = pytest.mark.database_free

DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
# What a command substitution in an example may run: on every minimal
# Debian/Ubuntu (coreutils, and the python3 the project needs anyway), or the
# tool the example is about. `uuidgen` is not there: the header it fills
# would silently disappear.
PRESENT_EVERYWHERE = {"basename", "cat", "date", "python3", "docker"}
UUID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}")
# (sys_platform, platform_machine) -> the ONNX Runtime build that has wheels there (checked on PyPI for 1.31.1).
ONNX_RUNTIME_BUILDS = {
    ("linux", "x86_64"): "onnxruntime-gpu",
    ("linux", "aarch64"): "onnxruntime-gpu",
    ("win32", "AMD64"): "onnxruntime-gpu",
    ("darwin", "arm64"): "onnxruntime",
}


def substitutions(text: str) -> list[str]:
    """Every ``$(...)`` in the text, with nested parentheses."""
    found = []
    for start in (m.start() for m in re.finditer(r"\$\(", text)):
        depth = 0
        for end in range(start + 1, len(text)):
            depth += {"(": 1, ")": -1}.get(text[end], 0)
            if depth == 0:
                found.append(text[start : end + 1])
                break
    return found


@pytest.mark.parametrize("doc", DOCS, ids=lambda path: path.name)
def test_examples_substitute_only_commands_every_machine_has(doc: Path):
    commands = {sub[2:-1].split()[0] for sub in substitutions(doc.read_text(encoding="utf-8"))}
    assert commands <= PRESENT_EVERYWHERE, commands - PRESENT_EVERYWHERE


def test_the_readmes_idempotency_key_example_makes_a_uuid():
    [line] = [line for line in (REPO / "README.md").read_text().splitlines() if "Idempotency-Key: $(" in line]
    [command] = substitutions(line)

    done = subprocess.run(["bash", "-c", f'printf %s "{command}"'], capture_output=True, text=True, timeout=30)

    assert done.returncode == 0 and done.stderr == "", done.stderr
    assert UUID.fullmatch(done.stdout), done.stdout


def requirements() -> list[Requirement]:
    lines = (REPO / "requirements.txt").read_text().splitlines()
    return [Requirement(line) for line in (line.split("#")[0].strip() for line in lines) if line]


@pytest.mark.parametrize(("platform", "machine"), sorted(ONNX_RUNTIME_BUILDS))
def test_requirements_pick_the_onnx_runtime_build_that_has_wheels(platform: str, machine: str):
    environment = {"sys_platform": platform, "platform_machine": machine, "platform_system": platform.title()}
    chosen = [req for req in requirements() if req.marker is None or req.marker.evaluate(environment)]

    runtimes = [req for req in chosen if req.name.startswith("onnxruntime")]

    assert [req.name for req in runtimes] == [ONNX_RUNTIME_BUILDS[platform, machine]]
    assert all(str(req.specifier).startswith("==") for req in chosen)
    assert len({str(req.specifier) for req in requirements() if req.name.startswith("onnxruntime")}) == 1
