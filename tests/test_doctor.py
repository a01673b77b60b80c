"""`worker doctor` (issue 12): each check provoked for real on a database, and the figures it
reports; the claim probe leaves nothing changed; exit codes and --json; the gauges of /metrics and
the status page's panel; and no secret from a session's query text anywhere in its output.

pg_stat_activity, prepared transactions and replication slots are server-wide, and the test
server may be shared: every assertion about them is about the pid, gid or slot a test made
itself. Prepared transactions and logical slots need settings a shared server may not have, so
those tests start a server of their own (the embedded one) with them.
"""

from __future__ import annotations

import contextlib
import json
import time
import uuid
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from conftest import run_cli, wait_until
from psycopg import sql
from psycopg.conninfo import make_conninfo
from test_metrics import fetch, scrape

from worker.cli import doctor as doctor_cli
from worker.cli.main import main
from worker.db.migrate import migrate
from worker.dev.embedded import EmbeddedError, EmbeddedPostgres
from worker.monitor.doctor import horizon as doctor_horizon
from worker.monitor.doctor.checks import (
    connection_findings,
    routing_findings,
    running_findings,
)
from worker.monitor.doctor.checkup import Report, diagnose
from worker.monitor.doctor.claim import claim_findings
from worker.monitor.doctor.findings import CODES, SEVERITIES, Finding, Thresholds, redact_query
from worker.monitor.doctor.horizon import horizon_findings, slot_findings
from worker.monitor.doctor.tables import table_findings
from worker.monitor.page.health import render_doctor_panel
from worker.monitor.readmodel import Database
from worker.monitor.server import serve
from worker.ops.status import QueueStats, Routing

SECRET = "S3cretDoctorPW"
QUICK = {"xmin_warning_seconds": 0.5, "xmin_critical_seconds": 3600.0}


# -- helpers ---------------------------------------------------------------------------------------


def run(conn: psycopg.Connection, schema: str, probe: str = "off", **th: Any) -> Report:
    return diagnose(conn, schema, Thresholds(**th), probe=probe)


def of(report: Report, code: str) -> list[Finding]:
    return [f for f in report.findings if f.code == code]


def problems(report: Report, code: str) -> list[Finding]:
    return [f for f in of(report, code) if f.severity != "ok"]


def named(report: Report, code: str, pid: int) -> Finding | None:
    """The finding of ``code`` naming session ``pid``, if one does."""
    return next((f for f in problems(report, code) if f.details.get("pid") == pid), None)


def listed(report: Report, code: str, pid: int) -> bool:
    """``pid`` is named by a finding of ``code``, or listed among the sessions past the named
    ones (a shared server may have older holders of its own)."""
    if named(report, code, pid):
        return True
    return any(o["pid"] == pid for f in problems(report, code) for o in f.details.get("others", []))


@contextlib.contextmanager
def session(dsn: str, app: str, *statements: str) -> Iterator[int]:
    """Another connection, named ``app``, left inside the transaction its statements opened."""
    with psycopg.connect(dsn, application_name=app) as other:
        for statement in statements:
            other.execute(statement)
        pid = other.info.backend_pid
        try:
            yield pid
        finally:
            other.rollback()


def snapshot_held(dsn: str, app: str) -> contextlib.AbstractContextManager[int]:
    return session(dsn, app, "SET TRANSACTION ISOLATION LEVEL REPEATABLE READ", "SELECT 1")


def app_name() -> str:
    return f"doctor-test-{uuid.uuid4().hex[:8]}"


def dead_tasks(conn: psycopg.Connection, schema: str) -> int:
    row = conn.execute(
        "SELECT n_dead_tup FROM pg_stat_user_tables WHERE schemaname = %s AND relname = 'tasks'",
        (schema,),
    ).fetchone()
    return int(row[0]) if row else 0


# -- the xmin horizon ------------------------------------------------------------------------------


