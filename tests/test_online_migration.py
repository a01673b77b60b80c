"""Upgrading a database while its workers run: index builds that do not stop them, a migration
that does not queue them behind a transaction left open, an interrupted build finished by the
next `worker migrate`, and a roll forward from every earlier version with rows in the tables."""

from __future__ import annotations

import logging
import os
import threading
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import flows_module as fm
import psycopg
import pytest
from conftest import _dump_schema, wait_until
from test_runtime import overlapping_runs
from test_workflows import pool

import worker
import worker.db.migrate as migrator
from worker.cli.common import database_error
from worker.db.migrate import current_version, latest_version, migrate

# The last version before workflows (0022), which builds three indexes on the task table online.
BEFORE = 21
# The drain through a migration, below: at the suite's size, or with
# WORKER_TEST_MIGRATION_SCALE=full at that of a busy deployment (5,000,000 finished rows and
# 100,000 to drain; a few minutes).
FULL_SCALE = os.environ.get("WORKER_TEST_MIGRATION_SCALE") == "full"
FINISHED, LIVE, SLEEP = (5_000_000, 100_000, 0.005) if FULL_SCALE else (200_000, 3_000, 0.02)


@pytest.fixture
def old(pg_dsn: str) -> Iterator[str]:
    """A schema at version 21 holding queued, running and finished rows."""
    name = f"o_{uuid.uuid4().hex[:10]}"
    with psycopg.connect(pg_dsn, autocommit=True) as c:
        migrate(c, name, up_to=BEFORE)
        c.execute(
            f"INSERT INTO {name}.tasks (task, payload, state, attempts, finished_at)"
            f" SELECT 'm.t', '{{}}', 'done', 1, now() FROM generate_series(1, 2000)"
        )
        c.execute(f"INSERT INTO {name}.tasks (task) SELECT 'm.t' FROM generate_series(1, 200)")
    yield name
    with psycopg.connect(pg_dsn, autocommit=True) as c:
        c.execute(f"DROP SCHEMA IF EXISTS {name} CASCADE")


def in_thread(fn: Callable[[], Any]) -> tuple[threading.Thread, dict[str, Any]]:
    out: dict[str, Any] = {}

    def run() -> None:
        try:
            out["value"] = fn()
        except BaseException as exc:  # read by the test
            out["error"] = exc

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, out


def hold_online(monkeypatch: pytest.MonkeyPatch) -> tuple[threading.Event, threading.Event]:
    """Stop the migrator between a file's transaction and its online statements until the test
    says go: (reached, go)."""
    reached, go = threading.Event(), threading.Event()
    finish = migrator._finish_online

    def held(conn: psycopg.Connection, schema: str, m: migrator.Migration) -> None:
        reached.set()
        assert go.wait(60)
        finish(conn, schema, m)

    monkeypatch.setattr(migrator, "_finish_online", held)
    return reached, go


def write_and_claim(dsn: str, schema: str) -> None:
    """What a worker and a producer do, each statement allowed 3 s of lock waits: enqueue, claim
    with SKIP LOCKED, finish, and read by id."""
    with psycopg.connect(dsn, autocommit=True) as w:
        w.execute("SET lock_timeout = '3s'")
        (new,) = w.execute(
            f"INSERT INTO {schema}.tasks (task) VALUES ('m.w') RETURNING id"
        ).fetchone()
        with w.transaction():
            got = w.execute(
                f"SELECT id FROM {schema}.tasks WHERE state = 'queued' ORDER BY id"
                f" LIMIT 1 FOR UPDATE SKIP LOCKED"
            ).fetchone()
            assert got is not None
            w.execute(
                f"UPDATE {schema}.tasks SET state = 'done', finished_at = now() WHERE id = %s",
                got,
            )
        assert w.execute(f"SELECT state FROM {schema}.tasks WHERE id = %s", (new,)).fetchone()


