"""docker-compose.yml, as compose itself resolves it (``docker compose config``).

No container is started (CI has no Docker daemon); what is checked is the
stack compose would run for each variant: the GPU and CPU profiles, the
PostgreSQL variant, and what every service waits for, mounts and is told.
Runs with compose v2 (``docker compose``) when present, else v1
(``docker-compose``); without either it fails under CI and is skipped elsewhere.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.support.server import REPO

# No database of the pass here: the PostgreSQL pass of scripts/test leaves these out (tests/conftest.py).
pytestmark = pytest.mark.database_free

COMPOSE_FILE = REPO / "docker-compose.yml"
SECRET = "test-secret-key"
POSTGRES_URL = "postgres://lmsp:s3cret@postgres:5432/lmsp"
SQLITE_URL = "sqlite:////data/lmsp.sqlite3"


@cache
def compose_command() -> tuple[str, ...] | None:
    docker = shutil.which("docker")
    if docker and subprocess.run([docker, "compose", "version"], capture_output=True).returncode == 0:
        return (docker, "compose")
    legacy = shutil.which("docker-compose")
    return (legacy,) if legacy else None


@pytest.fixture(scope="module")
def compose() -> tuple[str, ...]:
    command = compose_command()
    if command is None:
        if os.environ.get("CI") == "true":
            pytest.fail("neither `docker compose` nor `docker-compose` is installed (.ci/run installs docker-compose)")
        pytest.skip("neither `docker compose` nor `docker-compose` is installed")
    return command


def run_config(
    compose: tuple[str, ...], tmp_path: Path, *, profiles: tuple[str, ...] = (), env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    # Only what the test gives: no DATABASE_URL of the test run, no .env of a developer.
    base = {key: value for key, value in os.environ.items() if not key.startswith(("LMSP_", "POSTGRES_", "COMPOSE_"))}
    base.pop("DATABASE_URL", None)
    base.pop("REDIS_URL", None)
    empty_env_file = tmp_path / "empty.env"
    empty_env_file.touch()
    args = [*compose, "--env-file", str(empty_env_file), "-f", str(COMPOSE_FILE)]
    for profile in profiles:
        args += ["--profile", profile]
    return subprocess.run(
        [*args, "config"],
        cwd=REPO,
        env={**base, "LMSP_SECRET_KEY": SECRET, **(env or {})},
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.fixture
def resolve(compose, tmp_path):
    """``resolve(profiles, env)``: the services compose would run, as it resolved them."""

    def run(*profiles: str, **env: str) -> dict[str, dict[str, Any]]:
        done = run_config(compose, tmp_path, profiles=profiles, env=env)
        assert done.returncode == 0, done.stderr
        config = yaml.safe_load(done.stdout)
        # compose v1 lists every service; v2 only the active ones. Keep the active ones.
        return {
            name: service
            for name, service in config["services"].items()
            if not service.get("profiles") or set(service["profiles"]) & set(profiles)
        }

    return run


def app_services(services: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """The services that run the LMSP image (init, web, beat, workers)."""
    return {name: service for name, service in services.items() if "LMSP_DATA_DIR" in env_of(service)}


def env_of(service: dict[str, Any]) -> dict[str, str]:
    env = service.get("environment") or {}
    if isinstance(env, list):
        env = dict(item.split("=", 1) for item in env)
    return {key: "" if value is None else str(value) for key, value in env.items()}


def command_of(service: dict[str, Any]) -> list[str]:
    command = service.get("command") or []
    return command.split() if isinstance(command, str) else [str(part) for part in command]


def option(command: list[str], name: str) -> str | None:
    return command[command.index(name) + 1] if name in command else None


def celery_workers(services: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Celery workers that run tasks (not the beat node)."""
    return {
        name: service
        for name, service in services.items()
        if command_of(service)[:4] == ["celery", "-A", "lmsp_project", "worker"] and "--beat" not in command_of(service)
    }


def mounts(service: dict[str, Any]) -> dict[str, tuple[str, bool]]:
    """target -> (named volume or host path, read-only), from the short or the long syntax."""
    found = {}
    for volume in service.get("volumes") or []:
        if isinstance(volume, str):
            source, target, *mode = volume.split(":")
            found[target] = (source, bool(mode) and "ro" in mode[0].split(","))
        else:
            found[volume["target"]] = (volume.get("source", ""), bool(volume.get("read_only")))
    return found


def seconds(duration: str) -> float:
    total = 0.0
    for amount, unit in re.findall(r"([\d.]+)(h|ms|m|s)", str(duration)):
        total += float(amount) * {"h": 3600, "m": 60, "s": 1, "ms": 0.001}[unit]
    return total


def dependencies(service: dict[str, Any]) -> dict[str, str]:
    depends = service.get("depends_on") or {}
    if isinstance(depends, list):
        return dict.fromkeys(depends, "service_started")
    return {name: spec.get("condition", "service_started") for name, spec in depends.items()}