def test_a_held_snapshot_is_named_with_its_age_then_gone_once_released(
    conn: psycopg.Connection, schema: str, pg_dsn: str
) -> None:
    app = app_name()
    with snapshot_held(pg_dsn, app) as pid:
        time.sleep(1.2)
        report = run(conn, schema, **QUICK)
        assert listed(report, "xmin_horizon_held", pid), [f.summary for f in report.findings]
        f = named(report, "xmin_horizon_held", pid)
        if f is not None:  # named unless five older holders came first (a shared server)
            assert f.severity == "warning"
            assert f"pid {pid}" in f.summary and app in f.summary
            assert f.details["application_name"] == app
            assert f.details["xact_seconds"] >= 1.0
            assert f.details["state"] == "idle in transaction"
            assert "pg_terminate_backend" in f.action
            assert "dead row versions" in f.summary  # the pinned figure
        # Over the critical threshold it is critical.
        report = run(conn, schema, xmin_warning_seconds=0.1, xmin_critical_seconds=0.5)
        f = named(report, "xmin_horizon_held", pid)
        assert f is None or f.severity == "critical"
        # Under the default thresholds, a second is nothing to report.
        assert not listed(run(conn, schema), "xmin_horizon_held", pid)
    report = run(conn, schema, **QUICK)
    assert not listed(report, "xmin_horizon_held", pid)
    assert not listed(report, "idle_in_transaction", pid)


def test_idle_in_transaction_without_a_snapshot_is_its_own_finding(
    conn: psycopg.Connection, schema: str, pg_dsn: str
) -> None:
    """READ COMMITTED drops its snapshot after each statement: such a session holds no horizon,
    but it still holds its locks and a connection."""
    app = app_name()
    with session(pg_dsn, app, "SELECT 1") as pid:
        time.sleep(1.2)
        report = run(conn, schema, **QUICK)
        assert not listed(report, "xmin_horizon_held", pid)
        assert listed(report, "idle_in_transaction", pid)
        f = named(report, "idle_in_transaction", pid)
        if f is not None:
            assert f.severity == "warning" and app in f.summary
            assert f.details["state_seconds"] >= 1.0
    assert not listed(run(conn, schema, **QUICK), "idle_in_transaction", pid)


def test_a_secret_in_a_held_sessions_query_never_leaves_doctor(
    conn: psycopg.Connection, schema: str, pg_dsn: str
) -> None:
    """The query text of a session holding the horizon is shown, cut and with its password
    literal masked: in the findings, the CLI's lines and JSON, the panel, the page, /metrics."""
    role = f"doctor_{uuid.uuid4().hex[:8]}"
    app = app_name()
    statements = (
        "SET TRANSACTION ISOLATION LEVEL REPEATABLE READ",
        f"CREATE ROLE {role} PASSWORD '{SECRET}'",  # rolled back: the role never exists
    )
    with session(pg_dsn, app, *statements) as pid:
        time.sleep(1.2)
        report = run(conn, schema, **QUICK)
        assert listed(report, "xmin_horizon_held", pid)
        f = named(report, "xmin_horizon_held", pid)
        if f is not None:
            assert f"CREATE ROLE {role} PASSWORD '***'" in f.details["query"]
            assert "PASSWORD '***'" in f.summary
        outputs = {
            "findings": json.dumps(report.as_dict(), default=str),
            "panel": render_doctor_panel(report),
        }
        args = ("doctor", "--dsn", pg_dsn, "--schema", schema, "--xmin-warning", "0.5")
        for extra in ((), ("--json",)):
            done = run_cli(*args, *extra)
            assert done.returncode == 1, done.stderr
            outputs[f"cli {extra}"] = done.stdout + done.stderr
        server = serve("127.0.0.1", 0, dsn=pg_dsn, schema=schema, ttl=0)
        try:
            outputs["page"] = fetch(server.url)[1]
            outputs["metrics"] = fetch(server.url + "metrics")[1]
        finally:
            server.stop()
    for where, text in outputs.items():
        assert SECRET not in text, where
    assert outputs["page"] and "worker_doctor_findings" in outputs["metrics"]


def test_a_prepared_transaction_is_named_then_gone(special: tuple[str, str]) -> None:
    dsn, schema = special
    gid = f"doctor-test-{uuid.uuid4().hex[:8]}"
    with psycopg.connect(dsn, autocommit=True) as conn:
        with psycopg.connect(dsn) as other:
            other.execute("SELECT pg_current_xact_id()")  # a transaction id to keep
            other.execute(sql.SQL("PREPARE TRANSACTION {}").format(sql.Literal(gid)))
        try:
            time.sleep(1.2)
            report = run(conn, schema, **QUICK)
            found = [f for f in problems(report, "prepared_xact_held") if f.details["gid"] == gid]
            assert found, [f.summary for f in report.findings]
            f = found[0]
            assert f.severity == "warning" and gid in f.summary
            assert f.details["prepared_seconds"] >= 1.0
            assert "ROLLBACK PREPARED" in f.action
            assert report.figures["xmin_horizon_age_seconds"] >= 1.0
        finally:
            conn.execute(sql.SQL("ROLLBACK PREPARED {}").format(sql.Literal(gid)))
        report = run(conn, schema, **QUICK)
        assert not [f for f in problems(report, "prepared_xact_held") if f.details["gid"] == gid]


