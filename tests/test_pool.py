"""The process pool under real signals: SIGKILL, SIGSTOP and SIGTERM sent to real `worker run`
processes. Handlers live in tests/faults_module.py and record every run in `executions`; a trigger
records every claim in `claims` (see create_tables), so a test can tell which process held a task
even when that process died before its handler wrote anything."""

from __future__ import annotations

import contextlib
import os
import random
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from datetime import datetime, timedelta

import psutil
import psycopg
import pytest
from conftest import run_cli, spawn_cli, states, wait_until

import worker

# -- helpers ------------------------------------------------------------------------------------


def create_tables(conn: psycopg.Connection, schema: str) -> None:
    """`executions`: one row per handler run that reached its end (faults_module writes it).
    `claims`: one row per claim, written by a trigger inside the claim's own transaction, so a
    claim made by a process that was killed a moment later is still on record."""
    conn.execute(
        f"CREATE TABLE {schema}.executions (task_id bigint, attempt int, pid int,"
        " worker_id uuid, started timestamptz, finished timestamptz)"
    )
    conn.execute(
        f"CREATE TABLE {schema}.claims (task_id bigint, attempt int, worker_id uuid,"
        " at timestamptz NOT NULL DEFAULT clock_timestamp())"
    )
    conn.execute(
        f"""CREATE FUNCTION {schema}.audit_claim() RETURNS trigger LANGUAGE plpgsql AS $$
        BEGIN
            INSERT INTO {schema}.claims (task_id, attempt, worker_id)
            VALUES (NEW.id, NEW.attempts, NEW.worker_id);
            RETURN NULL;
        END $$"""
    )
    conn.execute(
        f"CREATE TRIGGER audit_claim AFTER UPDATE ON {schema}.tasks FOR EACH ROW"
        " WHEN (NEW.state = 'in_progress' AND OLD.state <> 'in_progress')"
        f" EXECUTE FUNCTION {schema}.audit_claim()"
    )


def worker_env(dsn: str, schema: str, **extra: str) -> dict[str, str]:
    return {"WORKER_DSN": dsn, "WORKER_SCHEMA": schema, **extra}


def run_args(dsn: str, schema: str, *extra: str) -> list[str]:
    return ["run", "faults_module", "--dsn", dsn, "--schema", schema, *extra]


