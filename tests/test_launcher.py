"""scripts/quickstart, the README's one command, run as a user runs it.

Each test starts the launcher in its own process group on a free port with
data and models folders of its own (a fresh SQLite file, or a PostgreSQL
database of its own on the PostgreSQL run), lets it build the demo model,
serves a task end to end over HTTP, and stops it the way a terminal's Ctrl-C
or a service manager's SIGTERM does: every process it started must be gone.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import sqlite3
import subprocess
import sys
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from django.conf import settings
from django.db import connection

from tests.support.demo import ENDLESS_MODEL
from tests.support.namespace import REDIS_PREFIX
from tests.support.server import REPO, free_port
from tests.support.waiting import wait_until

pytestmark = pytest.mark.slow

QUICKSTART = REPO / "scripts" / "quickstart"
# Variables of the test run that must not reach the launcher: it derives
# queues from its own prefix, picks its own database, and its worker takes
# the Procfile's default batch.
DROPPED_ENV = (
    "DATABASE_URL",
    "LMSP_TASK_QUEUE",
    "LMSP_MAINTENANCE_QUEUE",
    "LMSP_TEST_SQLITE_PATH",
    "LMSP_MAX_BATCH",
    "LMSP_WORKER_THREADS",
    "LMSP_DRAIN_SECONDS",
)
FINISHED = {"succeeded", "failed", "cancelled"}
# The Celery nodes of the Procfile, as honcho names their output.
NODES = ("worker.1", "beat.1")


def process_lines(log: str, name: str) -> list[str]:
    """honcho's lines (``HH:MM:SS name | text``) of one process."""
    lines = []
    for line in log.splitlines():
        prefix, bar, text = line.partition(" | ")
        if bar and prefix[:2].isdigit() and prefix.split()[-1] == name:
            lines.append(text)
    return lines


def _answers(port: int) -> bool:
    with socket.socket() as sock:
        sock.settimeout(0.5)
        return sock.connect_ex(("127.0.0.1", port)) == 0


def _redis_port(url: str) -> int:
    hostport = url.split("://", 1)[1].split("/", 1)[0].rsplit("@", 1)[-1]
    return int(hostport.rsplit(":", 1)[1]) if ":" in hostport else 6379


@dataclass(frozen=True)
class ProcInfo:
    pid: int
    start_time: str
    cmdline: str


def _stat(pid: int) -> tuple[int, str, str] | None:
    """(parent pid, start time, state) of a process, None when it is gone."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None
    # The command name may hold spaces and parentheses; fields follow the last ")".
    fields = raw[raw.rindex(")") + 2 :].split()
    return int(fields[1]), fields[19], fields[0]


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


def descendants(root: int) -> list[ProcInfo]:
    """Every live process below ``root`` (children, grandchildren, ...)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit() and (stat := _stat(int(entry))) is not None:
            children.setdefault(stat[0], []).append(int(entry))
    found: list[ProcInfo] = []
    todo = list(children.get(root, []))
    while todo:
        pid = todo.pop()
        stat = _stat(pid)
        if stat is not None and stat[2] != "Z":
            found.append(ProcInfo(pid, stat[1], _cmdline(pid)))
        todo.extend(children.get(pid, []))
    return found


def alive(proc: ProcInfo) -> bool:
    """The same process (not a reused pid) still exists and is not a zombie."""
    stat = _stat(proc.pid)
    return stat is not None and stat[1] == proc.start_time and stat[2] != "Z"