def published(service: dict[str, Any]) -> set[tuple[str, str, str]]:
    """(host address, host port, container port) of each published port."""
    out = set()
    for port in service.get("ports") or []:
        if isinstance(port, str):
            parts = port.split(":")
            host_ip, host_port, target = parts if len(parts) == 3 else ("", *parts)
            out.add((host_ip, host_port, target.removesuffix("/tcp")))
        else:
            out.add((port.get("host_ip", ""), str(port.get("published", "")), str(port["target"])))
    return out


@pytest.mark.parametrize(
    "profiles",
    [(), ("gpu",), ("gpu", "gpu1"), ("cpu",), ("postgres",), ("gpu", "postgres"), ("cpu", "postgres")],
    ids=lambda profiles: "+".join(profiles) or "default",
)
def test_every_variant_validates(compose, tmp_path, profiles):
    env = {"DATABASE_URL": POSTGRES_URL} if "postgres" in profiles else {}
    done = run_config(compose, tmp_path, profiles=profiles, env=env)
    assert done.returncode == 0, done.stderr


def test_the_stack_refuses_to_start_without_a_secret_key(compose, tmp_path):
    done = run_config(compose, tmp_path, env={"LMSP_SECRET_KEY": ""})
    assert done.returncode != 0
    assert "LMSP_SECRET_KEY" in done.stderr


def test_redis_keeps_its_queue_and_never_evicts(resolve):
    services = resolve()
    redis = services["redis"]
    command = command_of(redis)
    assert option(command, "--maxmemory-policy") == "noeviction"
    assert option(command, "--appendonly") == "yes"
    source, read_only = mounts(redis)["/data"]
    assert source == "redis-data" or source.endswith("_redis-data")
    assert not read_only
    assert redis["healthcheck"]["test"]
    # Every app service reaches this Redis and waits until it answers.
    for name, service in app_services(resolve("gpu", "gpu1", "cpu")).items():
        assert env_of(service)["REDIS_URL"] == "redis://redis:6379/0", name
        assert dependencies(service).get("redis") == "service_healthy", name


def test_web_beat_and_workers_wait_for_init_to_complete(resolve):
    services = app_services(resolve("gpu", "gpu1", "cpu"))
    assert command_of(services["init"])[0] == "scripts/prepare"
    assert "init" not in dependencies(services["init"])
    assert (REPO / "scripts" / "prepare").stat().st_mode & 0o111
    waiting = {name for name, service in services.items() if dependencies(service).get("init")}
    assert waiting == set(services) - {"init"}
    assert {"web", "beat", "worker-gpu0", "worker-gpu1", "worker-cpu"} <= waiting
    for name in waiting:
        assert dependencies(services[name])["init"] == "service_completed_successfully", name


def test_the_gpu_profile_alone_runs_one_worker_on_gpu_0(resolve):
    # A host with one GPU, the common case: `--profile gpu` asks for no second device.
    workers = celery_workers(resolve("gpu"))
    assert sorted(workers) == ["worker-gpu0"]
    (device,) = workers["worker-gpu0"]["deploy"]["resources"]["reservations"]["devices"]
    assert [str(device_id) for device_id in device["device_ids"]] == ["0"]
    # The second GPU's worker comes with its own profile, alone or beside the first.
    assert sorted(celery_workers(resolve("gpu1"))) == ["worker-gpu1"]


def test_one_worker_per_gpu(resolve):
    workers = celery_workers(resolve("gpu", "gpu1"))
    assert len(workers) >= 2
    device_ids, node_names = [], []
    for name, service in workers.items():
        command = command_of(service)
        # One process per GPU, running as many tasks at once as its engine batches; a few threads start them.
        assert option(command, "--pool") == "threads", name
        assert env_of(service)["LMSP_MAX_BATCH"] == "", name  # unset: automatic, from the KV budget
        assert option(command, "--concurrency") == env_of(service)["LMSP_WORKER_THREADS"] == "4", name
        node_names.append(option(command, "--hostname"))
        (device,) = service["deploy"]["resources"]["reservations"]["devices"]
        assert device["driver"] == "nvidia", name
        assert "gpu" in device["capabilities"], name
        assert len(device["device_ids"]) == 1, name
        device_ids.append(str(device["device_ids"][0]))
        env = env_of(service)
        assert env["LMSP_DEVICE"] == "cuda", name
        # Only the reserved GPU is visible inside the container, as device 0.
        assert env["LMSP_DEVICE_ID"] == "0", name
        # Long enough for the hand-back commits that may wait for SQLite's write lock.
        assert seconds(service["stop_grace_period"]) >= 30, name
        assert env["LMSP_DRAIN_SECONDS"] == "0", name
    assert len(set(device_ids)) == len(device_ids), device_ids
    assert all(node and node.endswith("@%h") for node in node_names), node_names
    assert len(set(node_names)) == len(node_names), node_names


