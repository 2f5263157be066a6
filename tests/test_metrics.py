"""``GET /metrics`` over real servers: what Prometheus would read after real tasks ran on a real worker."""

from __future__ import annotations

import http.client
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from itertools import groupby
from pathlib import Path
from urllib.parse import urlsplit

import pytest
from django.db import connection
from django.test import Client as HttpClient
from prometheus_client.openmetrics.parser import text_string_to_metric_families as openmetrics_families
from prometheus_client.parser import text_string_to_metric_families

from tasks_app import states
from tasks_app.metrics.catalog import TIME_TO_FIRST_TOKEN
from tasks_app.metrics.exposition import metrics_exposition
from tasks_app.metrics.scrape import Scrape, active_tasks_grouped, metrics_redis_read, tasks_active_count
from tasks_app.metrics.store import (
    GAUGE_TTL_SECONDS,
    metrics_redis,
    process_key,
    processes_key,
    worker_key,
    workers_key,
)
from tasks_app.models import Task, TaskEvent
from tests.support.db import database_url, is_postgres
from tests.support.demo import ENDLESS_MODEL
from tests.support.namespace import REDIS_PREFIX
from tests.support.server import REPO, free_port, uvicorn_process
from tests.support.sse import open_stream
from tests.support.tasks import create, wait_for_status
from tests.support.waiting import wait_until
from tests.support.worker import private_redis
from workers.run_metrics import FLUSH_INTERVAL_SECONDS, EngineMetrics, Recorder, node_name, recorder

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def parse(text: str) -> Samples:
    """Every sample of a Prometheus text exposition, keyed by name and sorted labels."""
    out: Samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return out


def value(samples: Samples, name: str, **labels: str) -> float:
    """A sample's value; 0 for a series not (yet) exposed, like a worker that has not reported."""
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def fetch(
    base: str, path: str = "/metrics", *, method: str = "GET", headers: dict[str, str] | None = None
) -> tuple[int, dict[str, str], bytes]:
    parts = urlsplit(base)
    # The timeout only keeps a hanging server from hanging the test.
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=20)
    try:
        conn.request(method, path, headers=headers or {})
        response = conn.getresponse()
        return response.status, {k.lower(): v for k, v in response.getheaders()}, response.read()
    finally:
        conn.close()


def scrape_once(base: str) -> Samples:
    status, headers, body = fetch(base)
    assert status == 200, body
    assert headers["content-type"].startswith("text/plain; version=0.0.4")
    return parse(body.decode())


def redis_read(take: Callable[[], Samples]) -> Samples:
    """The first scrape that could read Redis (a starved Redis on a busy machine may miss one's timeout)."""

    def probe() -> Samples | None:
        samples = take()
        return samples if value(samples, "lmsp_redis_up") == 1 else None

    return wait_until(probe, what="no scrape could read Redis")


def scrape(base: str) -> Samples:
    return redis_read(lambda: scrape_once(base))


def settled_scrape(base: str) -> Samples:
    """A scrape once counters and worker reports stopped moving (a previous test's last report may be in flight)."""

    def moving(samples: Samples) -> Samples:
        return {key: number for key, number in samples.items() if key[0].endswith(("_total", "_count", "_sum"))}

    previous = [scrape(base)]

    def settled() -> Samples | None:
        time.sleep(FLUSH_INTERVAL_SECONDS + 0.2)
        current = scrape(base)
        same = moving(current) == moving(previous[0])
        previous[0] = current
        return current if same else None

    return wait_until(settled, what="the counters never stopped moving")


def histogram_delta(before: Samples, after: Samples, name: str, worker: str) -> tuple[float, float]:
    """How much a worker's histogram grew: (count, sum)."""
    return (
        value(after, f"{name}_count", worker=worker) - value(before, f"{name}_count", worker=worker),
        value(after, f"{name}_sum", worker=worker) - value(before, f"{name}_sum", worker=worker),
    )


