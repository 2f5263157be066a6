"""The suite's process starter (``tests.support.preloaded``) starts what ``python -m`` would start.

Its children are the suite's uvicorn servers and Celery workers, so what a child gets must be what a fresh
interpreter gets from the same command line: argv, working directory, environment, streams, session, exit
status, signals; and the libraries it preloads must not carry one test's settings into another's process.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path

import pytest

from tests.support.preloaded import StartedProcess, python_module
from tests.support.waiting import wait_until

pytestmark = pytest.mark.database_free

PROBE = """
import json, os, sys, time
report = {
    "argv": sys.argv[1:],
    "cwd": os.getcwd(),
    "path0": sys.path[0],
    "env": {key: os.environ.get(key) for key in ("PROBE_VALUE", "DJANGO_SETTINGS_MODULE")},
    "preloaded": "celery.bin.celery" in sys.modules and "uvicorn.main" in sys.modules,
    "ours": sorted(name for name in sys.modules if name.split(".")[0] in {"lmsp_project", "tasks_app", "workers"}),
    "session_leader": os.getsid(0) == os.getpid(),
    "name": open(f"/proc/{os.getpid()}/comm").read().strip(),
}
print(json.dumps(report), flush=True)
print("to stderr", file=sys.stderr, flush=True)
if "--sleep" in sys.argv:
    time.sleep(60)
sys.exit(int(sys.argv[1]))
"""


@pytest.fixture
def probe_dir(tmp_path: Path) -> Path:
    (tmp_path / "probe.py").write_text(PROBE)
    return tmp_path


def test_a_child_gets_the_argv_directory_environment_and_streams_it_is_started_with(probe_dir: Path):
    out, err = probe_dir / "out.log", probe_dir / "err.log"
    with out.open("wb") as stdout, err.open("wb") as stderr:
        proc = python_module(
            "probe",
            ["3", "--flag"],
            env={"PROBE_VALUE": "seen", "PATH": os.environ["PATH"]},
            cwd=probe_dir,
            stdout=stdout,
            stderr=stderr,
        )
    assert proc.wait(timeout=60) == 3 and proc.returncode == 3 and proc.poll() == 3
    report = json.loads(out.read_text())
    assert report["argv"] == ["3", "--flag"]
    assert report["cwd"] == report["path0"] == str(probe_dir)
    # The environment is the start's alone: not the test process's settings module, nor the starter's.
    assert report["env"] == {"PROBE_VALUE": "seen", "DJANGO_SETTINGS_MODULE": None}
    if isinstance(proc, StartedProcess):
        assert report["preloaded"] and report["name"] == "lmsp-probe"
    # Nothing of ours before the child's own imports: each reads its own settings.
    assert report["ours"] == []
    assert err.read_text() == "to stderr\n"


def test_a_new_session_child_is_stopped_by_its_group_and_its_signal_comes_back(probe_dir: Path):
    log = probe_dir / "out.log"
    with log.open("wb") as stdout:
        proc = python_module(
            "probe",
            ["0", "--sleep"],
            env={"PATH": os.environ["PATH"]},
            cwd=probe_dir,
            stdout=stdout,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    wait_until(lambda: log.read_text().count("\n") >= 2, what=lambda: f"the probe did not start: {log.read_text()}")
    assert json.loads(log.read_text().splitlines()[0])["session_leader"]
    with pytest.raises(subprocess.TimeoutExpired):
        proc.wait(timeout=0.2)
    assert proc.poll() is None
    os.killpg(proc.pid, signal.SIGKILL)
    assert proc.wait(timeout=60) == -signal.SIGKILL


def test_a_child_that_raises_exits_1_with_its_traceback_on_stderr(probe_dir: Path):
    (probe_dir / "broken.py").write_text("raise RuntimeError('broken on purpose')\n")
    err = probe_dir / "err.log"
    with err.open("wb") as stderr:
        proc = python_module("broken", [], env={"PATH": os.environ["PATH"]}, cwd=probe_dir, stderr=stderr)
    assert proc.wait(timeout=60) == 1
    assert "RuntimeError: broken on purpose" in err.read_text()
