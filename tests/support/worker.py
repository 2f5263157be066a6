"""Real Celery worker processes (and a private Redis) for the tests."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import redis

from tests.support.preloaded import StartedProcess, python_module
from tests.support.server import REPO, free_port
from tests.support.waiting import wait_until


@dataclass
class WorkerProcess:
    proc: subprocess.Popen | StartedProcess
    log_path: Path
    queue: str

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_for_log(self, needle: str, timeout: float = 60) -> None:
        def probe() -> bool:
            if self.proc.poll() is not None:
                raise RuntimeError(f"celery worker exited ({self.proc.returncode}):\n{self.log()[-4000:]}")
            return needle in self.log()

        wait_until(probe, what=lambda: f"{needle!r} not in the worker log:\n{self.log()[-4000:]}", timeout=timeout)


@contextmanager
def celery_worker(
    *,
    env: dict[str, str],
    queue: str,
    log_path: Path,
    beat: bool = False,
    name: str = "test",
    concurrency: int = 1,
    maintenance: bool | None = None,
    pool: str = "prefork",
) -> Iterator[WorkerProcess]:
    """``celery worker`` on ``queue``, started as the README starts it.

    ``pool`` "prefork" (the default, so that a crash test's SIGKILL of the
    child keeps its meaning): ``concurrency`` child processes; "threads" (the
    Procfile's batched worker): one process whose ``concurrency`` task threads
    share its engine. With ``beat`` it also runs beat and, unless
    ``maintenance`` is False, consumes the maintenance queue (sweeper, reaper,
    cleanup) beside ``queue``.
    """
    if pool not in {"prefork", "threads"}:
        raise ValueError(f"pool must be prefork or threads, got {pool!r}")
    queues = [queue]
    if maintenance or (maintenance is None and beat):
        queues.append(maintenance_queue(queue))
    command = [
        "-A",
        "lmsp_project",
        "worker",
        "--pool",
        pool,
        "--concurrency",
        str(concurrency),
        "--queues",
        ",".join(queues),
        "--hostname",
        f"{name}@%h",
        "--loglevel",
        "INFO",
        "--without-mingle",
        "--without-gossip",
    ]
    if beat:
        command += ["--beat", "--schedule", str(log_path.with_suffix(".beat"))]
    with log_path.open("ab") as log:
        # Forked from the test process's starter (tests/support/preloaded.py): ``python -m celery`` with
        # this command line, without the 1.3 s of CPU a fresh interpreter spends importing Celery and Django.
        proc = python_module(
            "celery",
            command,
            cwd=REPO,
            # CELERY_SKIP_CHECKS: Celery's Django fixup runs the system checks at every worker start (a fifth of
            # its 0.6 s of CPU); .ci/run runs them once (manage.py check), and the suite starts ~140 workers.
            env={**os.environ, "LMSP_TASK_QUEUE": queue, "CELERY_SKIP_CHECKS": "1", **env},
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    worker = WorkerProcess(proc=proc, log_path=log_path, queue=queue)
    try:
        worker.wait_for_log("ready.")
        yield worker
    finally:
        stop_process_group(proc)


def process_stopped(pid: int) -> bool:
    """Whether process ``pid`` is stopped by a signal (SIGSTOP): state "T" in /proc/<pid>/stat."""
    with open(f"/proc/{pid}/stat") as stat:
        return stat.read().rsplit(")", 1)[1].split()[0] == "T"


def maintenance_queue(queue: str) -> str:
    """The maintenance queue the settings derive from a task queue (LMSP_MAINTENANCE_QUEUE)."""
    return f"{queue}-maintenance"


def kill_process_group(proc: subprocess.Popen | StartedProcess) -> None:
    """SIGKILL a worker, parent and children at once: a crash, not a shutdown.

    Returns once the database has ended the dead processes' sessions. On
    PostgreSQL a session the worker left inside a transaction (killed in a
    commit, or frozen there first) keeps its row locks until its server
    process sees the closed socket and rolls back, which a loaded machine
    delays: recovery run at once found the task "locked by another writer".
    """
    from tests.support.db import database_sessions_of_group, wait_for_sessions_to_end

    sessions = database_sessions_of_group(proc.pid)
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()
    wait_for_sessions_to_end(sessions)


def stop_process_group(proc: subprocess.Popen | StartedProcess, timeout: float = 15) -> None:
    if proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=timeout)
    except (subprocess.TimeoutExpired, ProcessLookupError):
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()


@dataclass
class RedisServer:
    port: int
    dir: Path
    proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        self.proc = subprocess.Popen(
            [
                shutil.which("redis-server") or "redis-server",
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
                "--dir",
                str(self.dir),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )

        def answers() -> bool:
            try:
                return bool(redis.Redis(port=self.port, socket_connect_timeout=0.5).ping())
            except redis.RedisError:
                return False

        wait_until(answers, what="private redis-server did not start", timeout=10)

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            self.proc.wait(timeout=10)
            self.proc = None


@contextmanager
def private_redis(tmp: Path) -> Iterator[RedisServer]:
    """A redis-server of our own, which a test may stop and start again."""
    server = RedisServer(port=free_port(), dir=tmp)
    server.start()
    try:
        yield server
    finally:
        server.stop()