def assert_histograms_consistent(samples: Samples) -> None:
    """Buckets never decrease and +Inf is the count, for every histogram series."""
    series: dict[tuple[str, tuple], list[tuple[float, float]]] = {}
    for (name, labels), number in samples.items():
        if name.endswith("_bucket"):
            rest = tuple(item for item in labels if item[0] != "le")
            series.setdefault((name[: -len("_bucket")], rest), []).append((float(dict(labels)["le"]), number))
    for (name, labels), buckets in series.items():
        counts = [count for _, count in sorted(buckets)]
        assert counts == sorted(counts), name
        assert sorted(buckets)[-1][0] == float("inf")
        assert counts[-1] == samples[(f"{name}_count", labels)], name


def generation_commits(task_id: str, *, cancelled: bool) -> list[int]:
    """Events per commit of the generation, read from the log: commits share one created_at.

    The first commit wrote ``response.created``; the second opened the run, and is a commit of the
    generation when it holds the first deltas too (a start folded into the first delta's commit); a
    cancelled task's last commit is the worker's ``response.cancelled``.
    """
    rows = TaskEvent.objects.filter(task_id=task_id).order_by("sequence_number").values_list("created_at", "type")
    groups = [[kind for _, kind in group] for _, group in groupby(rows, key=lambda row: row[0])]
    opened_with_deltas = "response.output_text.delta" in groups[1]
    generation = groups[1:] if opened_with_deltas else groups[2:]
    return [len(group) for group in (generation[:-1] if cancelled else generation)]


def test_finished_counters_and_worker_histograms_after_real_tasks(api, running_worker, web_server):
    before = settled_scrape(web_server.base)

    done = [create(api, f"Write about rivers {n}", max_output_tokens=40, seed=n) for n in (1, 2)]
    for task in done:
        assert wait_for_status(api, task["id"], {"succeeded", "failed", "cancelled"})["status"] == "succeeded"
    long = create(api, "Go on and on", model=ENDLESS_MODEL, max_output_tokens=4000, seed=3)
    wait_until(
        lambda: TaskEvent.objects.filter(task_id=long["id"], type="response.output_text.delta").count() >= 20,
        what="the long task never generated",
    )
    assert api.post(f"/lmsp/v1/tasks/{long['id']}/cancel").status_code == 200
    assert wait_for_status(api, long["id"], {"succeeded", "failed", "cancelled"})["status"] == "cancelled"

    worker = node_name(Task.objects.get(pk=done[0]["id"]).worker)
    commits = [events for task in done for events in generation_commits(task["id"], cancelled=False)]
    commits += generation_commits(long["id"], cancelled=True)
    committed_tokens = 40 + 40 + Task.objects.get(pk=long["id"]).output_tokens

    def reported() -> Samples | None:
        # The worker reports from a thread right after each task. The cancel
        # latency is its last observation, and one report carries everything
        # observed before it.
        after = scrape(web_server.base)
        latencies, _ = histogram_delta(before, after, "lmsp_cancel_latency_seconds", worker)
        return after if latencies >= 1 else None

    after = wait_until(reported, what="the worker's metrics never reached /metrics")

    finished = {s: value(after, "lmsp_tasks_finished_total", status=s) for s in ("succeeded", "failed", "cancelled")}
    assert finished == {
        "succeeded": value(before, "lmsp_tasks_finished_total", status="succeeded") + 2,
        "failed": value(before, "lmsp_tasks_finished_total", status="failed"),
        "cancelled": value(before, "lmsp_tasks_finished_total", status="cancelled") + 1,
    }
    ttft_count, ttft_sum = histogram_delta(before, after, "lmsp_time_to_first_token_seconds", worker)
    claim_count, claim_sum = histogram_delta(before, after, "lmsp_claim_to_first_token_seconds", worker)
    assert (ttft_count, claim_count) == (3, 3)
    # A task is accepted before it is claimed.
    assert ttft_sum >= claim_sum > 0
    speed_count, speed_sum = histogram_delta(before, after, "lmsp_generation_tokens_per_second", worker)
    assert speed_count == 3 and speed_sum > 0
    assert histogram_delta(before, after, "lmsp_event_batch_events", worker) == (len(commits), sum(commits))
    assert histogram_delta(before, after, "lmsp_event_batch_tokens", worker) == (len(commits), committed_tokens)
    latency_count, latency_sum = histogram_delta(before, after, "lmsp_cancel_latency_seconds", worker)
    assert latency_count == 1 and latency_sum >= 0
    assert_histograms_consistent(after)

    workers = {dict(labels).get("worker") for name, labels in after if name.startswith("lmsp_event_batch")}
    assert worker in workers and worker.startswith("test@")
    for status in map(str, states.in_declaration_order(states.ACTIVE)):
        assert value(after, "lmsp_tasks_active", status=status) == Task.objects.filter(status=status).count()
    assert value(after, "lmsp_redis_up") == 1 and value(after, "lmsp_database_up") == 1