def test_an_inactive_logical_slot_is_named_then_gone(special: tuple[str, str]) -> None:
    """A logical slot holds the catalogs' horizon (catalog_xmin) and WAL; inactive, nobody
    consumes it."""
    dsn, schema = special
    slot = f"doctor_test_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("SELECT pg_create_logical_replication_slot(%s, 'pgoutput')", (slot,))
        try:
            report = run(conn, schema)
            found = [
                f
                for f in problems(report, "replication_slot_held")
                if f.details["slot_name"] == slot
            ]
            assert found, [f.summary for f in report.findings]
            f = found[0]
            assert f.severity == "warning" and "inactive" in f.summary and slot in f.summary
            assert f.details["catalog_xmin_age"] is not None
            assert "pg_drop_replication_slot" in f.action
        finally:
            conn.execute("SELECT pg_drop_replication_slot(%s)", (slot,))
        report = run(conn, schema)
        assert not [
            f for f in problems(report, "replication_slot_held") if f.details["slot_name"] == slot
        ]


def test_an_inactive_physical_slot_retaining_wal_is_named(
    conn: psycopg.Connection, schema: str
) -> None:
    settings = dict(
        conn.execute(
            "SELECT name, setting FROM pg_settings WHERE name IN ('wal_level',"
            " 'max_replication_slots')"
        ).fetchall()
    )
    if settings.get("wal_level") == "minimal" or settings.get("max_replication_slots") == "0":
        pytest.skip(f"this server cannot have a replication slot ({settings})")
    slot = f"doctor_test_{uuid.uuid4().hex[:8]}"
    conn.execute("SELECT pg_create_physical_replication_slot(%s, true)", (slot,))
    try:
        # An inactive slot that holds no horizon is only a problem once it retains much WAL.
        assert not [
            f
            for f in problems(run(conn, schema), "replication_slot_held")
            if f.details["slot_name"] == slot
        ]
        report = run(conn, schema, slot_wal_bytes=0)
        found = [
            f for f in problems(report, "replication_slot_held") if f.details["slot_name"] == slot
        ]
        assert found and found[0].details["retained_bytes"] >= 0
    finally:
        conn.execute("SELECT pg_drop_replication_slot(%s)", (slot,))


def test_a_role_without_pg_monitor_is_told_what_it_cannot_see(
    conn: psycopg.Connection, schema: str, pg_dsn: str
) -> None:
    """A role with only the worker's privileges on the schema (deploy/sql/roles.sql) runs every
    check, the rolled-back claim included, and is told that other roles' sessions are hidden."""
    role = f"doctor_{uuid.uuid4().hex[:8]}"
    conn.execute(f"CREATE ROLE {role} LOGIN")
    try:
        conn.execute(f"GRANT USAGE ON SCHEMA {schema} TO {role}")
        conn.execute(
            f"GRANT SELECT, INSERT, UPDATE, DELETE ON ALL TABLES IN SCHEMA {schema} TO {role}"
        )
        conn.execute(f"INSERT INTO {schema}.tasks (task, queue) VALUES ('x', 'q')")
        with (
            snapshot_held(pg_dsn, app_name()),
            psycopg.connect(make_conninfo(pg_dsn, user=role), autocommit=True) as limited,
        ):
            report = run(limited, schema, probe="claim")
        assert not of(report, "check_failed"), [f.summary for f in of(report, "check_failed")]
        hidden = of(report, "stats_hidden")
        assert len(hidden) == 1 and hidden[0].details["hidden"] >= 2  # conn and the snapshot
        assert "pg_monitor" in hidden[0].action
        assert of(report, "claim_cost_high")[0].details["probes"][0]["rows"] == 1
        assert of(report, "connections_low")[0].details["used"] >= 3
    finally:
        conn.execute(f"DROP OWNED BY {role}")
        conn.execute(f"DROP ROLE {role}")


# -- dead tuples and the claim's cost --------------------------------------------------------------