def test_cpu_profile_runs_one_worker_without_a_gpu(resolve):
    workers = celery_workers(resolve("cpu"))
    assert len(workers) == 1, sorted(workers)
    ((name, service),) = workers.items()
    assert not (service.get("deploy") or {}).get("resources", {}).get("reservations", {}).get("devices"), name
    assert env_of(service)["LMSP_DEVICE"] == "cpu"
    command = command_of(service)
    assert option(command, "--pool") == "threads"
    assert env_of(service)["LMSP_MAX_BATCH"] == ""
    assert option(command, "--concurrency") == env_of(service)["LMSP_WORKER_THREADS"] == "4"
    assert seconds(service["stop_grace_period"]) >= 30
    # Without a worker profile no worker (and no GPU) is asked for.
    assert not celery_workers(resolve())


def test_the_batch_size_and_the_drain_reach_every_worker_and_its_grace_period(resolve):
    services = resolve(
        "gpu",
        "gpu1",
        "cpu",
        LMSP_MAX_BATCH="32",
        LMSP_WORKER_THREADS="2",
        LMSP_DRAIN_SECONDS="20",
        LMSP_WORKER_STOP_GRACE_PERIOD="65s",
        LMSP_KV_CACHE_BYTES="2147483648",
        LMSP_GPU_MEM_LIMIT_BYTES="8589934592",
    )
    workers = celery_workers(services)
    assert sorted(workers) == ["worker-cpu", "worker-gpu0", "worker-gpu1"]
    for name, service in workers.items():
        env = env_of(service)
        # The rows the engine batches, and the threads that start them: two numbers.
        assert env["LMSP_MAX_BATCH"] == "32", name
        assert option(command_of(service), "--concurrency") == env["LMSP_WORKER_THREADS"] == "2", name
        assert env["LMSP_DRAIN_SECONDS"] == "20", name
        assert env["LMSP_KV_CACHE_BYTES"] == "2147483648", name
        assert env["LMSP_GPU_MEM_LIMIT_BYTES"] == "8589934592", name
        # Unset, the engine's own default (settings), not a copy of it here.
        assert env["LMSP_KV_CACHE_SHARE"] == "", name
        # The drain plus the 45 s of hand-back commits.
        assert seconds(service["stop_grace_period"]) == 65, name
    # The maintenance node drains nothing: its own grace period, and no batch settings.
    assert seconds(services["beat"]["stop_grace_period"]) == 45
    assert "LMSP_MAX_BATCH" not in env_of(services["beat"])
    assert "LMSP_WORKER_THREADS" not in env_of(services["beat"])


def test_exactly_one_maintenance_node_on_the_prefixed_queue(resolve):
    services = resolve("gpu", "gpu1", "cpu", LMSP_REDIS_PREFIX="site-a")
    beat_nodes = [name for name, service in services.items() if "--beat" in command_of(service)]
    assert beat_nodes == ["beat"]
    command = command_of(services["beat"])
    assert option(command, "--queues") == "site-a-maintenance"
    assert option(command, "--pool") == "solo"
    for name, service in app_services(services).items():
        assert env_of(service)["LMSP_REDIS_PREFIX"] == "site-a", name


def test_sqlite_file_is_on_one_volume_that_every_service_shares(resolve):
    services = app_services(resolve("gpu", "gpu1", "cpu"))
    sources = set()
    for name, service in services.items():
        assert env_of(service)["DATABASE_URL"] == SQLITE_URL, name
        source, read_only = mounts(service)["/data"]
        assert not read_only, name
        sources.add(source)
        assert "/models" in mounts(service), name
    assert len(sources) == 1
    (source,) = sources
    assert not source.startswith(("/", ".")), "the data volume must be a named volume"
    # Only init writes models (the demo model); the others read them.
    assert not mounts(services["init"])["/models"][1]
    assert mounts(services["worker-gpu0"])["/models"][1]
    # A host folder instead of the models volume, for every service.
    for name, service in app_services(resolve("gpu", LMSP_MODELS_PATH="/srv/lmsp/models")).items():
        assert mounts(service)["/models"][0] == "/srv/lmsp/models", name


def test_postgres_variant_switches_every_service(resolve):
    services = resolve("gpu", "gpu1", "cpu", "postgres", DATABASE_URL=POSTGRES_URL)
    assert "postgres" in services
    assert "/var/lib/postgresql/data" in mounts(services["postgres"])
    assert services["postgres"]["healthcheck"]["test"]
    apps = app_services(services)
    assert len(apps) >= 5
    for name, service in apps.items():
        assert env_of(service)["DATABASE_URL"] == POSTGRES_URL, name
        assert env_of(service)["REDIS_URL"] == "redis://redis:6379/0", name
    # init waits for the database itself: a depends_on on a service of a
    # profile would make every other variant invalid.
    assert option(command_of(apps["init"]), "--wait-db")
    # Without the profile there is no postgres service.
    assert "postgres" not in resolve("gpu")


def test_web_is_published_where_asked(resolve):
    assert published(resolve()["web"]) == {("127.0.0.1", "8000", "8000")}
    web = resolve(LMSP_HOST="0.0.0.0", LMSP_PORT="9000")["web"]
    assert published(web) == {("0.0.0.0", "9000", "8000")}
    assert web["healthcheck"]["test"]
