"""Exclusive jobs, mutexes, timeout locks and advisory locks, against a real PostgreSQL and real
processes (kill -9 included)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from conftest import ROOT, run_cli, wait_until

import worker
from worker import hooks as _hooks
from worker.errors import ConfigError

LOCKS_MODULE = str(ROOT / "tests" / "locks_module.py")


@pytest.fixture
def events() -> Iterator[list[tuple[str, dict[str, Any]]]]:
    seen: list[tuple[str, dict[str, Any]]] = []

    def listener(event: str, **fields: Any) -> None:
        seen.append((event, fields))

    _hooks.subscribe(listener)
    yield seen
    _hooks._listeners.remove(listener)


def _spawn(*args: str, **kwargs: Any) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT / "tests")}
    return subprocess.Popen(
        [sys.executable, LOCKS_MODULE, *args],
        env=env,
        cwd=ROOT,
        text=True,
        stdout=subprocess.PIPE,
        **kwargs,
    )


def _first_line(proc: subprocess.Popen[str]) -> str:
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert line, f"process exited early with {proc.wait(timeout=5)}"
    return line.strip()


def _kill(proc: subprocess.Popen[str]) -> None:
    if proc.poll() is None:
        proc.kill()
    proc.wait(timeout=10)


# -- lock rows ------------------------------------------------------------------------------------


def test_acquire_is_exclusive_reentrant_and_expires_by_the_database_clock(
    conn: psycopg.Connection, schema: str, events: list
) -> None:
    a = worker.ExclusiveLock(conn, "report", ttl=0.5, schema=schema)
    b = worker.ExclusiveLock(conn, "report", ttl=0.5, schema=schema)
    assert a.acquire() is True
    assert b.acquire() is False
    assert a.acquire() is True  # re-entrant for the same holder
    expires = a.extend(2.0)
    db_now = conn.execute("SELECT now()").fetchone()[0]
    assert 1.5 < (expires - db_now).total_seconds() <= 2.0
    assert b.acquire() is False
    conn.execute(f"UPDATE {schema}.locks SET expires_at = now() - interval '1 second'")
    assert b.acquire() is True  # expired: anyone may take it
    with pytest.raises(worker.LockLost, match="no longer held"):
        a.extend()
    assert a.lost.is_set()
    with pytest.raises(worker.LockLost):
        a.check()
    assert [(e, f["kind"], f["won"]) for e, f in events if e == "lock"] == [
        ("lock", "exclusive", True),
        ("lock", "exclusive", False),
        ("lock", "exclusive", True),
        ("lock", "exclusive", False),
        ("lock", "exclusive", True),
    ]


def test_release_only_by_the_holder(conn: psycopg.Connection, schema: str) -> None:
    a = worker.ExclusiveLock(conn, "job", ttl=60, schema=schema)
    b = worker.ExclusiveLock(conn, "job", ttl=60, schema=schema)
    assert a.acquire()
    assert b.release() is False
    assert b.acquire() is False
    assert a.release() is True
    assert b.acquire() is True


def test_mutex_never_expires_and_timeout_lock_is_not_reentrant(
    conn: psycopg.Connection, schema: str, events: list
) -> None:
    m1 = worker.Mutex(conn, "import", schema=schema)
    m2 = worker.Mutex(conn, "import", schema=schema)
    assert m1.acquire() and m1.expires_at is None
    assert not m2.acquire()
    row = conn.execute(
        f"SELECT kind, expires_at = 'infinity' FROM {schema}.locks WHERE name = 'import'"
    ).fetchone()
    assert row == ("mutex", True)
    assert m1.release() and m2.acquire()

    t1 = worker.TimeoutLock(conn, "reminder", 0.4, schema=schema)
    t2 = worker.TimeoutLock(conn, "reminder", 0.4, schema=schema)
    assert t1.acquire()
    assert not t1.acquire()  # at most once per ttl, even for the same holder
    assert not t2.acquire()
    time.sleep(0.5)
    assert t2.acquire()
    kinds = {f["kind"] for e, f in events if e == "lock"}
    assert kinds == {"mutex", "timeout"}


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("", "non-empty"),
        ("x" * 256, "longer than 255"),
        ("bad\nname", "control characters"),
        (42, "non-empty string"),
    ],
)
def test_bad_lock_names_are_one_line_errors(
    conn: psycopg.Connection, name: Any, message: str
) -> None:
    for make in (
        lambda: worker.ExclusiveLock(conn, name),
        lambda: worker.advisory_keys(name),
        lambda: worker.exclusive(name),
    ):
        with pytest.raises(ConfigError, match=message) as info:
            make()
        assert "\n" not in str(info.value)


def test_wrong_targets_and_async_functions_are_refused_in_one_line() -> None:
    with pytest.raises(ConfigError, match=r"needs a psycopg Connection.*got int"):
        worker.ExclusiveLock(5432, "x")  # type: ignore[arg-type]
    bad_target: Any = None
    with pytest.raises(ConfigError, match="got NoneType"), worker.advisory_lock(bad_target, "x"):
        pass
    with pytest.raises(ConfigError, match="supports plain functions, not async def"):

        @worker.exclusive("x")
        async def job() -> None:
            pass


def test_bad_ttl_is_one_line_error(conn: psycopg.Connection) -> None:
    with pytest.raises(ConfigError, match="ttl must be positive"):
        worker.ExclusiveLock(conn, "x", ttl=0)
    with pytest.raises(ConfigError, match="ttl must be a number"):
        worker.ExclusiveLock(conn, "x", ttl="soon")  # type: ignore[arg-type]


def test_hold_extends_in_the_background_and_a_lost_lock_stops_the_job(
    pg_dsn: str, conn: psycopg.Connection, schema: str
) -> None:
    """The holder keeps the lock far past its ttl while working; when another instance takes it
    over, the next extension fails, `lost` is set and the job's next check() raises."""
    lock = worker.ExclusiveLock(pg_dsn, "long-job", ttl=0.6, schema=schema)
    other = worker.ExclusiveLock(conn, "long-job", ttl=30, schema=schema)
    lost_calls: list[worker.LockLost] = []
    steps: list[float] = []
    stolen_at: list[float] = []
    outcome: dict[str, Any] = {}

    def job() -> None:
        with lock.hold(extend_every=0.1, on_lost=lost_calls.append) as held:
            assert held.acquired
            try:
                while True:
                    held.check()
                    steps.append(time.monotonic())
                    time.sleep(0.02)
            except worker.LockLost as exc:
                outcome["stopped"] = time.monotonic()
                outcome["error"] = str(exc)

    t = threading.Thread(target=job)
    t.start()
    wait_until(lambda: steps)
    time.sleep(1.5)  # 2.5 ttls: only the extensions keep the lock
    assert not other.acquire()
    # Take it over as a contender would after an expiry the holder did not notice.
    conn.execute(f"UPDATE {schema}.locks SET expires_at = now() WHERE name = 'long-job'")
    assert other.acquire()
    stolen_at.append(time.monotonic())
    t.join(10)
    assert not t.is_alive()
    assert "no longer held" in outcome["error"]
    assert outcome["stopped"] - stolen_at[0] < 1.0  # within an extension period or so
    assert max(steps) <= outcome["stopped"]
    assert len(lost_calls) == 1 and lock.lost.is_set()
    # The new holder's lock is untouched by the loser.
    row = conn.execute(f"SELECT holder FROM {schema}.locks WHERE name = 'long-job'").fetchone()
    assert row == (other.holder,)