def kill_tree(proc: subprocess.Popen) -> None:
    """SIGKILL a `worker run` and every process below it (children run in their own sessions,
    so they would outlive a killed supervisor). Only processes this test started."""
    try:
        kids = psutil.Process(proc.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        kids = []
    if proc.poll() is None:
        proc.kill()
        proc.wait()
    for kid in kids:
        with contextlib.suppress(psutil.NoSuchProcess):
            kid.kill()


@contextlib.contextmanager
def spawned(*args: str, env: dict[str, str]) -> Iterator[subprocess.Popen]:
    proc = spawn_cli(*args, env=env)
    try:
        yield proc
    finally:
        kill_tree(proc)


def child_pids(proc: subprocess.Popen) -> set[int]:
    """Live (not zombie) child processes of a supervisor."""
    pids = set()
    with contextlib.suppress(psutil.NoSuchProcess):
        for kid in psutil.Process(proc.pid).children():
            with contextlib.suppress(psutil.NoSuchProcess):
                if kid.status() != psutil.STATUS_ZOMBIE:
                    pids.add(kid.pid)
    return pids


def live_workers(conn: psycopg.Connection, schema: str) -> dict[int, str]:
    """pid -> worker id of registered workers that have not stopped."""
    rows = conn.execute(
        f"SELECT pid, id::text FROM {schema}.workers WHERE stopped_at IS NULL"
    ).fetchall()
    return {pid: wid for pid, wid in rows}


def db_now(conn: psycopg.Connection) -> datetime:
    return conn.execute("SELECT clock_timestamp()").fetchone()[0]


def enqueue_sql(
    conn: psycopg.Connection,
    schema: str,
    task: str,
    n: int,
    *,
    sleep: float = 0.0,
    max_attempts: int = 20,
) -> list[int]:
    rows = conn.execute(
        f"INSERT INTO {schema}.tasks (task, payload, max_attempts)"
        " SELECT %s, jsonb_build_object('sleep', %s::float8), %s"
        " FROM generate_series(1, %s) RETURNING id",
        (task, sleep, max_attempts, n),
    ).fetchall()
    return [r[0] for r in rows]


# -- chaos --------------------------------------------------------------------------------------


@pytest.mark.slow
def test_chaos_sigkill_children_loses_nothing_and_repeats_only_killed_runs(
    pg_dsn: str, schema: str, conn: psycopg.Connection
) -> None:
    """20,000 tasks through a 3-process pool while the test SIGKILLs a child holding tasks every
    0.2-0.6 s, until 95% are done. The supervisor keeps replacing the children and leases bring
    every task back.

    Proof of "a task ran more than once only if its worker was killed while holding it":
    `claims` (trigger-fed, in the claim's transaction) lists every (task, attempt, worker) claim,
    whether or not the process lived to run the handler; `workers` maps worker id -> pid; the
    test records every pid it killed. Then:
      - every task is `done`, and ran to the end at least once (an `executions` row);
      - the final claim of each task (its attempts and worker_id) has its execution row;
      - every other claim (a task claimed more than once) was made by a worker whose pid was
        killed, and every execution row of a non-final attempt comes from a killed pid;
      - claims of a task are numbered 1..attempts without gaps (no claim went unrecorded);
      - no two executions of one task overlap in time (a lease never expired under a live
        worker).
    """
    create_tables(conn, schema)
    n = 20_000
    enqueue_sql(conn, schema, "record", n, sleep=0.002)
    killed: set[int] = set()
    rng = random.Random(20240611)
    args = run_args(
        pg_dsn,
        schema,
        "--processes",
        "3",
        "--concurrency",
        "8",
        "--lease",
        "2",
        "--batch-size",
        "8",
        "--log-level",
        "WARNING",
    )
    with spawned(*args, env=worker_env(pg_dsn, schema)) as sup:
        wait_until(lambda: len(live_workers(conn, schema)) >= 3, timeout=30)
        deadline = time.monotonic() + 45
        while time.monotonic() < deadline:
            done = states(conn, schema).get("done", 0)
            if done >= n * 0.95 or len(killed) >= 60:
                break
            time.sleep(rng.uniform(0.2, 0.6))
            holders = {
                pid
                for (pid,) in conn.execute(
                    f"SELECT DISTINCT w.pid FROM {schema}.tasks t JOIN {schema}.workers w"
                    " ON w.id = t.worker_id WHERE t.state = 'in_progress'"
                )
            }
            victims = sorted(child_pids(sup) & holders)
            if victims:
                pid = rng.choice(victims)
                os.kill(pid, signal.SIGKILL)
                killed.add(pid)
        assert sup.poll() is None, "supervisor gave up during the chaos"
        wait_until(lambda: states(conn, schema) == {"done": n}, timeout=60, interval=0.25)
        sup.send_signal(signal.SIGTERM)
        assert sup.wait(timeout=30) == 0
    assert len(killed) >= 10, killed

    killed_list = sorted(killed)
    q = conn.execute
    assert (
        q(
            f"SELECT count(*) FROM {schema}.tasks t WHERE NOT EXISTS"
            f" (SELECT 1 FROM {schema}.executions e WHERE e.task_id = t.id)"
        ).fetchone()[0]
        == 0
    )
    # The final claim ran to the end, in the process that then completed the row.
    assert (
        q(
            f"SELECT count(*) FROM {schema}.tasks t WHERE NOT EXISTS"
            f" (SELECT 1 FROM {schema}.executions e WHERE e.task_id = t.id"
            "   AND e.attempt = t.attempts AND e.worker_id = t.worker_id)"
        ).fetchone()[0]
        == 0
    )
    # Claims are numbered 1..attempts: nothing claimed a task without a record of it.
    gaps = q(
        f"SELECT count(*) FROM {schema}.tasks t LEFT JOIN (SELECT task_id, count(*) AS n,"
        " count(DISTINCT attempt) AS d, min(attempt) AS lo, max(attempt) AS hi"
        f" FROM {schema}.claims GROUP BY task_id) c ON c.task_id = t.id"
        " WHERE c.n IS DISTINCT FROM t.attempts OR c.d <> c.n OR c.lo <> 1"
        " OR c.hi <> t.attempts"
    ).fetchone()[0]
    assert gaps == 0
    # Every earlier claim belongs to a killed process...
    innocent_claims = q(
        f"SELECT c.task_id, c.attempt, w.pid FROM {schema}.claims c"
        f" JOIN {schema}.tasks t ON t.id = c.task_id"
        f" LEFT JOIN {schema}.workers w ON w.id = c.worker_id"
        " WHERE c.attempt <> t.attempts AND (w.pid IS NULL OR w.pid <> ALL(%s)) LIMIT 10",
        (killed_list,),
    ).fetchall()
    assert innocent_claims == []
    # ...and so does every run of an earlier attempt that got as far as recording itself.
    innocent_runs = q(
        f"SELECT e.task_id, e.attempt, e.pid FROM {schema}.executions e"
        f" JOIN {schema}.tasks t ON t.id = e.task_id"
        " WHERE e.attempt <> t.attempts AND e.pid <> ALL(%s) LIMIT 10",
        (killed_list,),
    ).fetchall()
    assert innocent_runs == []
    overlaps = q(
        f"SELECT count(*) FROM {schema}.executions a JOIN {schema}.executions b"
        " ON a.task_id = b.task_id AND a.ctid < b.ctid"
        " AND tstzrange(a.started, a.finished) && tstzrange(b.started, b.finished)"
    ).fetchone()[0]
    assert overlaps == 0
    # The chaos did bite: some tasks were claimed again after their holder was killed.
    reclaimed = q(f"SELECT count(*) FROM {schema}.tasks WHERE attempts > 1").fetchone()[0]
    assert reclaimed > 0


# -- graceful stop ------------------------------------------------------------------------------


def test_sigterm_to_the_supervisor_finishes_short_tasks_and_hands_back_long_ones(
    pg_dsn: str, schema: str, conn: psycopg.Connection
) -> None:
    """SIGTERM during a run: tasks shorter than the grace period finish (after the signal) and
    are done; tasks longer than it go back to queued with the attempt not counted; nothing stays
    in_progress; every process exits 0 within grace + margin."""
    create_tables(conn, schema)
    grace = 3.0
    args = run_args(
        pg_dsn,
        schema,
        "--processes",
        "2",
        "--concurrency",
        "4",
        "--grace",
        str(grace),
        "--lease",
        "10",
    )
    with spawned(*args, env=worker_env(pg_dsn, schema)) as sup:
        wait_until(lambda: len(live_workers(conn, schema)) == 2, timeout=30)
        short = enqueue_sql(conn, schema, "slow", 4, sleep=2.0)
        long = enqueue_sql(conn, schema, "slow", 4, sleep=60.0)
        wait_until(lambda: states(conn, schema) == {"in_progress": 8}, timeout=20)
        signalled = db_now(conn)
        start = time.monotonic()
        sup.send_signal(signal.SIGTERM)
        code = sup.wait(timeout=grace + 30)
        elapsed = time.monotonic() - start
    assert code == 0
    assert elapsed < grace + 10, elapsed
    rows = {
        r[0]: r[1:]
        for r in conn.execute(
            f"SELECT id, state::text, attempts, started_at, lease_expires_at FROM {schema}.tasks"
        )
    }
    assert {i: rows[i][:2] for i in short} == {i: ("done", 1) for i in short}
    assert {i: rows[i] for i in long} == {i: ("queued", 0, None, None) for i in long}
    runs = conn.execute(
        f"SELECT task_id, finished > %s FROM {schema}.executions", (signalled,)
    ).fetchall()
    assert sorted(runs) == [(i, True) for i in sorted(short)]  # they finished during the grace
    assert live_workers(conn, schema) == {}  # both processes unregistered


def test_a_second_sigterm_stops_the_pool_at_once(
    pg_dsn: str, schema: str, conn: psycopg.Connection
) -> None:
    """The first SIGTERM starts a graceful stop with a long grace period; a second one (an
    impatient operator, a second Ctrl-C) reaches the children too and they stop at once, handing
    their tasks back without counting the attempt."""
    create_tables(conn, schema)
    args = run_args(pg_dsn, schema, "--processes", "2", "--concurrency", "2", "--grace", "60")
    with spawned(*args, env=worker_env(pg_dsn, schema)) as sup:
        wait_until(lambda: len(live_workers(conn, schema)) == 2, timeout=30)
        enqueue_sql(conn, schema, "slow", 4, sleep=120.0)
        wait_until(lambda: states(conn, schema) == {"in_progress": 4}, timeout=20)
        sup.send_signal(signal.SIGTERM)
        time.sleep(1.0)
        assert sup.poll() is None  # still waiting for the tasks, as it should
        sup.send_signal(signal.SIGTERM)
        code = sup.wait(timeout=20)  # far less than the 60 s grace
    assert code == 0
    assert states(conn, schema) == {"queued": 4}
    assert conn.execute(f"SELECT max(attempts) FROM {schema}.tasks").fetchone()[0] == 0


@pytest.mark.slow
def test_children_die_when_the_supervisor_is_killed_and_their_rows_come_back(
    pg_dsn: str, schema: str, conn: psycopg.Connection
) -> None:
    """Children run in their own sessions, so a terminal's Ctrl-C does not reach them; a
    SIGKILLed supervisor still takes them along (PR_SET_PDEATHSIG): none works on unsupervised,
    next to the pool a restarted supervisor would start. Their rows come back once their lease
    lapses, and the next pool runs them."""
    create_tables(conn, schema)
    args = run_args(pg_dsn, schema, "--processes", "2", "--concurrency", "2", "--lease", "2")
    with spawned(*args, env=worker_env(pg_dsn, schema)) as sup:
        wait_until(lambda: len(live_workers(conn, schema)) == 2, timeout=30)
        enqueue_sql(conn, schema, "slow", 4, sleep=120.0)
        wait_until(lambda: states(conn, schema) == {"in_progress": 4}, timeout=20)
        kids = [psutil.Process(pid) for pid in child_pids(sup)]
        sup.kill()
        sup.wait()
        _, alive = psutil.wait_procs(kids, timeout=3)
        assert alive == []
    assert states(conn, schema) == {"in_progress": 4}
    flags = ("--processes", "1", "--concurrency", "4", "--lease", "2")
    with spawned(*run_args(pg_dsn, schema, *flags), env=worker_env(pg_dsn, schema)) as again:
        wait_until(lambda: again.pid in live_workers(conn, schema), timeout=30)
        wait_until(
            lambda: (
                conn.execute(
                    f"SELECT count(*) FROM {schema}.tasks"
                    " WHERE attempts = 2 AND state = 'in_progress'"
                ).fetchone()[0]
                == 4
            ),
            timeout=20,
        )


def test_sigterm_while_children_are_still_starting_is_a_clean_stop(
    pg_dsn: str, schema: str
) -> None:
    """A stop that arrives while a child is still importing (before it installed its signal
    handlers) kills that child with SIGTERM's default action. It held no task, so this is a
    clean stop: exit 0, not the failure code a service manager would report."""
    env = worker_env(pg_dsn, schema, FAULTS_CHILD_IMPORT_SECONDS="5")
    with spawned(*run_args(pg_dsn, schema, "--processes", "2"), env=env) as sup:
        wait_until(lambda: len(child_pids(sup)) == 2, timeout=30)
        time.sleep(0.5)
        sup.send_signal(signal.SIGTERM)
        assert sup.wait(timeout=30) == 0


def test_a_slow_import_is_not_mistaken_for_a_stuck_child(
    pg_dsn: str, schema: str, conn: psycopg.Connection
) -> None:
    """Children that take longer to import the application than the stuck limit are left to
    start (the start-up allowance applies until their loop first runs), then do the work."""
    create_tables(conn, schema)
    env = worker_env(pg_dsn, schema, FAULTS_CHILD_IMPORT_SECONDS="5")
    args = run_args(pg_dsn, schema, "--processes", "2", "--stuck-after", "2")
    with spawned(*args, "--start-timeout", "60", env=env) as sup:
        wait_until(lambda: len(child_pids(sup)) == 2, timeout=30)
        first = child_pids(sup)
        wait_until(lambda: len(live_workers(conn, schema)) == 2, timeout=30)
        assert child_pids(sup) == first  # nobody was killed while importing
        assert set(live_workers(conn, schema)) == first
        ids = enqueue_sql(conn, schema, "record", 20)
        wait_until(lambda: states(conn, schema) == {"done": len(ids)}, timeout=30)
        sup.send_signal(signal.SIGTERM)
        assert sup.wait(timeout=30) == 0


def test_a_child_that_never_finishes_starting_is_replaced(
    pg_dsn: str, schema: str, conn: psycopg.Connection
) -> None:
    """An import that hangs (a network call at import time, say) does not hold a slot forever:
    past --start-timeout the child is killed and another is started in its place."""
    env = worker_env(pg_dsn, schema, FAULTS_CHILD_IMPORT_SECONDS="600")
    args = run_args(pg_dsn, schema, "--processes", "2")
    with spawned(*args, "--start-timeout", "2", env=env) as sup:
        wait_until(lambda: len(child_pids(sup)) == 2, timeout=30)
        first = child_pids(sup)
        wait_until(lambda: len(child_pids(sup) - first) == 2, timeout=30)
        assert sup.poll() is None  # replacing them is not giving up (yet)


# -- rescue -------------------------------------------------------------------------------------


def test_sigkilled_workers_tasks_are_rescued_within_one_and_a_half_leases(
    pg_dsn: str, schema: str, conn: psycopg.Connection
) -> None:
    """Worker A holds tasks and is SIGKILLed; worker B rescues them and claims them again within
    1.5 lease periods, as the README says (expiry <= one lease after the last heartbeat, then
    B's rescue timer of ~lease/4, which wakes its claim loop), with the lost attempt counted and
    explained in last_error. A task out
    of attempts becomes failed with LeaseExpired instead of running again."""
    create_tables(conn, schema)
    # The promise is in leases; a lease of 6 s leaves 1.5 s between the latest the rescue may
    # come (one lease plus its timer's lease/4) and the bound, which holds on a busy machine
    # where a 2 s lease's 0.5 s did not.
    lease = 6.0
    flags = (
        "--processes",
        "1",
        "--concurrency",
        "4",
        "--lease",
        str(lease),
        "--poll-interval",
        "0.5",
    )
    env = worker_env(pg_dsn, schema)
    with spawned(*run_args(pg_dsn, schema, *flags), env=env) as a:
        wait_until(lambda: a.pid in live_workers(conn, schema), timeout=30)
        again = enqueue_sql(conn, schema, "slow", 3, sleep=4.0, max_attempts=5)
        last = enqueue_sql(conn, schema, "slow", 1, sleep=4.0, max_attempts=1)[0]
        wait_until(lambda: states(conn, schema) == {"in_progress": 4}, timeout=20)
        with spawned(*run_args(pg_dsn, schema, *flags), env=env) as b:
            wait_until(lambda: b.pid in live_workers(conn, schema), timeout=30)
            b_id = live_workers(conn, schema)[b.pid]
            killed_at = db_now(conn)
            a.kill()
            a.wait()
            wait_until(
                lambda: (
                    conn.execute(
                        f"SELECT count(*) FROM {schema}.claims WHERE worker_id = %s", (b_id,)
                    ).fetchone()[0]
                    == 3
                ),
                timeout=30,
            )
            reclaimed = conn.execute(
                f"SELECT max(at) FROM {schema}.claims WHERE worker_id = %s", (b_id,)
            ).fetchone()[0]
            assert reclaimed - killed_at < timedelta(seconds=1.5 * lease), reclaimed - killed_at
            wait_until(lambda: states(conn, schema) == {"done": 3, "failed": 1}, timeout=30)
    rows = conn.execute(
        f"SELECT id, state::text, attempts, last_error, worker_id::text FROM {schema}.tasks"
        " ORDER BY id"
    ).fetchall()
    for task_id, state, attempts, error, owner in rows:
        assert error.startswith("LeaseExpired: worker "), error
        assert "during attempt 1" in error
        if task_id == last:
            assert (state, attempts, owner) != ("done", 2, b_id)
            assert (state, attempts) == ("failed", 1)
        else:
            assert (state, attempts, owner) == ("done", 2, b_id)
    # A was killed before any handler finished: every recorded run is B's second attempt.
    runs = conn.execute(f"SELECT task_id, attempt, pid FROM {schema}.executions ORDER BY 1")
    assert runs.fetchall() == [(i, 2, b.pid) for i in again]


# -- the supervisor -----------------------------------------------------------------------------


def test_supervisor_replaces_a_killed_child(
    pg_dsn: str, schema: str, conn: psycopg.Connection
) -> None:
    create_tables(conn, schema)
    with spawned(
        *run_args(pg_dsn, schema, "--processes", "2"), env=worker_env(pg_dsn, schema)
    ) as sup:
        wait_until(lambda: len(live_workers(conn, schema)) == 2, timeout=30)
        first = child_pids(sup)
        assert first == set(live_workers(conn, schema))
        victim = min(first)
        os.kill(victim, signal.SIGKILL)
        wait_until(
            lambda: len(child_pids(sup) - first) == 1 and victim not in child_pids(sup), timeout=30
        )
        new = (child_pids(sup) - first).pop()
        wait_until(lambda: new in live_workers(conn, schema), timeout=30)
        # The replacement works: a task enqueued now is done.
        enqueue_sql(conn, schema, "record", 20)
        wait_until(lambda: states(conn, schema) == {"done": 20}, timeout=30)
        assert sup.poll() is None
        sup.send_signal(signal.SIGTERM)
        assert sup.wait(timeout=30) == 0


def test_module_crashing_at_import_under_a_pool_is_one_line(
    tmp_path, pg_dsn: str, schema: str
) -> None:
    bad = tmp_path / "crashes_in_pool.py"
    bad.write_text("import worker\nraise RuntimeError('no API key configured')\n")
    r = run_cli("run", str(bad), "--processes", "3", "--dsn", pg_dsn, "--schema", schema)
    assert r.returncode == 2, (r.returncode, r.stderr)
    lines = [x for x in r.stderr.splitlines() if x.strip()]
    assert len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
    assert "RuntimeError: no API key configured" in lines[0]


@pytest.mark.slow
def test_supervisor_gives_up_on_a_child_that_keeps_dying(
    pg_dsn: str, schema: str, conn: psycopg.Connection
) -> None:
    """faults_module imports fine in the supervisor but every child exits 1 while importing it
    (FAULTS_CHILD_DIES): after max_deaths deaths within the death window the supervisor stops
    restarting and exits non-zero, instead of restarting a broken deployment forever."""
    create_tables(conn, schema)
    env = worker_env(pg_dsn, schema, FAULTS_CHILD_DIES="1")
    with spawned(*run_args(pg_dsn, schema, "--processes", "2"), env=env) as sup:
        code = sup.wait(timeout=55)
    assert code == 1
    assert live_workers(conn, schema) == {}


def test_a_stopped_child_is_detected_as_stuck_killed_and_replaced(
    pg_dsn: str, schema: str, conn: psycopg.Connection
) -> None:
    """SIGSTOP freezes a child the way a handler holding the GIL in C code would: its liveness
    file goes stale, the supervisor kills it after --stuck-after seconds and starts another, and
    the tasks the frozen child held are rescued and done."""
    create_tables(conn, schema)
    stuck_after = 3.0
    args = run_args(
        pg_dsn,
        schema,
        "--processes",
        "2",
        "--concurrency",
        "2",
        "--lease",
        "2",
        "--stuck-after",
        str(stuck_after),
    )
    with spawned(*args, env=worker_env(pg_dsn, schema)) as sup:
        wait_until(lambda: len(live_workers(conn, schema)) == 2, timeout=30)
        # Let the supervisor's start-up allowance (stuck_after from spawn) pass first.
        time.sleep(stuck_after)
        ids = enqueue_sql(conn, schema, "slow", 4, sleep=1.5)
        wait_until(lambda: states(conn, schema).get("in_progress") == 4, timeout=20)
        first = child_pids(sup)
        victim = min(first)
        os.kill(victim, signal.SIGSTOP)
        stopped = time.monotonic()
        wait_until(
            lambda: victim not in child_pids(sup) and len(child_pids(sup)) == 2,
            timeout=stuck_after + 20,
        )
        # Not before its time: the file was at most ~2 s old when the child froze.
        assert time.monotonic() - stopped >= stuck_after - 2.0
        assert first - {victim} <= child_pids(sup)  # the healthy child was left alone
        new = (child_pids(sup) - first).pop()
        wait_until(lambda: new in live_workers(conn, schema), timeout=30)
        wait_until(lambda: states(conn, schema) == {"done": len(ids)}, timeout=30)
        assert sup.poll() is None
        sup.send_signal(signal.SIGTERM)
        assert sup.wait(timeout=30) == 0
    # The frozen child's tasks ran again elsewhere after its lease expired.
    runs = dict(conn.execute(f"SELECT task_id, count(*) FROM {schema}.executions GROUP BY 1"))
    assert set(runs) == set(ids)
    assert victim not in {pid for (pid,) in conn.execute(f"SELECT pid FROM {schema}.executions")}


def test_a_task_that_hangs_its_process_is_killed_with_it_and_fails_for_good(
    pg_dsn: str, schema: str, conn: psycopg.Connection
) -> None:
    """A poison task whose handler holds the GIL (a backtracking regex in C) freezes every thread
    of its process: no heartbeat, no liveness. Each process that takes it is killed as stuck and
    replaced (its supervisor hands its rows back saying so, unless the lease ran out first and
    another worker rescued them), and after max_attempts (2) the task is failed with that error.
    Meanwhile the pool survives and ordinary tasks are done."""
    create_tables(conn, schema)
    args = run_args(
        pg_dsn,
        schema,
        "--processes",
        "2",
        "--concurrency",
        "2",
        "--lease",
        "2",
        "--stuck-after",
        "3",
    )
    with spawned(*args, env=worker_env(pg_dsn, schema)) as sup:
        wait_until(lambda: len(live_workers(conn, schema)) == 2, timeout=30)
        time.sleep(3)  # past the supervisor's start-up allowance
        [poison] = enqueue_sql(conn, schema, "hog", 1, max_attempts=2)
        ids = enqueue_sql(conn, schema, "record", 200, sleep=0.01)
        wait_until(
            lambda: (
                conn.execute(
                    f"SELECT state::text FROM {schema}.tasks WHERE id = %s", (poison,)
                ).fetchone()[0]
                == "failed"
            ),
            timeout=50,
            interval=0.25,
        )
        wait_until(
            lambda: (
                conn.execute(
                    f"SELECT count(*) FROM {schema}.tasks WHERE state = 'done'"
                ).fetchone()[0]
                == len(ids)
            ),
            timeout=30,
        )
        assert sup.poll() is None
        wait_until(lambda: len(child_pids(sup)) == 2, timeout=10)  # the last one was replaced
    attempts, error = conn.execute(
        f"SELECT attempts, last_error FROM {schema}.tasks WHERE id = %s", (poison,)
    ).fetchone()
    assert attempts == 2
    # Whichever came first says so: the supervisor killing the stuck process (which hands its
    # rows back at once), or another worker rescuing the row when its 2 s lease ran out.
    if error.startswith("WorkerDied:"):
        assert "stopped responding" in error and "killed by its supervisor" in error, error
        assert f"{poison} (hog)" in error, error
    else:
        assert error.startswith("LeaseExpired:"), error
    assert "during attempt 2" in error, error
    # Two processes were killed for it, each after claiming it (one claim per attempt).
    owners = conn.execute(
        f"SELECT DISTINCT w.pid FROM {schema}.claims c JOIN {schema}.workers w"
        " ON w.id = c.worker_id WHERE c.task_id = %s",
        (poison,),
    ).fetchall()
    assert len(owners) == 2


# -- capacity -----------------------------------------------------------------------------------


def test_a_free_slot_is_used_while_long_tasks_hold_the_others(
    conn: psycopg.Connection, schema: str, thread_worker
) -> None:
    """Concurrency 4, three long tasks running: a task enqueued now must start in the fourth
    slot, not wait (possibly for the length of a long task) until half a batch of slots is free.
    Waiting for half a batch keeps claims large when tasks are short; with long tasks no slot
    frees up, and the worker ran below its concurrency."""
    release = threading.Event()
    started: list[str] = []
    reg = worker.Registry()

    @reg.task("long")
    def long(payload: dict) -> None:
        started.append("long")
        release.wait(60)

    @reg.task("quick")
    def quick(payload: dict) -> None:
        started.append("quick")

    with thread_worker(reg, concurrency=4, poll_interval=0.2):
        try:
            worker.enqueue_many(conn, "long", [{}] * 3, schema=schema)
            wait_until(lambda: started.count("long") == 3)
            worker.enqueue(conn, "quick", {}, schema=schema)
            wait_until(lambda: "quick" in started, timeout=10)
        finally:
            release.set()
