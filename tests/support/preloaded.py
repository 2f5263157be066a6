"""The suite's servers and workers, forked from a process that has imported their libraries once.

The suite starts ~230 uvicorn servers and Celery workers a run. As fresh interpreters each spent 1.4-1.7 s of
CPU importing Django, DRF, Celery (whose command line pulls in prompt_toolkit), kombu, redis, psycopg and
uvicorn before it ran a line of ours; on the 2-core CI machine, where the run is CPU-bound from start to end,
that was a fifth of it (docs/decisions/0003). So each test process keeps one starter: a child that imports
those libraries (and nothing of ours, and no settings) and then forks a process for each start.

From the fork on, the child is the real thing: it takes its own environment, working directory, session,
standard streams and argv, and runs ``python -m uvicorn ...`` or ``python -m celery ...`` as the command line
does (``runpy``); it reads its own settings, imports our code, opens its own connections, starts its own
engine process (a fresh interpreter, ``workers.engine_process``), exits through the interpreter's normal
shutdown, and is killed, frozen and reaped like any process. Only the interpreter's start is shared. The
README's own commands keep their tests (test_launcher, test_getting_started start them unchanged).

``LMSP_TEST_FRESH_PROCESSES=1`` starts every process as a fresh interpreter instead (subprocess.Popen).
"""

from __future__ import annotations

import errno
import importlib
import os
import pickle
import select
import signal
import socket
import subprocess
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

REPO = Path(__file__).resolve().parents[2]

# Imported by the starter before any fork: what a web process and a worker import before our code, none of
# which reads settings or the environment as it is imported (the starter has no DJANGO_SETTINGS_MODULE, so
# a module that did would fail here, at the suite's first start, rather than carry one test's settings).
PRELOAD = (
    "asyncio",
    "json",
    "logging.config",
    "uuid",
    "decimal",
    "django",
    "django.core.handlers.asgi",
    "django.core.handlers.wsgi",
    "django.core.management",
    "django.db.models",
    "django.db.backends.postgresql.base",
    "django.db.backends.sqlite3.base",
    "django.http",
    "django.urls",
    "django.views.generic",
    "django.contrib.postgres.fields",
    "django.contrib.staticfiles.handlers",
    "django.test.signals",
    "rest_framework.serializers",
    "rest_framework.response",
    "psycopg",
    "redis",
    "redis.asyncio",
    "requests",
    "kombu",
    "kombu.transport.redis",
    "celery",
    "celery.app.base",
    "celery.bin.celery",
    "celery.worker",
    "celery.worker.consumer.consumer",
    "celery.concurrency.prefork",
    "celery.concurrency.thread",
    "celery.backends.redis",
    "billiard.pool",
    "uvicorn",
    "uvicorn.main",
    "uvicorn.protocols.http.h11_impl",
    "h11",
)


@dataclass(frozen=True)
class Start:
    """One process to start: ``python -m module *args``, as the command line would."""

    module: str
    args: tuple[str, ...]
    env: dict[str, str]
    cwd: str
    new_session: bool


# --- the starter (its own process) -------------------------------------------------------------------------


def _serve(sock: socket.socket) -> Start:
    """The starter's loop: returns only in a forked child, with what that child is to run."""
    for name in PRELOAD:
        importlib.import_module(name)
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_r, False)
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    # A handler, not SIG_IGN: ignored, SIGCHLD would reap the children before the starter learns their status.
    signal.signal(signal.SIGCHLD, lambda signum, frame: None)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # ^C in the terminal is pytest's to handle
    sock.sendall(pickle.dumps(("ready",)))
    while True:
        try:
            readable, _, _ = select.select([sock, wake_r], [], [])
        except InterruptedError:
            continue
        if wake_r in readable:
            try:
                while os.read(wake_r, 512):
                    pass
            except BlockingIOError:
                pass
        _reap(sock)
        if sock not in readable:
            continue
        message, fds, _, _ = socket.recv_fds(sock, 1 << 20, 2)
        if not message:  # the test process is gone; what it started is its fixtures' to stop
            sys.exit(0)
        start: Start = pickle.loads(message)
        pid = os.fork()
        if pid == 0:
            for fd in (wake_r, wake_w):
                os.close(fd)
            _become(start, fds, sock)
            return start
        for fd in fds:
            os.close(fd)
        _tell(sock, ("started", pid))


def _reap(sock: socket.socket) -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        _tell(sock, ("exited", pid, os.waitstatus_to_exitcode(status)))


def _tell(sock: socket.socket, message: tuple[Any, ...]) -> None:
    try:
        sock.sendall(pickle.dumps(message))
    except OSError:  # the test process is gone (it ended, or was killed): nobody is left to tell
        sys.exit(0)


def _become(start: Start, fds: list[int], sock: socket.socket) -> None:
    """In the forked child: take the start's session, streams, directory, environment and argv."""
    sock.close()
    signal.set_wakeup_fd(-1)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    if start.new_session:
        os.setsid()
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    out, err = fds
    os.dup2(out, 1)
    os.dup2(err, 2)
    for fd in {out, err}:
        os.close(fd)
    os.chdir(start.cwd)
    os.environ.clear()
    os.environ.update(start.env)
    # As ``python -m`` sets them: the working directory first on the path, argv[0] the module's file (runpy).
    sys.path[0] = start.cwd
    sys.argv = ["-m", *start.args]
    _name_process(f"lmsp-{start.module}")