def test_open_streams_counts_the_streams_open_on_that_server(api, transactional_db, web_server):
    # No worker consumes this test's queue: the task stays queued and its stream stays open.
    task = api.create_task("wait").json()
    # A stream another test closed may still be on its way out.
    wait_until(lambda: value(scrape(web_server.base), "lmsp_open_streams") == 0, what="streams left open")

    with open_stream(web_server.base, f"/lmsp/v1/tasks/{task['id']}/events", token=api.token) as stream:
        assert [event.event for event in stream.take(1)] == ["response.created"]
        assert value(scrape(web_server.base), "lmsp_open_streams") == 1

    wait_until(
        lambda: value(scrape(web_server.base), "lmsp_open_streams") == 0,
        what="the closed stream is still counted",
    )
    api.post(f"/lmsp/v1/tasks/{task['id']}/cancel")


def test_queue_depth_counts_queued_tasks_in_the_database_and_messages_in_the_broker(api, queue):
    http = HttpClient()

    def scraped_once() -> Samples:
        reply = http.get("/metrics")
        assert reply.status_code == 200
        return parse(reply.content.decode())

    def scraped() -> Samples:
        return redis_read(scraped_once)

    start = scraped()
    tasks = [api.create_task(f"wait {n}").json() for n in range(3)]

    queued = scraped()
    assert value(queued, "lmsp_queue_depth") == 3
    assert value(queued, "lmsp_tasks_active", status="queued") == 3
    assert value(queued, "lmsp_broker_queue_messages", queue=queue) == 3

    api.post(f"/lmsp/v1/tasks/{tasks[0]['id']}/cancel")

    after_cancel = scraped()
    assert value(after_cancel, "lmsp_queue_depth") == 2
    # The message stays in the broker until a worker takes it and drops it.
    assert value(after_cancel, "lmsp_broker_queue_messages", queue=queue) == 3
    cancelled = ("lmsp_tasks_finished_total", (("status", "cancelled"),))
    assert after_cancel[cancelled] == start[cancelled] + 1


def test_only_get_and_head_without_credentials(web_server):
    status, headers, body = fetch(web_server.base, method="POST")
    assert status == 405
    assert headers["content-type"] == "application/problem+json"
    assert headers["allow"] == "GET, HEAD"
    assert b'"code":"method_not_allowed"' in body

    status, headers, body = fetch(web_server.base, method="HEAD")
    assert (status, body) == (200, b"")
    assert headers["content-type"].startswith("text/plain")

    # Prometheus asks for OpenMetrics first; that format is served too.
    accept = "application/openmetrics-text;version=1.0.0,text/plain;version=0.0.4;q=0.5"
    status, headers, body = fetch(web_server.base, headers={"Accept": accept})
    assert status == 200
    assert headers["content-type"].startswith("application/openmetrics-text; version=1.0.0")
    names = {family.name for family in openmetrics_families(body.decode())}
    assert {"lmsp_tasks_finished", "lmsp_tasks_active", "lmsp_time_to_first_token_seconds"} <= names


def _non_loopback_address() -> str | None:
    try:
        out = subprocess.run(["hostname", "-I"], capture_output=True, text=True, timeout=5).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    for address in out.split():
        if "." in address and not address.startswith("127."):
            return address
    return None