def test_exclusive_decorator_runs_one_of_many_concurrent_calls(pg_dsn: str, schema: str) -> None:
    runs: list[str] = []
    gate = threading.Event()

    @worker.exclusive("nightly", target=pg_dsn, schema=schema, ttl=5)
    def nightly(label: str) -> str:
        worker.current_lock().check()
        runs.append(label)
        gate.wait(5)
        return label

    results: list[str | None] = []
    threads = [
        threading.Thread(target=lambda i=i: results.append(nightly(f"t{i}"))) for i in range(8)
    ]
    for t in threads:
        t.start()
    wait_until(lambda: runs)
    time.sleep(0.5)
    gate.set()
    for t in threads:
        t.join(10)
    assert len(runs) == 1
    assert sorted(results, key=str) == sorted([runs[0], *[None] * 7], key=str)
    with pytest.raises(RuntimeError, match="only available inside"):
        worker.current_lock()


def test_exclusive_stacks_under_task_and_keeps_the_handler_signature(
    pg_dsn: str, conn: psycopg.Connection, schema: str, thread_worker: Any
) -> None:
    reg = worker.Registry()
    ran: list[int] = []

    @reg.task("guarded")
    @worker.exclusive("guarded", target=pg_dsn, schema=schema, ttl=30)
    def guarded(payload: dict, ctx: worker.Context) -> None:
        worker.current_lock().check()
        ran.append(ctx.task_id)

    definition = reg.get("guarded")
    assert definition is not None and definition.wants_context
    first = worker.enqueue(conn, "guarded", {}, schema=schema)
    with thread_worker(reg):
        wait_until(lambda: ran)
        # The lock is left to expire (no release): a second run within the ttl is skipped.
        worker.enqueue(conn, "guarded", {}, schema=schema)
        wait_until(
            lambda: (
                conn.execute(
                    f"SELECT count(*) FROM {schema}.tasks WHERE state = 'done'"
                ).fetchone()[0]
                == 2
            )
        )
    assert ran == [first]
    held = conn.execute(
        f"SELECT expires_at > now() FROM {schema}.locks WHERE name = 'guarded'"
    ).fetchone()
    assert held == (True,)