def test_dead_rows_pinned_by_a_snapshot_show_in_dead_tuples_and_the_claim_cost(
    conn: psycopg.Connection, schema: str, pg_dsn: str
) -> None:
    s = schema
    conn.execute(
        f"INSERT INTO {s}.tasks (task, queue) SELECT 'live', 'q' FROM generate_series(1, 5)"
    )
    baseline = run(conn, s, probe="claim")
    cost = of(baseline, "claim_cost_high")
    assert [f.severity for f in cost] == ["ok"], [f.summary for f in cost]
    probe = cost[0].details["probes"][0]
    assert probe["queue"] == "q" and probe["rows"] == 5
    assert "tasks_claim_idx" in probe["indexes"]
    assert probe["buffers"] <= probe["budget"]

    app = app_name()
    with snapshot_held(pg_dsn, app) as pid:
        # 20,000 rows claimed and finished before the live ones (an earlier run_at), then
        # deleted: their entries stay at the front of the queue's range while the snapshot
        # holds vacuum back. The writer's stats reach the server when it disconnects.
        with psycopg.connect(pg_dsn, autocommit=True) as writer:
            writer.execute(
                f"INSERT INTO {s}.tasks (task, queue, run_at) SELECT 'gone', 'q',"
                " now() - interval '1 hour' FROM generate_series(1, 20000)"
            )
            writer.execute(f"DELETE FROM {s}.tasks WHERE task = 'gone'")
        wait_until(lambda: dead_tasks(conn, s) >= 20000)
        time.sleep(0.6)
        conn.execute(f"VACUUM {s}.tasks")  # removes nothing: the snapshot is older
        assert dead_tasks(conn, s) >= 20000

        report = run(conn, s, probe="claim", dead_tuples_warning=10_000, **QUICK)
        assert listed(report, "xmin_horizon_held", pid)
        dead = [f for f in problems(report, "dead_tuples_high") if f.details["table"] == "tasks"]
        assert dead and dead[0].severity == "warning"
        assert dead[0].details["dead"] >= 20000 and f"{s}.tasks" in dead[0].summary
        assert "horizon" in dead[0].action  # vacuum cannot help until it is released
        f = named(report, "xmin_horizon_held", pid)
        if f is not None:
            assert f.details["pinned_dead"] >= 20000
        assert report.figures["tables"]["tasks"]["dead"] >= 20000

        for mode in ("claim", "read-only"):
            cost = problems(run(conn, s, probe=mode), "claim_cost_high")
            assert cost and cost[0].severity in ("warning", "critical"), mode
            probe = cost[0].details["probes"][0]
            assert probe["rows"] == 5 and probe["buffers"] > 5 * probe["budget"], probe
            assert "dead index entries" in cost[0].summary
        # A probe that runs into its statement timeout is as bad as it gets.
        (f,) = claim_findings(conn, s, ["q"], Thresholds(), statement_ms=1, horizon_held=True)
        assert f.severity == "critical" and "statement timeout" in f.summary, f.summary
        assert f.action.startswith("end the transaction holding the xmin horizon")


def test_the_claim_probe_changes_nothing(
    conn: psycopg.Connection, schema: str, pg_dsn: str
) -> None:
    """EXPLAIN ANALYZE runs the claim for real (it updates the rows it picks), in a transaction
    that is rolled back: every row is as it was, and no lock is left behind."""
    s = schema
    conn.execute(
        f"INSERT INTO {s}.tasks (task, queue, priority) SELECT 't' || g, 'q', g % 3"
        " FROM generate_series(1, 30) AS g"
    )
    conn.execute(
        f"INSERT INTO {s}.tasks (task, queue, state, attempts, finished_at)"
        " VALUES ('d', 'q', 'done', 1, now())"
    )
    table = f"SELECT to_jsonb(t)::text FROM {s}.tasks AS t ORDER BY id"
    before = conn.execute(table).fetchall()
    found = claim_findings(conn, s, ["q"], Thresholds(), rows=10, mode="claim")
    assert found[-1].details["probes"][0]["rows"] == 10  # it did claim ten rows, then undid it
    assert conn.info.transaction_status == psycopg.pq.TransactionStatus.IDLE
    assert conn.execute(table).fetchall() == before
    # And as `worker doctor` runs it, among the other checks.
    report = run(conn, s, probe="claim")
    assert of(report, "claim_cost_high")[-1].details["probes"][0]["rows"] == 10
    assert conn.info.transaction_status == psycopg.pq.TransactionStatus.IDLE
    assert conn.execute(table).fetchall() == before
    with psycopg.connect(pg_dsn) as other:
        locked = other.execute(
            f"SELECT count(*) FROM (SELECT id FROM {s}.tasks FOR UPDATE NOWAIT) AS x"
        ).fetchone()
        assert locked == (31,)
    row = conn.execute(
        f"SELECT count(*) FILTER (WHERE state = 'queued'), max(attempts),"
        f" count(worker_id) FROM {s}.tasks"
    ).fetchone()
    assert row == (30, 1, 0)