@contextmanager
def uvicorn_on_all_interfaces(env: dict[str, str]) -> Iterator[int]:
    """The ASGI app on 0.0.0.0, so that the host's own non-loopback address reaches it."""
    port = free_port()
    proc = subprocess.Popen(
        [
            *(sys.executable, "-m", "uvicorn", "lmsp_project.asgi:application"),
            *("--host", "0.0.0.0", "--port", str(port), "--no-access-log", "--log-level", "warning"),
        ],
        cwd=REPO,
        env={**os.environ, **env},
    )
    try:

        def answers() -> bool:
            if proc.poll() is not None:
                raise RuntimeError("uvicorn exited")
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=1):
                    return True
            except OSError:
                return False

        wait_until(answers, what="uvicorn did not start", timeout=30)
        yield port
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def test_local_only_serves_loopback_and_refuses_the_hosts_other_address(transactional_db):
    address = _non_loopback_address()
    if address is None:
        pytest.skip("this host has no non-loopback IPv4 address")
    env = {"DATABASE_URL": database_url(), "LMSP_REDIS_PREFIX": REDIS_PREFIX, "LMSP_METRICS_LOCAL_ONLY": "true"}
    # Bound to every interface, it answers only the names it is given.
    env["LMSP_ALLOWED_HOSTS"] = f"{address},127.0.0.1"
    with uvicorn_on_all_interfaces(env) as port:
        status, headers, body = fetch(f"http://{address}:{port}")
        assert status == 403
        assert headers["content-type"] == "application/problem+json"
        assert b'"code":"local_clients_only"' in body

        assert "lmsp_tasks_active" in {name for name, _ in scrape(f"http://127.0.0.1:{port}")}


@pytest.mark.parametrize(
    ("remote_addr", "served"),
    [
        *[("127.0.0.1", True), ("127.8.9.10", True), ("::1", True), ("::ffff:127.0.0.1", True)],
        *[("10.1.2.3", False), ("::ffff:10.1.2.3", False), ("2001:db8::1", False), ("", False), ("nonsense", False)],
    ],
)
def test_local_only_decides_by_the_client_address(db, settings, remote_addr, served):
    settings.LMSP_METRICS_LOCAL_ONLY = True
    reply = HttpClient(REMOTE_ADDR=remote_addr).get("/metrics")
    assert reply.status_code == (200 if served else 403)
    settings.LMSP_METRICS_LOCAL_ONLY = False
    assert HttpClient(REMOTE_ADDR=remote_addr).get("/metrics").status_code == 200


def test_a_scrape_answers_while_redis_is_down_or_frozen(transactional_db, tmp_path: Path):
    with private_redis(tmp_path) as redis_server:
        env = {"REDIS_URL": redis_server.url, "LMSP_REDIS_PREFIX": REDIS_PREFIX}
        with uvicorn_process(database_url(), env) as server:
            scrape(server.base)  # Redis is read

            assert redis_server.proc is not None
            os.kill(redis_server.proc.pid, signal.SIGSTOP)
            try:
                # It accepts connections but never answers: the scrape's timeouts end the wait.
                frozen = scrape_once(server.base)
            finally:
                os.kill(redis_server.proc.pid, signal.SIGCONT)
            redis_server.stop()
            down = scrape_once(server.base)

            for samples in (frozen, down):
                assert value(samples, "lmsp_redis_up") == 0
                assert value(samples, "lmsp_database_up") == 1
                assert ("lmsp_tasks_active", (("status", "queued"),)) in samples
                # A counter it cannot read is left out, never reported as a reset to 0.
                assert not any(name.startswith(("lmsp_tasks_finished", "lmsp_broker")) for name, _ in samples)

            redis_server.start()
            # Back: the next scrapes read it again (scrape waits for lmsp_redis_up 1).
            assert ("lmsp_tasks_finished_total", (("status", "succeeded"),)) in scrape(server.base)


def test_the_database_part_is_one_query_answered_from_the_active_index(api, django_assert_num_queries):
    for n in range(3):
        api.create_task(f"x {n}")
    cancelled = api.create_task("gone").json()
    api.post(f"/lmsp/v1/tasks/{cancelled['id']}/cancel")

    with django_assert_num_queries(1):
        counts = tasks_active_count()

    assert counts == {"queued": 3, "loading": 0, "running": 0, "cancelling": 0}
    # The statement as executed, parameters bound as the driver binds them:
    # SQLite ignores a partial index whose condition hides behind a parameter.
    sql, params = active_tasks_grouped().query.sql_with_params()
    with connection.cursor() as cursor:
        if is_postgres():
            # On a table this small a sequential scan is cheaper; this asks whether the index can answer.
            cursor.execute("SET LOCAL enable_seqscan = off")
            cursor.execute("EXPLAIN " + sql, params)
        else:
            cursor.execute("EXPLAIN QUERY PLAN " + sql, params)
        plan = " ".join(str(row) for row in cursor.fetchall())
    assert "task_active" in plan, plan