def _name_process(name: str) -> None:
    """Name the child in ps and top (its command line is the starter's): lmsp-celery, lmsp-uvicorn."""
    import ctypes

    try:
        ctypes.CDLL(None).prctl(15, name.encode()[:15], 0, 0, 0)  # PR_SET_NAME
    except (OSError, AttributeError):
        pass


def _main() -> None:
    sock = socket.socket(fileno=int(sys.argv[1]))
    start = _serve(sock)
    import runpy

    # Raises SystemExit as ``python -m`` would; the interpreter's normal shutdown follows (atexit, threads).
    runpy.run_module(start.module, run_name="__main__", alter_sys=True)


# --- the test process's side ---------------------------------------------------------------------------------


class StartedProcess:
    """A process the starter forked, with the parts of ``subprocess.Popen`` the suite's helpers use."""

    def __init__(self, starter: _Starter, pid: int, args: list[str]) -> None:
        self._starter = starter
        self.pid = pid
        self.args = args

    @property
    def returncode(self) -> int | None:
        return self._starter.returncode(self.pid)

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        code = self._starter.wait(self.pid, timeout)
        if code is None:
            raise subprocess.TimeoutExpired(self.args, timeout or 0)
        return code

    def send_signal(self, signum: int) -> None:
        if self.returncode is None:
            try:
                os.kill(self.pid, signum)
            except ProcessLookupError:
                pass

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class _Starter:
    """The test process's handle on its starter: sends starts, learns pids and exit statuses."""

    def __init__(self) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        env = {key: value for key, value in os.environ.items() if key != "DJANGO_SETTINGS_MODULE"}
        # Unbuffered, as the services' own output is under the machine's PYTHONUNBUFFERED: a test reads a
        # worker's log while it runs.
        env["PYTHONUNBUFFERED"] = "1"
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.support.preloaded", str(theirs.fileno())],
            cwd=REPO,
            env=env,
            pass_fds=[theirs.fileno()],
            stdin=subprocess.DEVNULL,
        )
        theirs.close()
        self.sock = ours
        self._lock = threading.Lock()  # one start at a time: its "started" reply is the next one
        self._changed = threading.Condition()
        self._started: list[int] = []
        self._exited: dict[int, int] = {}
        self._gone = False
        reply = self._receive()
        if reply != ("ready",):
            raise RuntimeError(f"the process starter did not start: {reply!r}")
        threading.Thread(target=self._listen, name="process-starter", daemon=True).start()

    def _receive(self) -> Any:
        message = self.sock.recv(1 << 16)
        return pickle.loads(message) if message else None

    def _listen(self) -> None:
        while True:
            reply = self._receive()
            with self._changed:
                if reply is None:
                    self._gone = True
                elif reply[0] == "started":
                    self._started.append(reply[1])
                elif reply[0] == "exited":
                    self._exited[reply[1]] = reply[2]
                self._changed.notify_all()
            if reply is None:
                return

    def start(self, start: Start, stdout: int, stderr: int) -> int:
        with self._lock:
            socket.send_fds(self.sock, [pickle.dumps(start)], [stdout, stderr])
            with self._changed:
                if not self._changed.wait_for(lambda: self._started or self._gone, timeout=30) or not self._started:
                    raise RuntimeError("the process starter did not answer")
                return self._started.pop(0)

    def returncode(self, pid: int) -> int | None:
        with self._changed:
            return self._exited.get(pid)

    def wait(self, pid: int, timeout: float | None) -> int | None:
        with self._changed:
            self._changed.wait_for(lambda: pid in self._exited or self._gone, timeout=timeout)
            return self._exited.get(pid)


_starter: _Starter | None = None
_starter_lock = threading.Lock()


def _the_starter() -> _Starter:
    global _starter
    with _starter_lock:
        if _starter is None or _starter._gone or _starter.proc.poll() is not None:
            _starter = _Starter()
        return _starter


def python_module(
    module: str,
    args: list[str],
    *,
    env: dict[str, str],
    cwd: Path = REPO,
    stdout: IO[Any] | int | None = None,
    stderr: IO[Any] | int | None = None,
    start_new_session: bool = False,
) -> StartedProcess | subprocess.Popen:
    """``python -m module *args``: forked from the starter, or a fresh interpreter under LMSP_TEST_FRESH_PROCESSES.

    ``stdout`` and ``stderr`` as ``subprocess.Popen`` takes them: a file, ``None`` (this process's own, so
    that ``capfd`` reads them) or, for ``stderr``, ``subprocess.STDOUT``.
    """
    if os.environ.get("LMSP_TEST_FRESH_PROCESSES") == "1":
        return subprocess.Popen(
            [sys.executable, "-m", module, *args],
            cwd=cwd,
            env=env,
            stdout=stdout,
            stderr=stderr,
            start_new_session=start_new_session,
        )
    out = 1 if stdout is None else stdout if isinstance(stdout, int) else stdout.fileno()
    if stderr == subprocess.STDOUT:
        err = out
    else:
        err = 2 if stderr is None else stderr if isinstance(stderr, int) else stderr.fileno()
    start = Start(module=module, args=tuple(args), env=dict(env), cwd=str(cwd), new_session=start_new_session)
    for attempt in range(2):
        starter = _the_starter()
        try:
            return StartedProcess(starter, starter.start(start, out, err), [module, *args])
        except OSError as exc:
            # The starter died (a test's killpg can reach it only by mistake, but then once): a new one.
            if attempt or exc.errno not in {errno.EPIPE, errno.ECONNRESET, errno.ENOTCONN}:
                raise
    raise AssertionError("unreachable")


if __name__ == "__main__":
    _main()