def backend_waits(conn: psycopg.Connection, pid: int) -> str | None:
    row = conn.execute(
        "SELECT wait_event_type || ':' || wait_event FROM pg_stat_activity WHERE pid = %s", (pid,)
    ).fetchone()
    return row[0] if row else None


def index_state(conn: psycopg.Connection, schema: str, name: str) -> bool | None:
    """True: valid; False: invalid; None: absent."""
    row = conn.execute(
        "SELECT i.indisvalid FROM pg_index AS i JOIN pg_class AS c ON c.oid = i.indexrelid"
        " JOIN pg_namespace AS n ON n.oid = c.relnamespace WHERE n.nspname = %s AND c.relname = %s",
        (schema, name),
    ).fetchone()
    return None if row is None else bool(row[0])


def complete(conn: psycopg.Connection, schema: str, version: int) -> bool | None:
    row = conn.execute(
        f"SELECT complete FROM {schema}.schema_migrations WHERE version = %s", (version,)
    ).fetchone()
    return None if row is None else bool(row[0])


def test_index_builds_let_workers_write_while_a_transaction_holds_them_up(
    pg_dsn: str, conn: psycopg.Connection, old: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Between 0022's transaction and its index builds, a producer opens a transaction that wrote
    a row and stays open. A build waits for it (CREATE INDEX CONCURRENTLY does); meanwhile other
    sessions enqueue, claim and finish rows as usual. An index built inside the migration's
    transaction would hold a lock they queue behind until the open transaction ends."""
    reached, go = hold_online(monkeypatch)
    mconn = psycopg.connect(pg_dsn, autocommit=True)
    pid = mconn.info.backend_pid
    t, out = in_thread(lambda: migrate(mconn, old, up_to=22))
    try:
        assert reached.wait(60)
        assert complete(conn, old, 22) is False  # recorded, its indexes to come
        with psycopg.connect(pg_dsn) as probe:
            probe.execute(f"INSERT INTO {old}.tasks (task) VALUES ('m.probe')")
            go.set()
            wait_until(lambda: backend_waits(conn, pid) == "Lock:virtualxid", timeout=30)
            for _ in range(3):
                write_and_claim(pg_dsn, old)
            assert backend_waits(conn, pid) == "Lock:virtualxid"  # still building
            probe.commit()
        t.join(60)
        assert out.get("value") == ["0022_workflows"], out
    finally:
        go.set()
        t.join(60)
        mconn.close()
    assert complete(conn, old, 22) is True
    for name in ("tasks_workflow_idx", "tasks_unsettled_idx", "tasks_waiting_free_idx"):
        assert index_state(conn, old, name) is True


def test_a_migration_does_not_queue_the_workers_behind_an_open_transaction(
    pg_dsn: str,
    conn: psycopg.Connection,
    old: str,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A session keeps a transaction open that read the task table (a report left in psql). The
    migration's ALTER TABLE waits for it; every later statement on the table would queue behind
    that wait. The migration gives up its place after LOCK_TIMEOUT and tries again, so the
    workers' statements get through meanwhile; it lands once the transaction ends."""
    monkeypatch.setattr(migrator, "LOCK_TIMEOUT", 0.5)
    with psycopg.connect(pg_dsn) as report:
        report.execute(f"SELECT count(*) FROM {old}.tasks")
        mconn = psycopg.connect(pg_dsn, autocommit=True)
        pid = mconn.info.backend_pid
        with caplog.at_level(logging.WARNING, logger="worker"):
            t, out = in_thread(lambda: migrate(mconn, old, up_to=22))
            try:
                wait_until(lambda: backend_waits(conn, pid) == "Lock:relation", timeout=30)
                for _ in range(3):
                    write_and_claim(pg_dsn, old)
                assert "migration waits for a lock" in caplog.text
                assert t.is_alive() and complete(conn, old, 22) is None
                report.rollback()
                t.join(60)
            finally:
                report.rollback()
                t.join(60)
                mconn.close()
    assert out.get("value") == ["0022_workflows"], out
    assert complete(conn, old, 22) is True


def test_a_build_cut_off_is_finished_by_the_next_migrate(
    pg_dsn: str, conn: psycopg.Connection, old: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The migrating session dies while an index builds: the index is left invalid and the
    version incomplete. The next `worker migrate` drops the invalid index, builds it again and
    marks the version complete before it goes on."""
    reached, go = hold_online(monkeypatch)
    mconn = psycopg.connect(pg_dsn, autocommit=True)
    pid = mconn.info.backend_pid
    t, out = in_thread(lambda: migrate(mconn, old, up_to=22))
    with psycopg.connect(pg_dsn) as probe:
        assert reached.wait(60)
        probe.execute(f"INSERT INTO {old}.tasks (task) VALUES ('m.probe')")
        go.set()
        wait_until(lambda: backend_waits(conn, pid) == "Lock:virtualxid", timeout=30)
        conn.execute("SELECT pg_terminate_backend(%s)", (pid,))
        t.join(60)
        probe.commit()
    mconn.close()
    assert isinstance(out.get("error"), psycopg.OperationalError), out
    assert complete(conn, old, 22) is False
    assert index_state(conn, old, "tasks_workflow_idx") is False
    monkeypatch.undo()
    applied = migrate(conn, old)
    assert applied[0] == "0023_settle_after_lock"  # 0022 was finished first, not applied again
    assert complete(conn, old, 22) is True
    for name in ("tasks_workflow_idx", "tasks_unsettled_idx", "tasks_waiting_free_idx"):
        assert index_state(conn, old, name) is True


def test_every_earlier_version_rolls_forward_to_the_schema_of_a_fresh_install(
    pg_dsn: str, conn: psycopg.Connection
) -> None:
    """From each earlier version, with a queued, a finished and a failed row inserted by plain
    SQL: the upgrade gives the schema a fresh install gets (pg_dump of both, the names aside),
    and keeps the rows."""
    fresh = f"f_{uuid.uuid4().hex[:10]}"
    migrate(conn, fresh)
    want = _dump_schema(pg_dsn, fresh)
    applied = recorded(conn, fresh)
    conn.execute(f"DROP SCHEMA {fresh} CASCADE")
    for version in range(1, latest_version()):
        name = f"r_{uuid.uuid4().hex[:10]}"
        try:
            migrate(conn, name, up_to=version)
            conn.execute(
                f"INSERT INTO {name}.tasks (task, state, attempts, finished_at, last_error)"
                f" VALUES ('r.q', 'queued', 0, NULL, NULL), ('r.d', 'done', 1, now(), NULL),"
                f" ('r.f', 'failed', 1, now(), 'Boom')"
            )
            migrate(conn, name)
            rows = conn.execute(f"SELECT task, state::text FROM {name}.tasks ORDER BY id")
            assert rows.fetchall() == [("r.q", "queued"), ("r.d", "done"), ("r.f", "failed")]
            conn.execute(f"DELETE FROM {name}.tasks")
            assert recorded(conn, name) == applied
            got = _dump_schema(pg_dsn, name).replace(name, fresh)
            assert _without_times(got) == _without_times(want), f"from version {version}"
        finally:
            conn.execute(f"DROP SCHEMA IF EXISTS {name} CASCADE")


def recorded(conn: psycopg.Connection, schema: str) -> list[tuple[int, str, bool]]:
    return conn.execute(
        f"SELECT version, name, complete FROM {schema}.schema_migrations ORDER BY version"
    ).fetchall()


def _without_times(dump: str) -> str:
    """The dump without its rows (times differ; `recorded` compares the record of migrations)
    and the sequences' positions."""
    lines = dump.splitlines()
    return "\n".join(
        line for line in lines if not line.startswith(("INSERT INTO", "SELECT pg_catalog.setval"))
    )


def test_a_migration_held_up_for_good_stops_with_one_line(
    pg_dsn: str, conn: psycopg.Connection, old: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The open transaction never ends: after its tries the migration stops with one line that
    says what to do, reported as a database error (exit 5), and the schema stays at 21."""
    monkeypatch.setattr(migrator, "LOCK_TIMEOUT", 0.2)
    monkeypatch.setattr(migrator, "LOCK_TRIES", 2)
    with psycopg.connect(pg_dsn) as report:
        report.execute(f"SELECT count(*) FROM {old}.tasks")
        with pytest.raises(psycopg.Error) as caught:
            migrate(conn, old)
    line, code = database_error(caught.value)
    assert code == 5 and "\n" not in line
    assert "gave up after 2 tries" in line and "end that transaction and run it again" in line
    assert current_version(conn, old) == BEFORE


def test_workers_drain_through_an_online_migration_losing_nothing_and_running_nothing_twice(
    pg_dsn: str, conn: psycopg.Connection, schema: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Real `worker run` processes drain 3,000 tasks over 200,000 finished rows (or 100,000 over
    5,000,000: FULL_SCALE) while a migration builds an index on the task table. A producer's
    transaction open meanwhile holds the build up (it waits for it): the workers go on finishing
    tasks all the while, and when it is over every task ran once, none two attempts at once, and
    the index is valid."""
    fm.make_runs(conn, schema)
    conn.execute(
        f"INSERT INTO {schema}.tasks (task, payload, state, attempts, finished_at)"
        " SELECT 'wf.noop', '{}', 'done', 1, now() FROM generate_series(1, %s)",
        (FINISHED,),
    )
    n = LIVE
    worker.enqueue_many(conn, "wf.add", ({"n": i, "s": SLEEP} for i in range(n)), schema=schema)
    probe_index = migrator.Migration(
        latest_version() + 1,
        "probe_index",
        "CREATE TABLE {schema}.probe (id integer);",
        ("CREATE INDEX CONCURRENTLY IF NOT EXISTS tasks_probe_idx ON {schema}.tasks (task, id)",),
    )
    real = migrator.migrations()
    monkeypatch.setattr(migrator, "migrations", lambda: [*real, probe_index])
    reached, go = hold_online(monkeypatch)
    done = f"SELECT count(*) FROM {schema}.tasks WHERE task = 'wf.add' AND state = 'done'"
    with pool(pg_dsn, schema, "--processes", "2", "--concurrency", "8"):
        wait_until(lambda: conn.execute(done).fetchone()[0] >= 100, timeout=60)
        mconn = psycopg.connect(pg_dsn, autocommit=True)
        pid = mconn.info.backend_pid
        t, out = in_thread(lambda: migrate(mconn, schema))
        try:
            assert reached.wait(60)
            with psycopg.connect(pg_dsn) as probe:
                probe.execute(f"INSERT INTO {schema}.tasks (task) VALUES ('wf.noop')")
                go.set()
                wait_until(lambda: backend_waits(conn, pid) == "Lock:virtualxid", timeout=30)
                before = conn.execute(done).fetchone()[0]
                assert before <= n - 300  # enough left to see the workers go on
                wait_until(lambda: conn.execute(done).fetchone()[0] >= before + 200)
                assert backend_waits(conn, pid) == "Lock:virtualxid"  # the build still waits
                probe.commit()
            t.join(60)
        finally:
            go.set()
            t.join(60)
            mconn.close()
        assert out.get("value") == [f"{probe_index.version:04d}_probe_index"], out
        wait_until(lambda: conn.execute(done).fetchone()[0] == n, timeout=120 + n / 500)
    runs = conn.execute(
        f"SELECT task_id, count(*) FROM {schema}.runs GROUP BY task_id HAVING count(*) > 1"
    ).fetchall()
    assert runs == []
    assert conn.execute(f"SELECT count(DISTINCT task_id) FROM {schema}.runs").fetchone()[0] == n
    assert overlapping_runs(conn, schema) == []
    assert index_state(conn, schema, "tasks_probe_idx") is True
    assert complete(conn, schema, probe_index.version) is True