# -- connections, running tasks, routing -----------------------------------------------------------


def test_connections_count_the_fleet(conn: psycopg.Connection, schema: str, pg_dsn: str) -> None:
    with contextlib.ExitStack() as stack:
        for _ in range(3):
            stack.enter_context(psycopg.connect(pg_dsn, application_name="worker-doctor-test"))
        f = of(run(conn, schema), "connections_low")[0]
        assert f.details["fleet"] >= 3 and f.details["used"] >= 4
        assert (
            f.details["limit"] > 0 and f.details["free"] == f.details["limit"] - f.details["used"]
        )
        f = of(
            run(conn, schema, connections_warning=0.0, connections_critical=1.0), "connections_low"
        )[0]
        assert f.severity == "warning" and "PgBouncer" in f.action


def test_long_running_tasks_and_unrescued_leases(conn: psycopg.Connection, schema: str) -> None:
    s = schema
    report = run(conn, s)
    assert [f.severity for f in of(report, "tasks_running_long")] == ["ok"]
    assert [f.severity for f in of(report, "leases_expired")] == ["ok"]
    conn.execute(
        f"INSERT INTO {s}.tasks (task, queue, state, attempts, worker_id, started_at,"
        " lease_expires_at) VALUES"
        " ('slow.report', 'reports', 'in_progress', 1, gen_random_uuid(),"
        "  now() - interval '2 hours', now() + interval '1 minute'),"
        " ('abandoned', 'mail', 'in_progress', 1, gen_random_uuid(),"
        "  now() - interval '20 minutes', now() - interval '10 minutes'),"
        " ('fresh', 'mail', 'in_progress', 1, gen_random_uuid(), now(), now() + interval '30 s')"
    )
    report = run(conn, s)
    long = problems(report, "tasks_running_long")
    assert len(long) == 1 and long[0].details["count"] == 1
    assert "'slow.report'" in long[0].summary and long[0].details["oldest_seconds"] >= 7200
    expired = problems(report, "leases_expired")
    assert len(expired) == 1 and expired[0].details["count"] == 1
    assert "'abandoned'" in expired[0].summary and expired[0].severity == "warning"
    # A shorter threshold catches the 20-minute one too.
    long = problems(run(conn, s, long_task_seconds=600), "tasks_running_long")
    assert long[0].details["count"] == 2


def test_queues_without_a_worker_and_tasks_without_a_handler(
    conn: psycopg.Connection, schema: str
) -> None:
    s = schema
    conn.execute(
        f"INSERT INTO {s}.tasks (task, queue) SELECT 'x', 'orphan' FROM generate_series(1, 3)"
    )
    f = problems(run(conn, s), "queue_unserved")
    assert len(f) == 1 and f[0].severity == "critical"  # no live worker at all
    assert "'orphan' (3)" in f[0].summary and "worker run" in f[0].action
    conn.execute(
        f"INSERT INTO {s}.workers (id, host, pid, queues, concurrency, tasks)"
        " VALUES (gen_random_uuid(), 'box', 1, ARRAY['default'], 4, ARRAY['known'])"
    )
    conn.execute(f"INSERT INTO {s}.tasks (task, queue) VALUES ('unknown.task', 'default')")
    report = run(conn, s)
    f = problems(report, "queue_unserved")
    assert len(f) == 1 and f[0].severity == "warning"
    assert f[0].details["queues"] == [{"queue": "orphan", "waiting": 3}]
    f = problems(report, "handler_missing")
    assert len(f) == 1 and "'unknown.task'" in f[0].summary


# -- the CLI ---------------------------------------------------------------------------------------