def test_exclusive_without_a_database_is_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("WORKER_DSN", raising=False)
    monkeypatch.delenv("DATABASE_URL", raising=False)

    @worker.exclusive("no-db")
    def job() -> None:
        pass

    with pytest.raises(ConfigError, match="has no database"):
        job()


@pytest.mark.slow
def test_many_contending_processes_and_threads_one_winner_per_slot(
    pg_dsn: str, conn: psycopg.Connection, schema: str
) -> None:
    """4 processes x 4 threads compete for one job lock at 8 scheduled triggers: each trigger is
    won exactly once, and the wins are spread over several contenders (jitter)."""
    conn.execute(
        f"CREATE TABLE {schema}.lock_attempts (slot int, pid int, holder text, won boolean)"
    )
    slots, period, ttl = 8, 2.0, 1.5
    args = ("contend", pg_dsn, schema, "singleton", f"{slots}", f"{period}", f"{ttl}", "4")
    procs = [_spawn(*args, stdin=subprocess.PIPE) for _ in range(4)]
    try:
        # The first trigger comes once every process has its four threads connected (a fixed
        # head start was either too short for four Python processes on a busy machine, leaving
        # the first slot without contenders, or seconds too long everywhere else).
        for p in procs:
            assert _first_line(p) == "ready"
        start = time.time() + 1.0
        for p in procs:
            assert p.stdin is not None
            p.stdin.write(f"{start}\n")
            p.stdin.close()
        for p in procs:
            assert p.wait(timeout=60) == 0
    finally:
        for p in procs:
            _kill(p)
    rows = conn.execute(
        f"SELECT slot, count(*), count(*) FILTER (WHERE won), count(DISTINCT pid)"
        f" FROM {schema}.lock_attempts GROUP BY slot ORDER BY slot"
    ).fetchall()
    assert [r[0] for r in rows] == list(range(slots))
    assert all(won == 1 for _, _, won, _ in rows), rows
    # Real contention: most contenders competed at most triggers.
    assert sum(n for _, n, _, _ in rows) >= slots * 16 * 0.75, rows
    assert all(pids >= 2 for *_, pids in rows), rows
    winners = conn.execute(
        f"SELECT count(DISTINCT holder) FROM {schema}.lock_attempts WHERE won"
    ).fetchone()[0]
    assert winners >= 2