def test_worker_observations_are_summed_per_node_and_gone_nodes_drop_out(settings):
    recorder = Recorder()
    node = f"metrics-test-{os.getpid()}@host"
    for seconds in (0.03, 0.3, 0.3, 700):
        recorder.observe(TIME_TO_FIRST_TOKEN, node, seconds)
    assert recorder.flush()
    recorder.observe(TIME_TO_FIRST_TOKEN, node, 0.3)
    assert recorder.flush()
    gone = f"metrics-gone-{os.getpid()}@host"
    client = metrics_redis()
    client.hset(worker_key(gone), "lmsp_time_to_first_token_seconds:count", 1)
    client.zadd(workers_key(), {gone: time.time() - settings.LMSP_METRICS_WORKER_TTL_SECONDS - 60})

    readout = metrics_redis_read()

    assert gone not in readout.workers
    assert 0 < client.ttl(worker_key(node)) <= settings.LMSP_METRICS_WORKER_TTL_SECONDS
    body, _ = metrics_exposition(Scrape(active=None, redis=readout, open_streams=0), accept="")
    samples = parse(body.decode())
    name = "lmsp_time_to_first_token_seconds"
    assert value(samples, f"{name}_bucket", worker=node, le="0.025") == 0
    assert value(samples, f"{name}_bucket", worker=node, le="0.05") == 1
    assert value(samples, f"{name}_bucket", worker=node, le="0.5") == 4
    assert value(samples, f"{name}_bucket", worker=node, le="600.0") == 4
    assert value(samples, f"{name}_bucket", worker=node, le="+Inf") == 5
    assert value(samples, f"{name}_count", worker=node) == 5
    assert value(samples, f"{name}_sum", worker=node) == pytest.approx(700.93)
    assert_histograms_consistent(samples)
    client.delete(worker_key(node), worker_key(gone))
    client.zrem(workers_key(), node, gone)


def test_a_worker_that_cannot_reach_redis_drops_its_observations_with_one_warning(settings, caplog):
    settings.REDIS_URL = f"redis://127.0.0.1:{free_port()}/0"  # nothing listens there
    recorder = Recorder()

    for _ in range(3):
        recorder.observe(TIME_TO_FIRST_TOKEN, "offline@host", 0.1)
        assert recorder.flush() is False

    warnings = [r for r in caplog.records if "worker metrics not reported" in r.getMessage()]
    assert len(warnings) == 1
    assert "1 observations dropped" in warnings[0].getMessage()
    # Nothing piles up in memory meanwhile.
    assert recorder.flush() is True


# --------------------------------------------------------------------------- #
# The batch engine's metrics
# --------------------------------------------------------------------------- #

ENGINE_GAUGE_NAMES = (
    "lmsp_engine_max_batch",
    "lmsp_engine_rows_running",
    "lmsp_engine_rows_waiting",
    "lmsp_engine_kv_cache_bytes",
    "lmsp_engine_kv_cache_budget_bytes",
    "lmsp_engine_tokens_per_second",
    "lmsp_engine_prefix_cache_bytes",
)


def engine_gauges(samples: Samples, node: str, model: str) -> dict[str, float]:
    return {name: value(samples, name, worker=node, model=model) for name in ENGINE_GAUGE_NAMES}


def flushed_scrape(base: str) -> Samples:
    """A scrape after this process's recorder sent everything observed so far (flushes run one at a time)."""
    assert recorder().flush()
    return scrape(base)