@dataclass
class Launcher:
    env: dict[str, str]
    log_path: Path
    data_dir: Path
    proc: subprocess.Popen | None = None
    tokens: list[str] = field(default_factory=list)

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.env['LMSP_PORT']}"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def start(self, *, sigint_ignored: bool = False) -> None:
        """Start it as a terminal does, or (``sigint_ignored``) as a script's ``scripts/quickstart &``:
        a shell without job control starts its background commands with SIGINT ignored."""
        # The ignored SIGINT survives the exec, as it survives the shell's fork and exec.
        command = ["bash", "-c", 'trap "" INT; exec "$0"', str(QUICKSTART)] if sigint_ignored else [str(QUICKSTART)]
        with self.log_path.open("ab") as log:
            self.proc = subprocess.Popen(
                command,
                cwd=REPO,
                env=self.env,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )

        def api_answers() -> bool:
            if self.proc.poll() is not None:
                raise RuntimeError(f"quickstart exited ({self.proc.returncode}):\n{self.log()[-6000:]}")
            try:
                with urllib.request.urlopen(self.base + "/lmsp/v1/capabilities", timeout=2):
                    return True
            except OSError:
                return False

        wait_until(api_answers, what=lambda: f"the API never answered:\n{self.log()[-6000:]}", timeout=120)
        wait_until(
            lambda: all(any("ready." in line for line in process_lines(self.log(), name)) for name in NODES),
            what=lambda: f"the worker and the maintenance node never became ready:\n{self.log()[-6000:]}",
            timeout=60,
        )

    @property
    def token(self) -> str:
        return (self.data_dir / "local-token").read_text().strip()

    def call(self, method: str, path: str, body: Any = None, headers: dict[str, str] | None = None) -> dict[str, Any]:
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(
            self.base + path,
            data=data,
            method=method,
            headers={"Authorization": f"Bearer {self.token}", "Content-Type": "application/json", **(headers or {})},
        )
        with urllib.request.urlopen(request, timeout=30) as reply:
            return json.loads(reply.read())

    def create(self, *, tokens: int, policy: str = "fail") -> str:
        headers = {"Idempotency-Key": str(uuid.uuid4())}
        body = {
            "type": "response",
            "input": {"model": ENDLESS_MODEL, "input": "Hello", "max_output_tokens": tokens},
            "on_restart": policy,
        }
        return self.call("POST", "/lmsp/v1/tasks", body, headers)["id"]

    def task(self, task_id: str) -> dict[str, Any]:
        return self.call("GET", f"/lmsp/v1/tasks/{task_id}")

    def wait_for(self, task_id: str, statuses: set[str]) -> dict[str, Any]:
        def probe() -> dict[str, Any] | None:
            task = self.task(task_id)
            return task if task["status"] in statuses else None

        return wait_until(probe, what=lambda: f"task {task_id} never reached {statuses}:\n{self.log()[-4000:]}")

    def stop(self, sig: signal.Signals, *, group: bool) -> list[ProcInfo]:
        """Send ``sig`` (to the launcher's process group, as a terminal's Ctrl-C does, or
        to its pid alone, as ``kill`` does); wait for it to exit; return what it had started."""
        started = descendants(self.proc.pid)
        if group:
            os.killpg(self.proc.pid, sig)
        else:
            os.kill(self.proc.pid, sig)
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"quickstart did not exit on {sig.name}:\n{self.log()[-6000:]}") from None
        return started

    def kill(self) -> None:
        """Clean-up after a failed test: nothing of the launcher may outlive it."""
        if self.proc is None:
            return
        leftovers = descendants(self.proc.pid) if self.proc.poll() is None else []
        for pgid in {os.getpgid(p.pid) for p in leftovers if alive(p)} | {self.proc.pid}:
            try:
                os.killpg(pgid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        self.proc.wait()
        pidfile = self.data_dir / "quickstart-redis.pid"
        if pidfile.exists():
            try:
                os.kill(int(pidfile.read_text()), signal.SIGKILL)
            except (ProcessLookupError, ValueError):
                pass


@pytest.fixture
def launcher_database() -> Iterator[str | None]:
    """None on the SQLite run (the launcher makes a fresh file in its data folder);
    on PostgreSQL a database of the launcher's own, dropped afterwards."""
    if connection.vendor != "postgresql":
        yield None
        return
    import psycopg

    sd = settings.DATABASES["default"]
    name = f"{sd['NAME']}_quickstart_{os.getpid()}"
    params = {
        "host": sd.get("HOST") or "127.0.0.1",
        "port": sd.get("PORT") or 5432,
        "user": sd.get("USER") or None,
        "password": sd.get("PASSWORD") or None,
        "dbname": "postgres",
        "autocommit": True,
    }
    with psycopg.connect(**params) as admin:
        admin.execute(f'DROP DATABASE IF EXISTS "{name}"')
        admin.execute(f'CREATE DATABASE "{name}"')
    auth = sd.get("USER") or ""
    if sd.get("PASSWORD"):
        auth += f":{sd['PASSWORD']}"
    try:
        yield f"postgres://{auth}@{params['host']}:{params['port']}/{name}"
    finally:
        with psycopg.connect(**params) as admin:
            admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.fixture
def launcher(tmp_path: Path, launcher_database: str | None, request: pytest.FixtureRequest) -> Iterator[Launcher]:
    env = {key: value for key, value in os.environ.items() if key not in DROPPED_ENV}
    env.update(
        {
            "LMSP_HOST": "127.0.0.1",
            "LMSP_PORT": str(free_port()),
            "LMSP_DATA_DIR": str(tmp_path / "data"),
            "LMSP_MODELS_DIR": str(tmp_path / "models"),
            "LMSP_REDIS_PREFIX": f"{REDIS_PREFIX}-qs-{request.node.name}",
            "REDIS_URL": settings.REDIS_URL,
            "LMSP_RECOVER_INSPECT_SECONDS": "0.5",
        }
    )
    if launcher_database:
        env["DATABASE_URL"] = launcher_database
    started = Launcher(env=env, log_path=tmp_path / "quickstart.log", data_dir=tmp_path / "data")
    try:
        yield started
    finally:
        started.kill()


def task_row(launcher: Launcher, task_id: str) -> dict[str, Any]:
    """The task as stored (the API shows no attempts, and none answers while the launcher is stopped)."""
    url = launcher.env.get("DATABASE_URL")
    query = "SELECT status, error, attempts FROM tasks WHERE id = {}"
    if url is None:
        db = sqlite3.connect(launcher.data_dir / "lmsp.sqlite3")
        try:
            status, error, attempts = db.execute(query.format("?"), (task_id,)).fetchone()
        finally:
            db.close()
    else:
        import psycopg

        with psycopg.connect(url.replace("postgres://", "postgresql://", 1)) as db:
            status, error, attempts = db.execute(query.format("%s"), (task_id,)).fetchone()
    if isinstance(error, str):
        error = json.loads(error)
    return {"status": status, "error": error, "attempts": attempts}


def serve_one_task(launcher: Launcher) -> None:
    """A task on the demo model, end to end over HTTP, run by the Procfile's worker."""
    task_id = launcher.create(tokens=12)
    task = launcher.wait_for(task_id, FINISHED)
    assert task["status"] == "succeeded", task
    text = "".join(part.get("text", "") for item in task["response"]["output"] for part in item.get("content") or [])
    assert text
    wait_until(
        lambda: any(f"task {task_id} claimed by" in line for line in process_lines(launcher.log(), "worker.1")),
        what=lambda: f"no worker.1 line about {task_id}:\n{launcher.log()[-4000:]}",
    )


def assert_prefixed_logs(log: str) -> None:
    """Each Procfile process's own output reaches the terminal under its name."""
    assert any("Uvicorn running on" in line for line in process_lines(log, "web.1")), log[-4000:]
    for name in NODES:
        assert any("ready." in line for line in process_lines(log, name)), (name, log[-4000:])
    assert any("web.1 started" in line for line in process_lines(log, "system")), log[-4000:]


# Set before a start: each model call waits 2 ms (tasks_app.faults), so 3,000 tokens take at least
# 6 s and a long task is still generating when the test stops the launcher (right after it saw it
# running), however fast the machine.
# 3,000 tokens at 5 ms a model call: the long task is still generating 15 s later, whatever else the
# test does meanwhile (at 2 ms it could end during a busy machine's lmsp_recover subprocess).
SLOW_DEVICE = {"LMSP_FAULT_MODEL_CALL_SECONDS": "0.005"}


def start_long_task(launcher: Launcher, policy: str) -> str:
    """A task that is generating when the test stops the launcher (started with ``SLOW_DEVICE``)."""
    task_id = launcher.create(tokens=3000, policy=policy)
    task = launcher.wait_for(task_id, {"running"} | FINISHED)
    assert task["status"] == "running", task
    return task_id


def assert_one_line_per_interrupted_task(launcher: Launcher, task_id: str, outcome: str) -> None:
    """Stopping during a generation: one plain line about the task from the worker, no traceback anywhere."""
    log = launcher.log()
    assert "Traceback" not in log, log[-6000:]
    lines = [line for line in process_lines(log, "worker.1") if task_id in line and "interrupted by shutdown" in line]
    assert len(lines) == 1, (lines, log[-6000:])
    assert lines[0].endswith(f"task {task_id} interrupted by shutdown; {outcome}"), lines


def assert_all_gone(started: list[ProcInfo], launcher: Launcher) -> None:
    wait_until(
        lambda: not [p for p in started if alive(p)],
        what=lambda: f"left running: {[p.cmdline for p in started if alive(p)]}\n{launcher.log()[-4000:]}",
        timeout=15,
    )


def test_quickstart_serves_a_task_and_ctrl_c_stops_everything_with_its_own_redis(launcher: Launcher):
    # Nothing answers on this port: the launcher starts a redis-server of its own.
    redis_port = free_port()
    launcher.env["REDIS_URL"] = f"redis://127.0.0.1:{redis_port}/0"
    launcher.env.update(SLOW_DEVICE)
    launcher.start()
    assert "ensure-redis: started redis-server" in launcher.log()
    # The demo model was missing: the launcher built and registered it.
    assert "registered demo" in launcher.log()
    assert (Path(launcher.env["LMSP_MODELS_DIR"]) / "demo" / "model.onnx").is_file()
    assert "lmsp_recover: live workers: none" in launcher.log()

    serve_one_task(launcher)
    assert_prefixed_logs(launcher.log())
    # One access line per request (uvicorn's own access log is off).
    access = [line for line in process_lines(launcher.log(), "web.1") if "lmsp.access: POST /lmsp/v1/tasks 202" in line]
    assert len(access) == 1, launcher.log()[-4000:]
    # The address it printed answers with the way in.
    with urllib.request.urlopen(launcher.base + "/lmsp/v1", timeout=10) as reply:
        assert json.loads(reply.read())["links"]["docs"] == launcher.base + "/lmsp/v1/docs"
    long_task = start_long_task(launcher, "fail")

    redis_pid = int((launcher.data_dir / "quickstart-redis.pid").read_text())
    redis_stat = _stat(redis_pid)
    started = launcher.stop(signal.SIGINT, group=True)
    commands = " ".join(p.cmdline for p in started)
    # The worker's task threads (LMSP_WORKER_THREADS, 4 by default) start its rows (as its KV budget holds).
    assert "uvicorn" in commands and "--pool threads --concurrency 4" in commands and "--beat" in commands
    assert launcher.proc.returncode == 130
    assert_all_gone([*started, ProcInfo(redis_pid, redis_stat[1], "redis-server")], launcher)
    assert not _answers(redis_port)
    assert "SIGINT received" in launcher.log()
    assert "quickstart: stopping the redis-server it started" in launcher.log()
    # The generation cut short ended as its policy says, right away.
    row = task_row(launcher, long_task)
    assert row["status"] == "failed" and row["error"]["code"] == "server_restarted", row
    assert_one_line_per_interrupted_task(launcher, long_task, "on_restart=fail: it failed (server_restarted)")


# Signals and processes, which no database changes (the quick start on PostgreSQL: the Ctrl-C test; the
# rerun at the next start is recovery's, tested on both): the SQLite pass only.
@pytest.mark.sqlite_pass
def test_quickstart_stops_on_sigterm_and_the_next_start_reruns_the_interrupted_task(launcher: Launcher):
    redis_port = _redis_port(launcher.env["REDIS_URL"])
    launcher.env.update(SLOW_DEVICE)
    launcher.start()
    assert "ensure-redis: started" not in launcher.log()
    serve_one_task(launcher)
    long_task = start_long_task(launcher, "retry")

    started = launcher.stop(signal.SIGTERM, group=False)
    assert launcher.proc.returncode == 143
    assert_all_gone(started, launcher)
    # A Redis it did not start is left alone.
    assert _answers(redis_port)
    first_token = launcher.token
    interrupted = task_row(launcher, long_task)

    # Its policy (retry) put it back in the queue at once; the next start runs it again.
    assert interrupted["status"] == "queued" and interrupted["attempts"] == 1, interrupted
    assert_one_line_per_interrupted_task(
        launcher,
        long_task,
        "on_restart=retry: it is queued again and runs anew at the next start (or on another running worker)",
    )

    for name in SLOW_DEVICE:
        del launcher.env[name]  # the rerun goes at full speed
    launcher.start()
    assert launcher.token == first_token  # the client of the first start is still good
    task = launcher.wait_for(long_task, FINISHED)
    assert task["status"] == "succeeded", task
    assert task_row(launcher, long_task)["attempts"] == 2
    started = launcher.stop(signal.SIGTERM, group=False)
    assert_all_gone(started, launcher)


def test_quickstart_without_redis_says_how_to_get_it(tmp_path: Path):
    # A PATH with everything but redis-server.
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for directory in os.environ.get("PATH", "").split(os.pathsep):
        if not os.path.isdir(directory):
            continue
        for name in os.listdir(directory):
            target = bin_dir / name
            if name != "redis-server" and not target.exists():
                target.symlink_to(os.path.join(directory, name))
    assert shutil.which("redis-server", path=str(bin_dir)) is None
    env = {key: value for key, value in os.environ.items() if key not in DROPPED_ENV}
    env.update(
        {
            "PATH": str(bin_dir),
            "REDIS_URL": f"redis://127.0.0.1:{free_port()}/0",
            "LMSP_DATA_DIR": str(tmp_path / "data"),
            "LMSP_MODELS_DIR": str(tmp_path / "models"),
        }
    )
    done = subprocess.run(
        [str(QUICKSTART)], cwd=REPO, env=env, capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL
    )
    assert done.returncode != 0
    assert "redis-server is not installed" in done.stderr
    assert "apt-get install redis-server" in done.stderr and "brew install redis" in done.stderr
    # It stopped before touching anything: no database, no model.
    assert not (tmp_path / "data" / "lmsp.sqlite3").exists()
    assert not (tmp_path / "models").exists()


def another_shell_env(data_dir: Path) -> dict[str, str]:
    """A second terminal's environment: none of the launcher's settings but where its data is,
    and not under pytest (manage.py leaves the file alone for the tests' own commands)."""
    env = {
        key: value
        for key, value in os.environ.items()
        if not key.startswith(("LMSP_", "PYTEST_")) and key not in {"DATABASE_URL", "REDIS_URL", "CELERY_BROKER_URL"}
    }
    env["LMSP_DATA_DIR"] = str(data_dir)
    return env


# Signals and processes, which no database changes (the quick start on PostgreSQL: the Ctrl-C test; the
# rerun at the next start is recovery's, tested on both): the SQLite pass only.
@pytest.mark.sqlite_pass
def test_a_background_quickstart_stops_on_sigint_by_pid_and_manage_py_elsewhere_uses_its_settings(
    launcher: Launcher,
):
    # `scripts/quickstart &` from a script: SIGINT ignored on entry; with a Redis of its own.
    launcher.env["REDIS_URL"] = f"redis://127.0.0.1:{free_port()}/0"
    launcher.env.update(SLOW_DEVICE)
    launcher.start(sigint_ignored=True)
    long_task = start_long_task(launcher, "resume")

    # Another shell, with none of the variables exported: manage.py takes the
    # quick start's settings from its file, so it sees this installation.
    env_file = launcher.data_dir / "quickstart.env"
    assert env_file.stat().st_mode & 0o077 == 0
    done = subprocess.run(
        [sys.executable, "manage.py", "lmsp_recover"],
        cwd=REPO,
        # What that shell does set wins over the file.
        env={**another_shell_env(launcher.data_dir), "LMSP_RECOVER_INSPECT_SECONDS": "3"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert f"from {env_file} (the quick start's settings)" in done.stderr
    assert f"lmsp_recover: live workers: worker-{launcher.env['LMSP_REDIS_PREFIX']}@" in done.stdout, done.stdout
    assert "lmsp_recover: held by a live worker: 1" in done.stdout, done.stdout

    started = launcher.stop(signal.SIGINT, group=False)
    assert launcher.proc.returncode == 130
    assert_all_gone(started, launcher)
    assert "quickstart: stopping the redis-server it started" in launcher.log()
    row = task_row(launcher, long_task)
    assert row["status"] == "running", row  # waiting to be resumed by the next start
    assert_one_line_per_interrupted_task(
        launcher, long_task, "on_restart=resume: it resumes at the next start (or on another running worker)"
    )


SETTINGS_PROBE = "from django.conf import settings; print(settings.LMSP_REDIS_PREFIX, settings.LMSP_TASK_QUEUE)"


def test_only_manage_py_reads_the_quickstart_settings_and_only_what_the_shell_does_not_set(tmp_path: Path):
    data_dir = tmp_path / "data"
    data_dir.mkdir()
    env_file = data_dir / "quickstart.env"
    env_file.write_text("# a comment\nLMSP_REDIS_PREFIX=from-the-file\nLMSP_TASK_QUEUE=queue-from-the-file\n")
    shell = {**another_shell_env(data_dir), "LMSP_TASK_QUEUE": "my-queue"}

    def probe(command: list[str], env: dict[str, str]) -> tuple[list[str], str]:
        """The settings the command saw (its last line) and its stderr."""
        done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr
        return done.stdout.strip().splitlines()[-1].split(), done.stderr

    seen, stderr = probe([sys.executable, "manage.py", "shell", "-c", SETTINGS_PROBE], shell)
    assert seen == ["from-the-file", "my-queue"]
    assert f"manage.py: LMSP_REDIS_PREFIX from {env_file} (the quick start's settings)" in stderr
    # A manage.py that a test starts, and the settings themselves (pytest, celery, uvicorn) never read it.
    seen, stderr = probe(
        [sys.executable, "manage.py", "shell", "-c", SETTINGS_PROBE], {**shell, "PYTEST_CURRENT_TEST": "x"}
    )
    assert seen == ["lmsp", "my-queue"]
    assert "quickstart.env" not in stderr
    django_only = f"import django; django.setup(); {SETTINGS_PROBE}"
    seen, _ = probe([sys.executable, "-c", django_only], {**shell, "DJANGO_SETTINGS_MODULE": "lmsp_project.settings"})
    assert seen == ["lmsp", "my-queue"]