@pytest.mark.slow
def test_holder_killed_with_sigkill_loses_the_lock_at_expiry(
    pg_dsn: str, conn: psycopg.Connection, schema: str
) -> None:
    """A holder extends its lock while alive; after kill -9 nobody extends it, and the next
    trigger after the expiry (by the database clock) takes over, not before."""
    ttl = 2.0
    proc = _spawn("hold", pg_dsn, schema, "etl", f"{ttl}")
    try:
        line = _first_line(proc)
        assert line.startswith("acquired=True"), line
        contender = worker.ExclusiveLock(conn, "etl", ttl=30, schema=schema)
        time.sleep(ttl * 1.5)
        assert not contender.acquire()  # kept alive by the holder's extensions
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)
        expires_at = conn.execute(
            f"SELECT expires_at FROM {schema}.locks WHERE name = 'etl'"
        ).fetchone()[0]
        # Triggers every 0.2 s, as a scheduler would fire them.
        while not contender.acquire():
            assert conn.execute("SELECT now()").fetchone()[0] < expires_at + _seconds(3)
            time.sleep(0.2)
        acquired_at = conn.execute(
            f"SELECT acquired_at FROM {schema}.locks WHERE name = 'etl'"
        ).fetchone()[0]
        assert acquired_at >= expires_at
    finally:
        _kill(proc)


def _seconds(n: float) -> Any:
    from datetime import timedelta

    return timedelta(seconds=n)


# -- advisory locks -------------------------------------------------------------------------------


