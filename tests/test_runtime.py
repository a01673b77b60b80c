"""The runtime's promises under real processes, real signals and a real outage: a graceful stop
loses and reruns nothing, a running task keeps its lease through the grace period, timeouts
neither crash a worker nor let two attempts overlap, transactional handlers are never reported
lost, children die with their supervisor, a crash says so in its neighbours' rows, and claims
resume soon after the database returns. Handlers: tests/runtime_module.py."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import psycopg
import pytest
from conftest import spawn_cli, states, wait_until
from test_pool import child_pids, kill_tree, live_workers

from worker.engine.supervisor import child_command


def make_runs(conn: psycopg.Connection, schema: str) -> None:
    conn.execute(
        f"CREATE TABLE {schema}.runs (run bigserial PRIMARY KEY, task_id bigint, attempt int,"
        " pid int, started timestamptz, ended timestamptz)"
    )


def enqueue(conn: psycopg.Connection, schema: str, task: str, n: int, **payload: object) -> list:
    max_attempts = payload.pop("max_attempts", None)
    rows = conn.execute(
        f"INSERT INTO {schema}.tasks (task, payload, max_attempts)"
        " SELECT %s, %s::jsonb, %s FROM generate_series(1, %s) RETURNING id",
        (task, psycopg.types.json.Jsonb(payload), max_attempts, n),
    ).fetchall()
    return [r[0] for r in rows]


def overlapping_runs(conn: psycopg.Connection, schema: str) -> list[tuple]:
    """Pairs of runs of one task whose time spans overlap (a run that never ended lasts on)."""
    return conn.execute(
        f"SELECT a.task_id, a.attempt, b.attempt FROM {schema}.runs a JOIN {schema}.runs b"
        " ON a.task_id = b.task_id AND a.run < b.run"
        " AND tstzrange(a.started, coalesce(a.ended, 'infinity'))"
        " && tstzrange(b.started, coalesce(b.ended, 'infinity'))"
    ).fetchall()


def env(dsn: str, schema: str, **extra: str) -> dict[str, str]:
    return {"WORKER_DSN": dsn, "WORKER_SCHEMA": schema, **extra}


@contextlib.contextmanager
def pool(
    dsn: str, schema: str, *flags: str, log: Path | None = None, **extra: str
) -> Iterator[subprocess.Popen]:
    out = open(log, "a") if log else None  # noqa: SIM115 - closed below
    proc = spawn_cli(
        "run",
        "runtime_module",
        "--schema",
        schema,
        *flags,
        env=env(dsn, schema, **extra),
        stderr=out,
    )
    try:
        yield proc
    finally:
        kill_tree(proc)
        if out:
            out.close()


def done(conn: psycopg.Connection, schema: str) -> int:
    return states(conn, schema).get("done", 0)


@pytest.mark.slow
def test_repeated_graceful_stops_of_a_busy_pool_lose_and_rerun_nothing(
    pg_dsn: str, schema: str, conn: psycopg.Connection
) -> None:
    """Eight SIGTERM/restart cycles of a two-process pool draining 2 ms tasks: every exit is 0
    with nothing left in_progress, and every task ran exactly once (counted in `runs`)."""
    make_runs(conn, schema)
    n = 8000
    enqueue(conn, schema, "rt.sleep", n, s=0.002)
    flags = ("--processes", "2", "--concurrency", "20", "--grace", "30")
    for _cycle in range(8):
        before = done(conn, schema)
        with pool(pg_dsn, schema, *flags) as proc:
            wait_until(lambda b=before: done(conn, schema) >= min(b + 300, n), timeout=60)
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(timeout=60) == 0
        assert states(conn, schema).get("in_progress", 0) == 0, states(conn, schema)
        if done(conn, schema) == n:
            break
    with pool(pg_dsn, schema, *flags) as proc:
        wait_until(lambda: done(conn, schema) == n, timeout=120)
        # The cycles may have finished every task: then wait for this pool to be up, so that the
        # SIGTERM stops a running pool (as in the cycles) and not a process still importing.
        wait_until(lambda: len(live_workers(conn, schema)) >= 2, timeout=60)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
    assert states(conn, schema) == {"done": n}
    twice = conn.execute(
        f"SELECT task_id, count(*) FROM {schema}.runs GROUP BY 1 HAVING count(*) > 1 LIMIT 5"
    ).fetchall()
    assert twice == []
    assert conn.execute(f"SELECT count(*) FROM {schema}.runs WHERE ended IS NULL").fetchone() == (
        0,
    )


@pytest.mark.slow
def test_a_task_running_into_the_grace_period_keeps_its_lease(
    pg_dsn: str, schema: str, conn: psycopg.Connection
) -> None:
    """A deploy stops pool A while its task has 7 s to go, with a 2 s lease and pool B running:
    A keeps renewing the lease through its grace period, so B never starts the task; A finishes
    it, acknowledges it and exits 0."""
    make_runs(conn, schema)
    flags = ("--processes", "1", "--lease", "2", "--grace", "20", "--poll-interval", "0.2")
    with pool(pg_dsn, schema, *flags) as a:
        wait_until(lambda: a.pid in live_workers(conn, schema), timeout=30)
        [task] = enqueue(conn, schema, "rt.sleep", 1, s=8.0)
        wait_until(lambda: states(conn, schema) == {"in_progress": 1}, timeout=20)
        with pool(pg_dsn, schema, *flags) as b:
            wait_until(lambda: b.pid in live_workers(conn, schema), timeout=30)
            a.send_signal(signal.SIGTERM)
            assert a.wait(timeout=30) == 0
            assert states(conn, schema) == {"done": 1}
    runs = conn.execute(f"SELECT attempt, pid, ended IS NOT NULL FROM {schema}.runs").fetchall()
    assert runs == [(1, a.pid, True)]
    assert (
        conn.execute(f"SELECT attempts FROM {schema}.tasks WHERE id = %s", (task,)).fetchone()[0]
        == 1
    )


@pytest.mark.slow
def test_sigstop_and_sigcont_with_timeout_handlers_do_not_crash_the_worker(
    pg_dsn: str, schema: str, conn: psycopg.Connection
) -> None:
    """A worker frozen past its handlers' timeouts (SIGSTOP) and thawed (SIGCONT) three times
    keeps running in the same process, and every task still completes, never twice at once."""
    make_runs(conn, schema)
    n = 400
    enqueue(conn, schema, "rt.sync_timeout", n, s=0.05, max_attempts=20)
    flags = ("--processes", "1", "--concurrency", "4", "--lease", "30")
    with pool(pg_dsn, schema, *flags) as proc:
        wait_until(lambda: done(conn, schema) >= 20, timeout=30)
        for _ in range(3):
            proc.send_signal(signal.SIGSTOP)
            time.sleep(2.5)
            proc.send_signal(signal.SIGCONT)
            time.sleep(1.0)
            assert proc.poll() is None
        wait_until(lambda: done(conn, schema) == n, timeout=120)
        assert proc.poll() is None
    assert overlapping_runs(conn, schema) == []


@pytest.mark.slow
def test_handlers_past_their_timeout_never_overlap_and_do_not_stop_the_others(
    pg_dsn: str, schema: str, conn: psycopg.Connection, tmp_path: Path
) -> None:
    """A sync handler that runs 3 s with a 1 s timeout keeps its row leased (lease 1.5 s) until
    its thread returns, so a second worker never starts attempt 2 while attempt 1 runs; an
    async handler that blocks its loop past its timeout is written off the same way; quick
    tasks keep flowing meanwhile, and the worker process is never replaced."""
    make_runs(conn, schema)
    log = tmp_path / "worker.log"
    flags = ("--processes", "1", "--concurrency", "3", "--lease", "1.5", "--poll-interval", "0.2")
    with pool(pg_dsn, schema, *flags, log=log) as a, pool(pg_dsn, schema, *flags, log=log) as b:
        wait_until(lambda: len(live_workers(conn, schema)) == 2, timeout=30)
        [slow] = enqueue(conn, schema, "rt.sync_timeout", 1, s=3.0, max_attempts=2)
        [blocked] = enqueue(conn, schema, "rt.async_block", 1, s=3.0, max_attempts=2)
        quick = enqueue(conn, schema, "rt.async_quick", 60)
        wait_until(
            lambda: (
                conn.execute(
                    f"SELECT count(*) FROM {schema}.tasks WHERE id = ANY(%s) AND state = 'done'",
                    (quick,),
                ).fetchone()[0]
                == 60
            ),
            timeout=30,
        )
        wait_until(lambda: states(conn, schema) == {"done": 60, "failed": 2}, timeout=60)
        assert a.poll() is None and b.poll() is None
    assert overlapping_runs(conn, schema) == []
    for task in (slow, blocked):
        attempts, error = conn.execute(
            f"SELECT attempts, last_error FROM {schema}.tasks WHERE id = %s", (task,)
        ).fetchone()
        assert attempts == 2
        assert error.startswith("TimeoutError: handler ran"), error
        assert "past its timeout of 1s" in error
    assert conn.execute(
        f"SELECT count(*) FROM {schema}.runs WHERE task_id = ANY(%s)", ([slow, blocked],)
    ).fetchone() == (4,)
    assert "lost task" not in log.read_text()


@pytest.mark.slow
def test_transactional_handlers_with_a_timeout_are_never_reported_lost(
    pg_dsn: str, schema: str, conn: psycopg.Connection, tmp_path: Path
) -> None:
    """3,000 transactional handlers with a timeout on two processes: no crash, no task reported
    lost (the heartbeat used to wait on the handler's row lock and then find no lease), one
    committed run per task."""
    make_runs(conn, schema)
    n = 3000
    log = tmp_path / "worker.log"
    enqueue(conn, schema, "rt.txn", n)
    flags = ("--processes", "2", "--concurrency", "10", "--lease", "1")
    with pool(pg_dsn, schema, *flags, log=log) as proc:
        wait_until(lambda: done(conn, schema) == n, timeout=120)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
    text = log.read_text()
    assert "lost task" not in text and "no longer owns" not in text
    assert "exited with" not in text  # no child was replaced
    assert conn.execute(
        f"SELECT count(DISTINCT task_id), count(*) FROM {schema}.runs"
    ).fetchone() == (
        n,
        n,
    )


@pytest.mark.slow
def test_children_die_with_a_supervisor_killed_while_they_import(
    pg_dsn: str, schema: str, conn: psycopg.Connection
) -> None:
    """SIGKILL to the supervisor while its children are still importing a slow module: no child
    is left behind (they used to be adopted by init and take work unsupervised)."""
    with pool(pg_dsn, schema, "--processes", "2", RUNTIME_IMPORT_SECONDS="30") as sup:
        wait_until(lambda: len(child_pids(sup)) == 2, timeout=20)
        time.sleep(0.5)  # they are inside the import now
        kids = [psutil.Process(pid) for pid in child_pids(sup)]
        sup.kill()
        sup.wait()
        _, alive = psutil.wait_procs(kids, timeout=3)
        assert alive == []
    assert live_workers(conn, schema) == {}


@pytest.mark.slow
def test_a_crashed_process_says_so_in_the_rows_it_was_running(
    pg_dsn: str, schema: str, conn: psycopg.Connection
) -> None:
    """A handler calls os._exit(1) beside three other tasks: the supervisor hands the dead
    process's rows back at once (not after the 30 s lease), each saying that the process died
    with exit code 1, at which attempt, and which tasks it was running; they run again and
    finish. A task that kills its process every time ends failed with that error."""
    make_runs(conn, schema)
    flags = ("--processes", "2", "--concurrency", "10", "--lease", "30")
    with pool(pg_dsn, schema, *flags) as sup:
        wait_until(lambda: len(live_workers(conn, schema)) == 2, timeout=30)
        ids = conn.execute(
            f"INSERT INTO {schema}.tasks (task, payload, max_attempts) VALUES"
            " ('rt.crash', '{\"once\": true, \"after\": 0.5}', 2),"
            " ('rt.neighbour', '{\"s\": 2}', 2), ('rt.neighbour', '{\"s\": 2}', 2),"
            " ('rt.neighbour', '{\"s\": 2}', 2) RETURNING id"
        ).fetchall()
        ids = [r[0] for r in ids]
        wait_until(lambda: states(conn, schema) == {"done": 4}, timeout=25)
        [poison] = enqueue(conn, schema, "rt.crash", 1, after=0.1, max_attempts=2)
        wait_until(lambda: states(conn, schema).get("failed") == 1, timeout=25)
        assert sup.poll() is None
    rows = conn.execute(
        f"SELECT id, attempts, last_error FROM {schema}.tasks WHERE id = ANY(%s) ORDER BY id",
        (ids,),
    ).fetchall()
    died = [r for r in rows if r[2] and r[2].startswith("WorkerDied:")]
    assert ids[0] in [r[0] for r in died], rows  # the crashing task's own row says so
    for _id, attempts, error in died:
        assert "died (exit code 1) during attempt 1" in error, error
        assert f"{ids[0]} (rt.crash)" in error, error
        assert attempts == 2
    state, attempts, error = conn.execute(
        f"SELECT state::text, attempts, last_error FROM {schema}.tasks WHERE id = %s", (poison,)
    ).fetchone()
    assert (state, attempts) == ("failed", 2)
    assert error.startswith("WorkerDied:") and "exit code 1" in error, error


def test_child_command_line_carries_no_dsn() -> None:
    """The supervisor passes the DSN to its children in their environment: a command line is
    readable by every user of the machine."""
    argv = ["run", "tasks", "--dsn", "postgresql://u:S3cret@h/db", "--dsn=postgresql://x:Y@h/d"]
    line = " ".join(child_command(argv))
    assert "S3cret" not in line and "Y@h" not in line
    assert os.path.basename(child_command(argv)[0]).startswith("python")


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_stopping_the_demo_stops_its_pool_gracefully(
    pg_dsn: str, sig: signal.Signals, tmp_path: Path
) -> None:
    """Ctrl-C (SIGINT) or SIGTERM to `worker demo` reaches its worker pool: every process it
    started is gone within the grace period, and no task is left in_progress."""
    schema = f"demo_{sig.name.lower()}"
    with psycopg.connect(pg_dsn, autocommit=True) as c:
        c.execute(f"DROP SCHEMA IF EXISTS {schema} CASCADE")
    proc = spawn_cli(
        "demo",
        "--dsn",
        pg_dsn,
        "--schema",
        schema,
        "--tasks",
        "20000",
        stdout=subprocess.DEVNULL,
        stderr=open(tmp_path / "demo.log", "w"),  # noqa: SIM115
    )
    try:
        with psycopg.connect(pg_dsn, autocommit=True) as c:

            def started() -> bool:
                try:
                    return len(live_workers(c, schema)) == 2 and done(c, schema) > 500
                except psycopg.errors.UndefinedTable:
                    return False  # the demo has not migrated its schema yet

            wait_until(started, timeout=60)
            family = psutil.Process(proc.pid).children(recursive=True)
            assert len(family) >= 3  # the pool's supervisor and its two children
            proc.send_signal(sig)
            proc.wait(timeout=60)
            _, alive = psutil.wait_procs(family, timeout=30)
            assert alive == []
            assert states(c, schema).get("in_progress", 0) == 0, states(c, schema)
            assert live_workers(c, schema) == {}
    finally:
        kill_tree(proc)
        with psycopg.connect(pg_dsn, autocommit=True) as c:
            c.execute(f"DROP SCHEMA IF EXISTS {schema} CASCADE")


@pytest.mark.slow
def test_sigterm_to_the_whole_process_group_still_stops_gracefully(
    pg_dsn: str, schema: str, conn: psycopg.Connection
) -> None:
    """systemd's default KillMode sends SIGTERM to every process of the service, and the
    supervisor then passes its own SIGTERM on: each child gets two. That must not cut the grace
    period short: the running tasks finish and are acknowledged, none is handed back."""
    make_runs(conn, schema)
    flags = ("--processes", "2", "--concurrency", "2", "--grace", "20")
    with pool(pg_dsn, schema, *flags) as sup:
        wait_until(lambda: len(live_workers(conn, schema)) == 2, timeout=30)
        enqueue(conn, schema, "rt.sleep", 4, s=3.0)
        wait_until(lambda: states(conn, schema) == {"in_progress": 4}, timeout=20)
        for pid in [sup.pid, *child_pids(sup)]:
            os.kill(pid, signal.SIGTERM)
        assert sup.wait(timeout=40) == 0
    assert states(conn, schema) == {"done": 4}
    assert conn.execute(f"SELECT count(*), count(ended) FROM {schema}.runs").fetchone() == (4, 4)
