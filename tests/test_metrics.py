"""Metrics against a real database and real processes: what /metrics reports must agree with the
rows in the task table, across worker processes, and after one of them is killed."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
from conftest import ThreadWorker, spawn_cli, states, wait_until
from prometheus_client import REGISTRY
from prometheus_client.parser import text_string_to_metric_families

import worker
from worker.db.migrate import migrate
from worker.dev.embedded import EmbeddedPostgres
from worker.engine.loop import WorkerConfig
from worker.hooks import emit
from worker.monitor.metrics.counters import MetricsHooks
from worker.monitor.metrics.instruments import UNREGISTERED, exported_series, instruments
from worker.monitor.server import serve
from worker.tasks.registry import Registry

# -- helpers -------------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def fetch(url: str, timeout: float = 10.0) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()
    except OSError:
        return 0, ""


def scrape(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """/metrics as {(sample name, sorted labels): value}, parsed by prometheus-client's parser."""
    status, text = fetch(url)
    assert status == 200, text
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def total(samples: dict, name: str, **labels: str) -> float:
    """Sum of a sample over every label set that matches ``labels``."""
    want = set(labels.items())
    return sum(v for (n, lbls), v in samples.items() if n == name and want <= set(lbls))


def value(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


def executions_table(conn: psycopg.Connection, schema: str) -> None:
    conn.execute(
        f"CREATE TABLE {schema}.executions (task_id bigint, attempt int, pid int,"
        " started timestamptz, finished timestamptz)"
    )


# -- the hooks, in one process -------------------------------------------------------------------


def test_hooks_count_what_the_table_shows(
    pg_dsn: str, schema: str, conn: psycopg.Connection
) -> None:
    """Counters per queue and task after a run with successes, retries, permanent failures and a
    task nobody registered (handed back: counted as retried); the unknown name must not become a
    label value."""
    assert "PROMETHEUS_MULTIPROC_DIR" not in os.environ
    queue = f"mq_{uuid.uuid4().hex[:8]}"
    reg = Registry()

    @reg.task("m.ok", queue=queue)
    def ok(payload: dict) -> None:
        time.sleep(0.002)

    @reg.task("m.flaky", queue=queue, max_attempts=2, retry_backoff=0)
    def flaky(payload: dict) -> None:
        raise ValueError("always")

    @reg.task("m.fatal", queue=queue)
    def fatal(payload: dict) -> None:
        raise worker.DoNotRetry("no")

    conn.execute(
        f"INSERT INTO {schema}.tasks (task, queue, max_attempts)"
        " SELECT t, %s, 1 FROM unnest(%s::text[]) AS t",
        (queue, ["m.ok"] * 40 + ["m.fatal"] * 3 + ["<img src=x>"] * 2),
    )
    conn.execute(
        f"INSERT INTO {schema}.tasks (task, queue, max_attempts)"
        " SELECT 'm.flaky', %s, 2 FROM generate_series(1, 5)",
        (queue,),
    )
    config = WorkerConfig(
        dsn=pg_dsn, schema=schema, queues=[queue], poll_interval=0.1, concurrency=8, batch_size=10
    )
    hooks = MetricsHooks()
    before_processes = value("worker_processes")
    with ThreadWorker(config, reg, hooks=hooks) as tw:
        # The unknown task is handed back (scheduled, uncounted), not failed.
        wait_until(lambda: states(conn, schema) == {"done": 40, "failed": 8, "scheduled": 2})
        assert value("worker_processes") == before_processes + 1
        tw.stop()
    assert value("worker_processes") == before_processes
    assert value("worker_tasks_in_flight") == 0

    def c(name: str, task: str) -> float:
        return value(name, queue=queue, task=task)

    assert c("worker_tasks_completed_total", "m.ok") == 40
    assert c("worker_tasks_claimed_total", "m.ok") == 40
    assert c("worker_tasks_claimed_total", "m.flaky") == 10  # two attempts each
    assert c("worker_tasks_retried_total", "m.flaky") == 5
    assert c("worker_tasks_failed_total", "m.flaky") == 5
    assert c("worker_tasks_failed_total", "m.fatal") == 3
    assert c("worker_tasks_retried_total", "m.fatal") == 0
    assert c("worker_tasks_failed_total", UNREGISTERED) == 0
    assert c("worker_tasks_retried_total", UNREGISTERED) == 2  # handed back, to run later
    assert c("worker_tasks_claimed_total", "<img src=x>") == 0  # never a label
    assert c("worker_task_duration_seconds_count", "m.ok") == 40
    assert c("worker_task_duration_seconds_sum", "m.ok") >= 40 * 0.002
    assert c("worker_task_latency_seconds_count", "m.ok") == 40
    assert c("worker_task_latency_seconds_count", "m.flaky") == 10
    # Buckets are cumulative and end with +Inf == count.
    assert c_bucket(queue, "m.ok", "+Inf") == 40
    assert value("worker_claim_batch_size_count", queue=queue) >= 1
    assert value("worker_claim_batch_size_sum", queue=queue) == 55  # every attempt, retries too


def c_bucket(queue: str, task: str, le: str) -> float:
    return value("worker_task_duration_seconds_bucket", queue=queue, task=task, le=le)


def test_batched_histogram_matches_one_by_one_observation() -> None:
    """The batch path of the hooks must put values in the same buckets as ``observe`` does."""
    from prometheus_client import CollectorRegistry, Histogram

    from worker.monitor.metrics.instruments import DURATION_BUCKETS, _observe_many

    registry = CollectorRegistry()
    a = Histogram("a_seconds", "a", buckets=DURATION_BUCKETS, registry=registry)
    b = Histogram("b_seconds", "b", buckets=DURATION_BUCKETS, registry=registry)
    values = [0.0, 0.001, 0.0011, 0.005, 0.3, 1.0, 29.9, 30.0, 5000.0, 0.0049999]
    for v in values:
        a.observe(v)
    _observe_many(b, values)
    for le in [*map(str, DURATION_BUCKETS), "+Inf"]:
        assert registry.get_sample_value("a_seconds_bucket", {"le": le}) == (
            registry.get_sample_value("b_seconds_bucket", {"le": le})
        ), le
    assert registry.get_sample_value("a_seconds_sum") == pytest.approx(
        registry.get_sample_value("b_seconds_sum")
    )


def test_lock_and_cron_events_are_counted_once() -> None:
    """Cron code reports per schedule on the bus and the worker reports the tick's total through
    the hook: the same runs must not be counted twice, and runs only the hook saw still count."""
    instruments()
    won = value("worker_lock_acquisitions_total", kind="exclusive", result="won")
    lost = value("worker_lock_acquisitions_total", kind="exclusive", result="lost")
    emit("lock", kind="exclusive", name="nightly-report", won=True)
    emit("lock", kind="exclusive", name="nightly-report", won=False)
    emit("lock", kind="exclusive", name="nightly-report", won=False)
    assert value("worker_lock_acquisitions_total", kind="exclusive", result="won") == won + 1
    assert value("worker_lock_acquisitions_total", kind="exclusive", result="lost") == lost + 2

    key = f"sched-{uuid.uuid4().hex[:6]}"
    unknown = value("worker_cron_runs_enqueued_total", schedule="(unknown)")
    hooks = MetricsHooks()
    emit("cron_enqueued", schedule=key, count=2)
    hooks.cron_enqueued(None, 2)  # the same two runs
    assert value("worker_cron_runs_enqueued_total", schedule=key) == 2
    assert value("worker_cron_runs_enqueued_total", schedule="(unknown)") == unknown
    hooks.cron_enqueued(None, 3)  # runs the bus never reported
    assert value("worker_cron_runs_enqueued_total", schedule="(unknown)") == unknown + 3


def test_lost_rows_are_counted_and_never_pile_up() -> None:
    """A row lost to a rescue is counted once; rows whose loss the hooks never hear about (found
    at acknowledgement) are trimmed, so the id map stays bounded in a long-running worker."""
    from datetime import UTC, datetime

    from worker.store import Claimed

    reg = Registry()
    reg.task("t.lost", queue="lostq")(lambda payload: None)

    class Config:
        concurrency, batch_size = 2, 2

    class FakeWorker:
        registry = reg
        config = Config

    now = datetime.now(UTC)
    hooks = MetricsHooks()
    hooks.started(FakeWorker)
    lost_before = value("worker_tasks_lost_total", queue="lostq", task="t.lost")
    row = Claimed(1, "t.lost", {}, 1, 5, "lostq", 0, now, now, now)
    hooks.claimed(FakeWorker, [row])
    hooks.lost(FakeWorker, row)
    assert value("worker_tasks_lost_total", queue="lostq", task="t.lost") == lost_before + 1
    for start in range(100, 10_000, 2):
        hooks.claimed(
            FakeWorker,
            [Claimed(i, "t.lost", {}, 1, 5, "lostq", 0, now, now, now) for i in (start, start + 1)],
        )
    assert len(hooks._labels) <= hooks._limit
    hooks.stopped(FakeWorker)
    assert not hooks._labels


def test_db_errors_and_reconnects() -> None:
    hooks = MetricsHooks()
    errors, reconnects = value("worker_db_errors_total"), value("worker_db_reconnects_total")
    hooks.db_error(None, psycopg.OperationalError("down"))
    hooks.db_error(None, psycopg.OperationalError("still down"))
    assert value("worker_db_errors_total") == errors + 2
    assert value("worker_db_reconnects_total") == reconnects
    hooks.acked(None, "done", [])  # the loop got through to the database again
    hooks.acked(None, "done", [])
    assert value("worker_db_reconnects_total") == reconnects + 1


def test_a_torn_journal_write_leaves_the_previous_record(tmp_path: Path) -> None:
    """A kill in the middle of a journal write must not leave a record the supervisor would
    trust: the half-written one fails its checksum and the previous one is read instead."""
    from worker.monitor.metrics.journal import Journal, _read_record, counter_samples, journal_paths

    journal = Journal(str(tmp_path), 4242)
    key = ("default", "t")
    journal.write("100", counter_samples("worker_tasks_claimed", key, 3))
    journal.add(counter_samples("worker_tasks_claimed", key, 3))
    journal.write("101", counter_samples("worker_tasks_claimed", key, 2))
    assert _read_record(str(tmp_path), 4242) == {
        "xid": "101",
        "values": [["worker_tasks_claimed", "total", ["default", "t"], "", 5.0]],
    }
    # Tear the newest record: keep its header and half of its payload.
    newest = max(  # the file whose header has the higher sequence number
        journal_paths(str(tmp_path), 4242),
        key=lambda p: int.from_bytes(Path(p).read_bytes()[:8], "little"),
    )
    data = Path(newest).read_bytes()
    Path(newest).write_bytes(data[: len(data) // 2])
    assert _read_record(str(tmp_path), 4242)["xid"] == "100"


def test_a_journal_that_cannot_be_written_never_stops_the_work(
    pg_dsn: str, schema: str, conn: psycopg.Connection, tmp_path: Path, caplog
) -> None:
    """The journal lives on local disk, which can fill up or vanish. A write that fails must cost
    only the guarantee across kills: one warning, and every task is still done and counted."""
    from worker.monitor.metrics.journal import Journal

    queue = f"jq_{uuid.uuid4().hex[:8]}"
    reg = Registry()
    reg.task("j.ok", queue=queue)(lambda payload: None)
    conn.execute(
        f"INSERT INTO {schema}.tasks (task, queue) SELECT 'j.ok', %s FROM generate_series(1, 30)",
        (queue,),
    )
    hooks = MetricsHooks()
    broken = Journal(str(tmp_path), 4243)
    for fd in broken._fds:
        os.close(fd)  # every write now fails with EBADF, as a failing disk would fail it
    hooks._journal = broken
    config = WorkerConfig(dsn=pg_dsn, schema=schema, queues=[queue], poll_interval=0.1)
    with (
        caplog.at_level("WARNING", logger="worker.metrics"),
        ThreadWorker(config, reg, hooks=hooks),
    ):
        wait_until(lambda: states(conn, schema) == {"done": 30})
    assert value("worker_tasks_completed_total", queue=queue, task="j.ok") == 30
    assert value("worker_tasks_claimed_total", queue=queue, task="j.ok") == 30
    warnings = [r for r in caplog.records if "metrics journal unavailable" in r.getMessage()]
    assert len(warnings) == 1, [r.getMessage() for r in caplog.records]


def test_every_registered_metric_is_documented() -> None:
    """The list the deploy tests and the docs rely on must cover what the code registers."""
    instruments()
    registered = {
        s.name
        for metric in REGISTRY.collect()
        if metric.name.startswith("worker_")
        for s in metric.samples
        if not s.name.endswith("_created")
    }
    assert registered <= exported_series(), registered - exported_series()
    doc = (Path(__file__).resolve().parent.parent / "docs" / "reference" / "metrics.md").read_text()
    for name in exported_series():
        base = name.removesuffix("_bucket").removesuffix("_sum").removesuffix("_count")
        assert base in doc, f"{base} is not described in docs/reference/metrics.md"


# -- real processes ------------------------------------------------------------------------------


@pytest.fixture
def metrics_env(pg_dsn: str, schema: str) -> dict[str, str]:
    return {"WORKER_DSN": pg_dsn, "WORKER_SCHEMA": schema, "WORKER_METRICS_TTL": "0.2"}


@pytest.fixture
def stop_procs() -> Iterator[list[subprocess.Popen[str]]]:
    procs: list[subprocess.Popen[str]] = []
    yield procs
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    for p in procs:
        try:
            p.wait(timeout=30)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def run_with_metrics(
    pg_dsn: str,
    schema: str,
    env: dict[str, str],
    procs: list[subprocess.Popen[str]],
    *flags: str,
) -> tuple[subprocess.Popen[str], str]:
    """``worker run tasks_module FLAGS`` with /metrics on a free port: the process and the URL."""
    port = free_port()
    proc = spawn_cli(
        "run",
        "tasks_module",
        *flags,
        "--metrics-port",
        str(port),
        "--dsn",
        pg_dsn,
        "--schema",
        schema,
        env=env,
    )
    procs.append(proc)
    return proc, f"http://127.0.0.1:{port}/metrics"


def child_pids(conn: psycopg.Connection, schema: str, supervisor: int) -> list[int]:
    """Live worker processes of this supervisor, from the worker registry and /proc."""
    pids = [
        r[0] for r in conn.execute(f"SELECT pid FROM {schema}.workers WHERE stopped_at IS NULL")
    ]
    out = []
    for pid in pids:
        try:
            status = Path(f"/proc/{pid}/status").read_text()
        except OSError:
            continue
        ppid = int(
            next(line for line in status.splitlines() if line.startswith("PPid:")).split()[1]
        )
        if ppid == supervisor:
            out.append(pid)
    return out


def test_supervisor_aggregates_children_and_keeps_counts_of_a_killed_one(
    pg_dsn: str,
    schema: str,
    conn: psycopg.Connection,
    metrics_env: dict[str, str],
    stop_procs: list[subprocess.Popen[str]],
) -> None:
    """Two children behind one /metrics. One child is SIGKILLed mid-run and replaced: the totals
    still equal the table (completed == done rows, claimed == attempts made), its in-flight
    gauge disappears with it, and the database gauges agree with the table."""
    executions_table(conn, schema)
    n_ok, n_boom = 600, 20
    conn.execute(
        f"INSERT INTO {schema}.tasks (task, payload) SELECT 'record', '{{\"sleep\": 0.01}}'"
        " FROM generate_series(1, %s)",
        (n_ok,),
    )
    conn.execute(
        f"INSERT INTO {schema}.tasks (task, max_attempts) SELECT 'boom', 2"
        " FROM generate_series(1, %s)",
        (n_boom,),
    )
    # Queues no worker serves: delayed ones, and due ones that have waited about 100 s.
    conn.execute(
        f"INSERT INTO {schema}.tasks (task, queue, run_at) SELECT 'record', 'later',"
        " now() + interval '1 hour' FROM generate_series(1, 7)"
    )
    conn.execute(
        f"INSERT INTO {schema}.tasks (task, queue, run_at, created_at) SELECT 'record', 'orphan',"
        " now() - interval '100 seconds', now() - interval '200 seconds' FROM generate_series(1, 3)"
    )
    proc, url = run_with_metrics(
        pg_dsn,
        schema,
        metrics_env,
        stop_procs,
        *("--processes", "2", "--concurrency", "4", "--batch-size", "4", "--lease", "2"),
    )
    wait_until(lambda: len(child_pids(conn, schema, proc.pid)) == 2, timeout=30)
    wait_until(lambda: states(conn, schema).get("done", 0) >= 100, timeout=60)
    victim = child_pids(conn, schema, proc.pid)[0]
    os.kill(victim, signal.SIGKILL)

    def settled() -> bool:
        s = states(conn, schema)
        return s.get("done") == n_ok and s.get("failed") == n_boom

    wait_until(settled, timeout=120, interval=0.2)
    wait_until(lambda: len(child_pids(conn, schema, proc.pid)) == 2, timeout=30)

    done, failed, attempts = conn.execute(
        f"SELECT count(*) FILTER (WHERE state = 'done'), count(*) FILTER (WHERE state = 'failed'),"
        f" sum(attempts) FROM {schema}.tasks WHERE queue = 'default'"
    ).fetchone()
    rescued_rows = conn.execute(
        f"SELECT count(*) FROM {schema}.tasks"
        " WHERE last_error LIKE 'LeaseExpired%%' OR last_error LIKE 'WorkerDied%%'"
    ).fetchone()[0]

    def agrees() -> dict | None:
        m = scrape(url)
        counted = (
            total(m, "worker_tasks_completed_total"),
            total(m, "worker_tasks_failed_total"),
            total(m, "worker_tasks_claimed_total", queue="default"),
            total(m, "worker_tasks_in_flight"),
        )
        return m if counted == (done, failed, attempts, 0) else None

    try:
        m = wait_until(agrees, timeout=15, interval=0.3)
    except AssertionError:
        m = scrape(url)
        raise AssertionError(
            "metrics disagree with the table: "
            f"completed={total(m, 'worker_tasks_completed_total')} done={done}, "
            f"failed={total(m, 'worker_tasks_failed_total')} failed rows={failed}, "
            f"claimed={total(m, 'worker_tasks_claimed_total')} attempts={attempts}, "
            f"in flight={total(m, 'worker_tasks_in_flight')}"
        ) from None

    assert total(m, "worker_tasks_completed_total", queue="default", task="record") == n_ok
    assert total(m, "worker_processes") == 2  # the killed child no longer counts
    assert total(m, "worker_tasks_rescued_total") >= 1
    assert total(m, "worker_tasks_rescued_total") >= rescued_rows > 0
    # Each boom task: attempt 1 retried, attempt 2 failed (unless a rescue took one of them).
    assert total(m, "worker_tasks_retried_total") <= n_boom
    assert total(m, "worker_task_duration_seconds_count", task="record") >= n_ok
    assert total(m, "worker_task_latency_seconds_count") == attempts
    assert total(m, "worker_claim_batch_size_sum") == attempts

    # Database gauges, against the table.
    assert total(m, "worker_database_up") == 1
    assert total(m, "worker_queue_tasks", queue="default", state="queued") == 0
    assert total(m, "worker_queue_tasks", queue="default", state="in_progress") == 0
    # Delayed rows wait as 'scheduled' (schema/0006), not queued.
    assert total(m, "worker_queue_tasks", queue="later", state="queued") == 0
    assert total(m, "worker_queue_tasks", queue="later", state="scheduled") == 7
    assert total(m, "worker_queue_delayed_tasks", queue="later") == 7
    assert total(m, "worker_queue_oldest_task_age_seconds", queue="later") == 0
    assert total(m, "worker_queue_tasks", queue="orphan", state="queued") == 3
    assert total(m, "worker_queue_delayed_tasks", queue="orphan") == 0
    assert 99 <= total(m, "worker_queue_oldest_task_age_seconds", queue="orphan") < 200
    assert total(m, "worker_queue_tasks_capped", queue="orphan") == 0
    assert total(m, "worker_workers_alive") >= 2

    # Every sample name is one the deploy files may rely on.
    names = {n for n, _ in m if n.startswith("worker_")}
    assert names <= exported_series(), names - exported_series()

    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 0


def test_task_counts_stay_exact_through_repeated_sigkills(
    pg_dsn: str,
    schema: str,
    conn: psycopg.Connection,
    metrics_env: dict[str, str],
    stop_procs: list[subprocess.Popen[str]],
) -> None:
    """Children of a busy pool are SIGKILLed again and again while they claim and acknowledge
    small batches as fast as they can, so kills land between a COMMIT and the counting of what
    it committed. The counts must still equal the table exactly: claims (and the claim latency
    and batch size histograms) against attempts made, completions against done rows, failures
    against failed rows."""
    n_ok, n_boom = 6000, 300
    conn.execute(
        f"INSERT INTO {schema}.tasks (task) SELECT 'noop' FROM generate_series(1, %s)", (n_ok,)
    )
    conn.execute(
        f"INSERT INTO {schema}.tasks (task, max_attempts) SELECT 'boom', 2"
        " FROM generate_series(1, %s)",
        (n_boom,),
    )
    proc, url = run_with_metrics(
        pg_dsn,
        schema,
        metrics_env,
        stop_procs,
        *("--processes", "2", "--concurrency", "2", "--batch-size", "2", "--lease", "1"),
        *("--log-level", "WARNING"),
    )
    # Kills are paced by progress (every 150 tasks settled, at most one per 0.15 s), not by the
    # clock alone: on a fast run a fixed interval left too few kills for the test to mean much.
    kills, settled_at_kill, last_kill = 0, 0, 0.0
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        s = states(conn, schema)
        settled = s.get("done", 0) + s.get("failed", 0)
        if settled == n_ok + n_boom:
            break
        pids = child_pids(conn, schema, proc.pid)
        if (
            kills < 25
            and pids
            and s.get("queued", 0) > 500
            and settled - settled_at_kill >= 150
            and time.monotonic() - last_kill >= 0.15
        ):
            os.kill(pids[kills % len(pids)], signal.SIGKILL)
            kills += 1
            settled_at_kill, last_kill = settled, time.monotonic()
        time.sleep(0.05)
    s = states(conn, schema)
    assert s.get("done") == n_ok and s.get("failed") == n_boom, s
    assert kills >= 10, f"only {kills} kills landed; the run was too short to test anything"
    wait_until(lambda: len(child_pids(conn, schema, proc.pid)) == 2, timeout=30)

    done, failed, attempts = conn.execute(
        f"SELECT count(*) FILTER (WHERE state = 'done'), count(*) FILTER (WHERE state = 'failed'),"
        f" sum(attempts) FROM {schema}.tasks"
    ).fetchone()

    def counted(m: dict) -> tuple[float, ...]:
        return (
            total(m, "worker_tasks_completed_total"),
            total(m, "worker_tasks_failed_total"),
            total(m, "worker_tasks_claimed_total"),
            total(m, "worker_task_latency_seconds_count"),
            total(m, "worker_claim_batch_size_sum"),
        )

    want = (done, failed, attempts, attempts, attempts)
    try:
        wait_until(lambda: counted(scrape(url)) == want, timeout=30, interval=0.3)
    except AssertionError:
        raise AssertionError(
            f"after {kills} kills: (completed, failed, claimed, latency count, batch sum) = "
            f"{counted(scrape(url))}, the table says {want}"
        ) from None
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 0


def test_single_process_serves_its_own_metrics(
    pg_dsn: str,
    schema: str,
    conn: psycopg.Connection,
    metrics_env: dict[str, str],
    stop_procs: list[subprocess.Popen[str]],
) -> None:
    executions_table(conn, schema)
    conn.execute(f"INSERT INTO {schema}.tasks (task) SELECT 'record' FROM generate_series(1, 50)")
    proc, url = run_with_metrics(pg_dsn, schema, metrics_env, stop_procs, "--processes", "1")
    wait_until(lambda: states(conn, schema) == {"done": 50}, timeout=60)

    def all_counted() -> dict | None:
        m = scrape(url)
        return m if total(m, "worker_tasks_completed_total") == 50 else None

    m = wait_until(all_counted, timeout=10)
    assert total(m, "worker_processes") == 1
    assert total(m, "worker_queue_tasks", queue="default", state="queued") == 0
    assert fetch(url.replace("/metrics", "/healthz"))[0] == 200
    assert fetch(url.replace("/metrics", "/readyz"))[0] == 200
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 0


def test_children_without_a_metrics_port_count_nothing(
    pg_dsn: str, schema: str, conn: psycopg.Connection
) -> None:
    """Without --metrics-port nobody serves the numbers, so workers must not pay for them."""
    from worker.cli import build_parser
    from worker.cli.run import _worker_hooks
    from worker.hooks import Hooks

    args = build_parser().parse_args(["run", "m", "--processes", "1", "--child"])
    assert type(_worker_hooks(args)) is Hooks
    args = build_parser().parse_args(["run", "m", "--metrics-port", "9100", "--child"])
    assert isinstance(_worker_hooks(args), MetricsHooks)


# -- readiness against a database that goes away --------------------------------------------------


@pytest.mark.db  # a server of its own
def test_readyz_follows_the_database(tmp_path: Path) -> None:
    """/readyz: 503 while the schema is not migrated or the database is down, 200 otherwise, and
    it recovers without a restart; /healthz stays 200 throughout."""
    server = EmbeddedPostgres(tmp_path / "data", durable=False)
    dsn = server.start()
    metrics = serve("127.0.0.1", 0, dsn=dsn, schema="ready_test", ttl=0.2)
    base = f"http://127.0.0.1:{metrics.port}"
    try:
        status, body = fetch(base + "/readyz")
        assert status == 503 and "worker migrate" in body
        with psycopg.connect(dsn, autocommit=True) as c:
            migrate(c, "ready_test")
        wait_until(lambda: fetch(base + "/readyz")[0] == 200, timeout=10)

        server.stop()
        wait_until(lambda: fetch(base + "/readyz")[0] == 503, timeout=15)
        status, body = fetch(base + "/readyz")
        assert "database unreachable" in body
        assert fetch(base + "/healthz")[0] == 200
        wait_until(lambda: total(scrape(base + "/metrics"), "worker_database_up") == 0, timeout=10)
        assert fetch(base + "/")[0] == 503  # the page says what is wrong instead of failing

        server.start()
        wait_until(lambda: fetch(base + "/readyz")[0] == 200, timeout=30)
        wait_until(lambda: total(scrape(base + "/metrics"), "worker_database_up") == 1, timeout=10)
        assert fetch(base + "/")[0] == 200
    finally:
        metrics.stop()
        server.stop()