def test_advisory_keys_are_stable_two_int4s_with_the_namespace_first() -> None:
    k1, k2 = worker.advisory_keys("nightly-report")
    assert (k1, k2) == worker.advisory_keys("nightly-report", "worker")
    assert all(-(2**31) <= k < 2**31 for k in (k1, k2))
    other_ns = worker.advisory_keys("nightly-report", "billing")
    assert other_ns[1] == k2 and other_ns[0] != k1
    assert worker.advisory_keys("other-job")[0] == k1
    # Stable across processes (Python's own hash() is salted per process).
    out = subprocess.run(
        [sys.executable, "-c", "import worker; print(worker.advisory_keys('nightly-report'))"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    assert out == str((k1, k2))


def test_advisory_xact_lock_commits_writes_with_the_release(
    pg_dsn: str, conn: psycopg.Connection, schema: str, events: list
) -> None:
    conn.execute(f"CREATE TABLE {schema}.outbox (msg text)")
    with worker.advisory_lock(pg_dsn, "sync") as lock:
        assert lock.acquired and not lock.session
        with worker.advisory_lock(conn, "sync") as again:
            assert not again.acquired
        lock.conn.execute(f"INSERT INTO {schema}.outbox VALUES ('sent')")
        # Not visible outside the lock's transaction until it commits.
        assert conn.execute(f"SELECT count(*) FROM {schema}.outbox").fetchone()[0] == 0
    assert conn.execute(f"SELECT count(*) FROM {schema}.outbox").fetchone()[0] == 1
    with pytest.raises(ZeroDivisionError), worker.advisory_lock(pg_dsn, "sync") as lock:
        assert lock.acquired
        lock.conn.execute(f"INSERT INTO {schema}.outbox VALUES ('lost')")
        _ = 1 / 0
    # The failure rolled back the write and released the lock.
    assert conn.execute(f"SELECT count(*) FROM {schema}.outbox").fetchone()[0] == 1
    with worker.advisory_lock(conn, "sync") as lock:
        assert lock.acquired
    assert [f["won"] for e, f in events if e == "lock" and f["kind"] == "advisory"] == [
        True,
        False,
        True,
        True,
    ]


def test_session_advisory_lock_is_held_until_the_block_ends(pg_dsn: str) -> None:
    with worker.advisory_lock(pg_dsn, "session-job", session=True) as lock:
        assert lock.acquired and lock.session
        lock.conn.execute("SELECT 1")  # transactions come and go; the lock stays
        with worker.advisory_lock(pg_dsn, "session-job") as other:
            assert not other.acquired
    with worker.advisory_lock(pg_dsn, "session-job", session=True) as lock:
        assert lock.acquired


@pytest.mark.slow
def test_advisory_lock_is_released_when_the_holding_process_is_killed(
    pg_dsn: str, conn: psycopg.Connection, schema: str
) -> None:
    proc = _spawn("advisory", pg_dsn, "ledger-close")
    try:
        line = _first_line(proc)
        assert line.startswith("acquired=True"), line
        backend_pid = int(line.split("backend_pid=")[1])
        with worker.advisory_lock(conn, "ledger-close") as lock:
            assert not lock.acquired
        r = run_cli("locks", "--dsn", pg_dsn, "--schema", schema, "--json")
        assert r.returncode == 0, r.stderr
        held = [a for a in json.loads(r.stdout)["advisory"] if a["pid"] == backend_pid]
        assert len(held) == 1
        assert (held[0]["key1"], held[0]["key2"]) == worker.advisory_keys("ledger-close")
        assert held[0]["namespace"] == "worker" and held[0]["granted"]
        assert "pg_try_advisory_xact_lock" in held[0]["query"]
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)

        def free() -> bool:
            with worker.advisory_lock(conn, "ledger-close") as lock:
                return lock.acquired

        wait_until(free, timeout=20)
    finally:
        _kill(proc)


# -- the `worker locks` command -------------------------------------------------------------------


def test_locks_cli_lists_rows_and_releases_a_stuck_mutex(
    pg_dsn: str, conn: psycopg.Connection, schema: str
) -> None:
    held = worker.ExclusiveLock(conn, "exports", ttl=120, schema=schema)
    assert held.acquire()
    stuck = worker.Mutex(conn, "migration", schema=schema, holder="old-host:1234")
    assert stuck.acquire()
    r = run_cli("locks", "--dsn", pg_dsn, "--schema", schema)
    assert r.returncode == 0, r.stderr
    assert "exports" in r.stdout and held.holder in r.stdout and "in 1" in r.stdout
    assert "migration" in r.stdout and "never" in r.stdout
    r = run_cli("locks", "--dsn", pg_dsn, "--schema", schema, "--release", "migration")
    assert r.returncode == 0, r.stderr
    assert "released mutex lock 'migration' (was held by old-host:1234)" in r.stdout
    assert worker.Mutex(conn, "migration", schema=schema).acquire()
    r = run_cli("locks", "--dsn", pg_dsn, "--schema", schema, "--release", "nope")
    assert r.returncode == 1
    assert r.stderr.strip() == "worker: error: no lock named 'nope'"
    r = run_cli("locks", "--dsn", pg_dsn, "--schema", schema, "--json")
    states = {row["name"]: row["held"] for row in json.loads(r.stdout)["locks"]}
    assert states == {"exports": True, "migration": True}


def test_purge_expired_locks_forgets_only_old_rows(conn: psycopg.Connection, schema: str) -> None:
    from worker.coord.exclusive import purge_expired_locks

    for name in ("a", "b", "c"):
        assert worker.ExclusiveLock(conn, name, ttl=60, schema=schema).acquire()
    conn.execute(
        f"UPDATE {schema}.locks SET expires_at = now() - interval '2 days' WHERE name <> 'c'"
    )
    assert purge_expired_locks(conn, schema=schema) == 2
    names = [r[0] for r in conn.execute(f"SELECT name FROM {schema}.locks")]
    assert names == ["c"]