def test_cli_json_shape_and_exit_codes(conn: psycopg.Connection, schema: str, pg_dsn: str) -> None:
    done = run_cli("doctor", "--dsn", pg_dsn, "--schema", schema, "--json")
    data = json.loads(done.stdout)
    assert done.returncode == (0 if data["status"] == "ok" else 1), data
    assert set(data) >= {"schema", "status", "checked_at", "counts", "findings", "figures"}
    assert data["schema"] == schema and data["status"] in SEVERITIES
    assert sum(data["counts"].values()) == len(data["findings"])
    for f in data["findings"]:
        assert set(f) == {"code", "severity", "summary", "action", "details"}
        assert f["code"] in CODES and f["severity"] in SEVERITIES
        assert f["summary"] and f["action"] and "\n" not in f["summary"]
    codes = {f["code"] for f in data["findings"]}
    assert {"xmin_horizon_held", "dead_tuples_high", "claim_cost_high", "connections_low"} <= codes
    assert data["figures"]["tables"]["tasks"]["dead"] >= 0

    conn.execute(f"INSERT INTO {schema}.tasks (task, queue) VALUES ('x', 'orphan')")
    done = run_cli("doctor", "--dsn", pg_dsn, "--schema", schema)
    assert done.returncode == 1, done.stderr
    lines = done.stdout.strip().splitlines()
    findings = [ln for ln in lines if ln.split(" ", 1)[0] in ("ok", "WARNING", "CRITICAL")]
    (unserved,) = [ln for ln in findings if ln.split()[1] == "queue_unserved"]
    assert unserved.startswith("CRITICAL  queue_unserved")
    assert " -> start a worker with `worker run MODULE`" in unserved
    assert findings.index(unserved) < min(i for i, ln in enumerate(findings) if ln[:2] == "ok")
    assert lines[-1].startswith(f"{len(findings)} finding(s) in schema {schema}: ")

    for bad in (
        ["--probe", "bogus"],
        ["--xmin-warning", "-1"],
        ["--connections-warning", "0"],
        ["--index-mb", "-1"],
        ["--index-mb", "lots"],
    ):
        done = run_cli("doctor", "--dsn", pg_dsn, "--schema", schema, *bad)
        assert done.returncode == 2 and "Traceback" not in done.stderr, bad
        assert len(done.stderr.strip().splitlines()) == 1, done.stderr
        assert "--index-mb" in done.stderr or bad[0] != "--index-mb", done.stderr
    done = run_cli("doctor", "--dsn", pg_dsn, "--schema", "nope_" + uuid.uuid4().hex[:6])
    assert done.returncode == 2 and "worker migrate" in done.stderr