def test_engine_observations_reach_metrics_by_node_and_model_and_closed_engines_read_zero(web_server):
    # Two pool processes of one node run the same model; the first also runs a second model.
    node = f"engine-{os.getpid()}-{time.monotonic_ns()}@host"
    first, second = f"{node}/101", f"{node}/102"
    base_model, demo = "demo:base", "demo"
    a = EngineMetrics(worker=first, model=base_model, max_batch=8)
    b = EngineMetrics(worker=second, model=base_model, max_batch=8)
    c = EngineMetrics(worker=first, model=demo, max_batch=4)
    for engine, rows, seconds in ((a, 3, 0.004), (a, 3, 0.004), (b, 5, 0.02), (c, 1, 0.0004)):
        engine.step(rows=rows, seconds=seconds)
    a.prefill(tokens=100, seconds=0.03)
    a.prefill(tokens=2000, seconds=0.6)
    a.queue_wait(0.2)
    b.queue_wait(3.0)
    a.masks(rows=2, seconds=0.0003)
    a.masks(rows=1, seconds=0.002)
    a.kv(in_use=1000, budget=10_000)
    b.kv(in_use=500, budget=10_000)
    a.rows(running=3, waiting=2)
    b.rows(running=5, waiting=0)
    c.rows(running=1, waiting=0)
    a.prefix_hit(tokens=0)
    a.prefix_hit(tokens=1500)
    a.prefix_cache(cached_bytes=4096, evicted=[1024, 2048])
    b.prefix_cache(cached_bytes=1000, evicted=[])
    # The rate gauge covers at least a flush interval.
    time.sleep(FLUSH_INTERVAL_SECONDS + 0.1)

    samples = flushed_scrape(web_server.base)

    rows = "lmsp_engine_batch_rows"
    assert value(samples, f"{rows}_count", worker=node, model=base_model) == 3
    assert value(samples, f"{rows}_sum", worker=node, model=base_model) == 11
    buckets = [value(samples, f"{rows}_bucket", worker=node, model=base_model, le=le) for le in ("2.0", "3.0", "6.0")]
    assert buckets == [0, 2, 3]
    assert value(samples, f"{rows}_count", worker=node, model=demo) == 1
    assert value(samples, "lmsp_engine_generated_tokens_total", worker=node, model=base_model) == 11
    assert value(samples, "lmsp_engine_generated_tokens_total", worker=node, model=demo) == 1
    step = "lmsp_engine_step_seconds"
    assert value(samples, f"{step}_count", worker=node, model=base_model) == 3
    assert value(samples, f"{step}_sum", worker=node, model=base_model) == pytest.approx(0.028)
    assert value(samples, f"{step}_bucket", worker=node, model=base_model, le="0.005") == 2
    prefill = "lmsp_engine_prefill"
    assert value(samples, f"{prefill}_tokens_sum", worker=node, model=base_model) == 2100
    assert value(samples, f"{prefill}_seconds_count", worker=node, model=base_model) == 2
    assert value(samples, f"{prefill}_seconds_sum", worker=node, model=base_model) == pytest.approx(0.63)
    wait = "lmsp_engine_queue_wait_seconds"
    assert value(samples, f"{wait}_bucket", worker=node, model=base_model, le="0.25") == 1
    assert value(samples, f"{wait}_bucket", worker=node, model=base_model, le="5.0") == 2
    assert value(samples, f"{wait}_count", worker=node, model=demo) == 0
    constrained, masks = "lmsp_engine_constrained_rows", "lmsp_engine_mask_seconds"
    assert value(samples, f"{constrained}_sum", worker=node, model=base_model) == 3
    assert value(samples, f"{masks}_count", worker=node, model=base_model) == 2
    assert value(samples, f"{masks}_bucket", worker=node, model=base_model, le="0.0005") == 1
    assert value(samples, f"{masks}_sum", worker=node, model=base_model) == pytest.approx(0.0023)
    assert value(samples, f"{masks}_count", worker=node, model=demo) == 0
    hits, evicted = "lmsp_engine_prefix_hit_tokens", "lmsp_engine_prefix_evicted_bytes"
    assert value(samples, f"{hits}_count", worker=node, model=base_model) == 2  # lookups
    assert value(samples, f"{hits}_bucket", worker=node, model=base_model, le="0.0") == 1  # misses
    assert value(samples, f"{hits}_sum", worker=node, model=base_model) == 1500  # tokens not computed again
    assert value(samples, f"{evicted}_count", worker=node, model=base_model) == 2
    assert value(samples, f"{evicted}_sum", worker=node, model=base_model) == 3072
    assert_histograms_consistent(samples)
    # Gauges: each process's own, added up per node.
    gauges = engine_gauges(samples, node, base_model)
    speed = gauges.pop("lmsp_engine_tokens_per_second")
    assert gauges == {
        "lmsp_engine_max_batch": 16,
        "lmsp_engine_rows_running": 8,
        "lmsp_engine_rows_waiting": 2,
        "lmsp_engine_kv_cache_bytes": 1500,
        "lmsp_engine_kv_cache_budget_bytes": 20_000,
        "lmsp_engine_prefix_cache_bytes": 5096,
    }
    # 11 tokens over at least a second.
    assert 0 < speed <= 11
    assert engine_gauges(samples, node, demo)["lmsp_engine_rows_running"] == 1
    # The label is the node; no series carries a process's pid.
    labelled = {dict(labels).get("worker") for name, labels in samples if name.startswith("lmsp_engine_")}
    assert node in labelled and first not in labelled and second not in labelled
    assert 0 < metrics_redis().ttl(process_key(first)) <= GAUGE_TTL_SECONDS

    a.close()
    a.rows(running=7, waiting=7)  # a late call after close changes nothing
    after_one = engine_gauges(flushed_scrape(web_server.base), node, base_model)
    assert after_one["lmsp_engine_rows_running"] == 5
    assert after_one["lmsp_engine_max_batch"] == 8
    assert after_one["lmsp_engine_kv_cache_bytes"] == 500
    assert after_one["lmsp_engine_prefix_cache_bytes"] == 1000

    b.close()
    c.close()
    closed = flushed_scrape(web_server.base)
    assert set(engine_gauges(closed, node, base_model).values()) == {0}
    assert set(engine_gauges(closed, node, demo).values()) == {0}
    # Counters and histograms keep what was observed.
    assert value(closed, "lmsp_engine_generated_tokens_total", worker=node, model=base_model) == 11

    # A new engine of the first process takes the place of the closed one.
    again = EngineMetrics(worker=first, model=base_model, max_batch=8)
    again.rows(running=2, waiting=0)
    reopened = engine_gauges(flushed_scrape(web_server.base), node, base_model)
    assert (reopened["lmsp_engine_max_batch"], reopened["lmsp_engine_rows_running"]) == (8, 2)
    again.close()
    assert recorder().flush()