def test_cli_exits_0_when_every_finding_is_ok(
    schema: str, pg_dsn: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    healthy = Report(schema, [Finding("connections_low", "ok", "3 of 97 in use", "none needed")])
    monkeypatch.setattr(doctor_cli, "diagnose", lambda *a, **k: healthy)
    assert main(["doctor", "--dsn", pg_dsn, "--schema", schema]) == 0
    assert capsys.readouterr().out.startswith("ok        connections_low  3 of 97 in use\n")
    sick = Report(schema, [Finding("leases_expired", "critical", "2 expired", "start a worker")])
    monkeypatch.setattr(doctor_cli, "diagnose", lambda *a, **k: sick)
    assert main(["doctor", "--dsn", pg_dsn, "--schema", schema, "--json"]) == 1
    assert json.loads(capsys.readouterr().out)["status"] == "critical"


# -- metrics and the panel -------------------------------------------------------------------------


def test_metrics_export_the_doctors_gauges_without_the_claim_probe(
    conn: psycopg.Connection, schema: str, pg_dsn: str
) -> None:
    conn.execute(f"INSERT INTO {schema}.tasks (task, queue) VALUES ('x', 'orphan')")
    with snapshot_held(pg_dsn, app_name()):
        time.sleep(1.2)
        server = serve("127.0.0.1", 0, dsn=pg_dsn, schema=schema, ttl=0)
        try:
            m = scrape(server.url + "metrics")
            status, page = fetch(server.url)
        finally:
            server.stop()
    assert m[("worker_db_xmin_horizon_age_seconds", ())] >= 1.0
    assert m[("worker_db_xmin_horizon_age_xids", ())] >= 0
    assert ("worker_db_dead_tuples", (("table", "tasks"),)) in m
    assert m[("worker_db_table_size_bytes", (("part", "indexes"), ("table", "tasks")))] > 0
    assert m[("worker_db_connections", (("kind", "used"),))] >= 2
    assert m[("worker_db_connections", (("kind", "limit"),))] > 0
    findings = {lbls: v for (n, lbls), v in m.items() if n == "worker_doctor_findings"}
    assert findings[(("code", "queue_unserved"), ("severity", "critical"))] == 1
    assert not any(dict(k)["code"] == "claim_cost_high" for k in findings)  # never at scrape
    assert status == 200 and 'id="health"' in page
    assert 'data-code="queue_unserved" data-severity="critical"' in page


def test_the_read_model_bounds_each_health_read(schema: str, pg_dsn: str) -> None:
    db = Database(pg_dsn, schema, ttl=60)
    try:
        report = db.health()
        assert db.health() is report  # cached for the ttl, as the queue statistics are
        assert report.error is None and not of(report, "check_failed")
        assert not of(report, "claim_cost_high")
    finally:
        db.close()
    down = Database("postgresql://nobody@127.0.0.1:1/x", schema, connect_timeout=1)
    report = down.health()
    assert report.error and [f.code for f in report.findings] == ["check_failed"]


def test_the_panel_escapes_everything_and_lists_problems_first() -> None:
    report = Report(
        "s",
        [
            Finding("connections_low", "ok", "fine", "none needed"),
            Finding("handler_missing", "warning", "task '<script>alert(1)</script>'", "fix <b>"),
            Finding("queue_unserved", "critical", "queue 'a&b'", "start"),
        ],
    )
    html = render_doctor_panel(report)
    assert "<script>" not in html and "&lt;script&gt;" in html and "fix &lt;b&gt;" in html
    assert html.index("queue_unserved") < html.index("handler_missing")
    assert "1 check(s) ok: connections_low" in html
    assert render_doctor_panel(None) == ""


# -- the judgement, on given figures ---------------------------------------------------------------


def test_redaction_masks_password_literals_before_cutting() -> None:
    cases = {
        f"ALTER ROLE bob PASSWORD '{SECRET}'": "ALTER ROLE bob PASSWORD '***'",
        f"create user x with encrypted password 'a''{SECRET}' valid until 'x'": (
            "create user x with encrypted password '***' valid until 'x'"
        ),
        f"CREATE ROLE x PASSWORD $q${SECRET}$q$ LOGIN": "CREATE ROLE x PASSWORD '***' LOGIN",
        f"SELECT set_config('app.api_key', '{SECRET}', false)": (
            "SELECT set_config('app.api_key', '***', false)"
        ),
        f"UPDATE u SET password_hash = E'{SECRET}\\'x'": "UPDATE u SET password_hash = '***'",
        f"SELECT 1 -- postgresql://bob:{SECRET}@db/x": "SELECT 1 -- postgresql://bob:***@db/x",
        "SELECT password_hash FROM users": "SELECT password_hash FROM users",
        f"ALTER ROLE bob PASSWORD '{SECRET}": "ALTER ROLE bob PASSWORD '***'",  # cut mid-literal
    }
    for text, shown in cases.items():
        assert redact_query(text) == shown, text
    long = "SELECT " + "x" * 500 + f" PASSWORD '{SECRET}'"
    assert SECRET not in redact_query(long) and len(redact_query(long)) <= 203
    assert redact_query("a\n  b\tc") == "a b c"


def _session(pid: int, seconds: float, **kw: Any) -> dict[str, Any]:
    return {
        "pid": pid,
        "application_name": f"app{pid}",
        "datname": "db",
        "usename": "u",
        "state": "idle in transaction",
        "xact_seconds": seconds,
        "state_seconds": seconds,
        "xid_age": 100,
        "query": "SELECT 1",
        "holds": True,
    } | kw


def test_holders_past_the_fifth_are_listed_briefly() -> None:
    sessions = [_session(pid, 1000.0 - pid) for pid in range(1, 9)]
    found = horizon_findings(sessions, 42, Thresholds())
    held = [f for f in found if f.code == "xmin_horizon_held"]
    assert [f.details["pid"] for f in held] == [1, 2, 3, 4, 5]
    assert [o["pid"] for o in held[-1].details["others"]] == [6, 7, 8]
    assert all("42 dead row versions" in f.summary for f in held)
    # Without a start time (a walsender's feedback), the xid age decides.
    walsender = _session(9, None, xact_seconds=None, xid_age=20_000_000, state="streaming")
    (f,) = [f for f in horizon_findings([walsender], None, Thresholds()) if f.code.startswith("x")]
    assert f.severity == "warning" and f.details["pid"] == 9
    assert doctor_horizon.horizon_age(sessions, [], []) == (999.0, 100)


def test_slots_tables_connections_running_and_routing_judgements() -> None:
    th = Thresholds()
    lost = {
        "slot_name": "s",
        "slot_type": "physical",
        "active": True,
        "active_pid": 7,
        "xmin_age": None,
        "catalog_xmin_age": None,
        "retained_bytes": 1.0,
        "wal_status": "lost",
    }
    assert slot_findings([lost], th)[0].severity == "critical"
    busy = {
        "slot_name": "s",
        "slot_type": "physical",
        "active": True,
        "active_pid": 7,
        "xmin_age": 5,
        "catalog_xmin_age": None,
        "retained_bytes": 1e12,
        "wal_status": "extended",
    }
    assert slot_findings([busy], th)[0].severity == "ok"  # active and young: a working standby

    settings = {
        "autovacuum": "on",
        "autovacuum_naptime": "60",
        "autovacuum_vacuum_threshold": "50",
        "autovacuum_vacuum_scale_factor": "0.2",
    }
    table = {
        "name": "tasks",
        "live": 1000,
        "dead": 50_000,
        "reltuples": 1000.0,
        "reloptions": ["autovacuum_vacuum_threshold=5000", "autovacuum_vacuum_scale_factor=0"],
        "vacuum_seconds": None,
        "autovacuum_seconds": 600.0,
        "table_bytes": 1,
        "index_bytes": 1,
    }
    found = {f.code: f for f in table_findings("w", [table], settings, th, horizon_held=False)}
    assert found["autovacuum_behind"].severity == "warning"
    assert found["autovacuum_behind"].details["threshold"] == 5000
    assert found["dead_tuples_high"].severity == "ok"
    assert found["autovacuum_disabled"].severity == "ok"
    recent = table | {"autovacuum_seconds": 30.0, "dead": 2_000_000}
    found = {f.code: f for f in table_findings("w", [recent], settings, th, horizon_held=False)}
    assert found["autovacuum_behind"].severity == "ok"  # vacuumed recently: it keeps up
    assert found["dead_tuples_high"].severity == "critical"
    assert "VACUUM" in found["dead_tuples_high"].action
    found = {f.code: f for f in table_findings("w", [recent], settings, th, horizon_held=True)}
    assert "horizon" in found["dead_tuples_high"].action
    off = table | {"reloptions": ["autovacuum_enabled=false"]}
    bad = settings | {"autovacuum": "off", "track_counts": "off"}
    summaries = [
        f.summary
        for f in table_findings("w", [off], bad, th, horizon_held=False)
        if f.code == "autovacuum_disabled" and f.severity == "warning"
    ]
    assert len(summaries) == 3, summaries  # the server's, track_counts, and the table's
    assert "w.tasks (autovacuum_enabled = false)" in summaries[2]

    limits = {"max_connections": "100", "superuser_reserved_connections": "3"}
    sev = [
        connection_findings({"used": n, "fleet": 1}, limits, th)[0].severity for n in (10, 80, 95)
    ]
    assert sev == ["ok", "warning", "critical"]

    running = {"running": 2, "long_running": 0, "expired": 2, "capped": False, "sample": []}
    expired = [f for f in running_findings(running, th) if f.code == "leases_expired"]
    assert [f.severity for f in expired] == ["critical"]  # every running task is overdue

    assert [f.severity for f in routing_findings(Routing([], [], 1))] == ["ok", "ok"]
    q = QueueStats("a", 3, 0, 0, 0, 0, False, False, False, 60.0, False)
    assert routing_findings(Routing([q], [], 2))[0].severity == "warning"
    assert routing_findings(Routing([q], [], 0))[0].severity == "critical"


# -- a server with prepared transactions and logical decoding --------------------------------------


@pytest.fixture(scope="module")
def special(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str]]:
    """An embedded server of this module's own with max_prepared_transactions > 0 and wal_level =
    logical (a shared test server may have neither), and a migrated schema on it."""
    server = EmbeddedPostgres(tmp_path_factory.mktemp("doctor") / "data", durable=False)
    try:
        dsn = server.start()
        with psycopg.connect(dsn, autocommit=True) as c:
            c.execute("ALTER SYSTEM SET max_prepared_transactions = 4")
            c.execute("ALTER SYSTEM SET wal_level = 'logical'")
        server.restart()
    except EmbeddedError as exc:
        pytest.skip(f"no embedded PostgreSQL to enable prepared transactions on: {exc}")
    try:
        with psycopg.connect(dsn, autocommit=True) as c:
            settings = dict(
                c.execute(
                    "SELECT name, setting FROM pg_settings"
                    " WHERE name IN ('max_prepared_transactions', 'wal_level')"
                ).fetchall()
            )
            assert settings == {"max_prepared_transactions": "4", "wal_level": "logical"}
            migrate(c, "doctor")
        yield dsn, "doctor"
    finally:
        server.stop()