def test_the_gauges_of_a_process_that_stopped_reporting_drop_out():
    client = metrics_redis()
    node = f"engine-dead-{os.getpid()}@host"
    dead, live = f"{node}/1", f"{node}/2"
    for worker, rows in ((dead, 6), (live, 2)):
        client.hset(process_key(worker), "lmsp_engine_rows_running|demo", rows)
    # The dead process's latest report is older than the gauges' TTL (its hash would have expired).
    client.zadd(processes_key(), {dead: time.time() - GAUGE_TTL_SECONDS - 1, live: time.time()})

    readout = metrics_redis_read()

    assert dead not in readout.processes and live in readout.processes
    body, _ = metrics_exposition(Scrape(active=None, redis=readout, open_streams=0), accept="")
    assert value(parse(body.decode()), "lmsp_engine_rows_running", worker=node, model="demo") == 2
    client.delete(process_key(dead), process_key(live))
    client.zrem(processes_key(), dead, live)


def test_engine_metrics_never_raise_while_redis_is_down_and_gauges_are_sent_once_it_is_back(settings):
    reachable = settings.REDIS_URL
    node = f"engine-offline-{os.getpid()}-{time.monotonic_ns()}@host"
    worker = f"{node}/7"
    settings.REDIS_URL = f"redis://127.0.0.1:{free_port()}/0"  # nothing listens there
    engine = EngineMetrics(worker=worker, model="demo", max_batch=4)
    engine.step(rows=2, seconds=0.001)
    engine.prefill(tokens=5, seconds=0.002)
    engine.queue_wait(0.01)
    engine.kv(in_use=64, budget=1024)
    engine.rows(running=2, waiting=1)

    assert recorder().flush() is False

    settings.REDIS_URL = reachable
    assert recorder().flush() is True
    client = metrics_redis()
    sent = {key.decode(): float(number) for key, number in client.hgetall(process_key(worker)).items()}
    # A latest value is sent again; the histograms' observations were dropped (a retry could count twice).
    assert sent["lmsp_engine_rows_running|demo"] == 2
    assert sent["lmsp_engine_kv_cache_budget_bytes|demo"] == 1024
    assert not client.exists(worker_key(node))
    engine.close()
    assert recorder().flush()
    client.delete(process_key(worker))
