"""Migrations and the plans of the hot statements on a large table."""

from __future__ import annotations

import functools
import json
import operator
import re
import subprocess
import sys
import uuid
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import psycopg
import pytest
from conftest import every_statement, run_cli
from psycopg import _queries  # the driver's own cache limits, not copies of them

import worker
from worker.db.migrate import current_version, latest_version, migrate, require_schema
from worker.db.sql import parse_named, render, validate_schema_name
from worker.errors import ConfigError, SchemaMissing
from worker.store.claims import pace_params


def test_migrate_is_idempotent_and_records_versions(conn: psycopg.Connection) -> None:
    name = f"m_{uuid.uuid4().hex[:10]}"
    try:
        first = migrate(conn, name)
        assert first and first[0].startswith("0001_")
        assert migrate(conn, name) == []
        assert current_version(conn, name) == latest_version()
        rows = conn.execute(f"SELECT version FROM {name}.schema_migrations ORDER BY 1").fetchall()
        assert [r[0] for r in rows] == sorted({r[0] for r in rows})
    finally:
        conn.execute(f"DROP SCHEMA IF EXISTS {name} CASCADE")


def test_concurrent_migrate_from_many_processes(pg_dsn: str, conn: psycopg.Connection) -> None:
    """Five `worker migrate` processes at once: all succeed, each migration applied once."""
    name = f"m_{uuid.uuid4().hex[:10]}"
    try:
        procs = [
            subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "worker",
                    "migrate",
                    "--dsn",
                    pg_dsn,
                    "--schema",
                    name,
                    "--json",
                ],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            for _ in range(5)
        ]
        outputs = [p.communicate(timeout=60) for p in procs]
        assert [p.returncode for p in procs] == [0] * 5, outputs
        applied = [json.loads(out)["applied"] for out, _ in outputs]
        # Each migration was applied by exactly one process (each file is a transaction of its
        # own, so different processes may apply different files); none twice, none missing.
        assert sorted(functools.reduce(operator.iadd, applied, [])) == sorted(
            f"{v:04d}_{n}"
            for v, n in conn.execute(f"SELECT version, name FROM {name}.schema_migrations")
        )
        every = [m for a in applied for m in a]
        assert len(every) == len(set(every))
    finally:
        conn.execute(f"DROP SCHEMA IF EXISTS {name} CASCADE")


def test_require_schema_explains_what_to_do(conn: psycopg.Connection) -> None:
    with pytest.raises(SchemaMissing) as info:
        require_schema(conn, "no_such_schema_here")
    assert str(info.value) == (
        "schema 'no_such_schema_here' has no worker tables in this database: "
        "run `worker migrate --schema no_such_schema_here`"
    )
    name = f"old_{uuid.uuid4().hex[:12]}"
    try:
        assert migrate(conn, name, up_to=12)[-1] == "0012_results"
        assert current_version(conn, name) == 12
        with pytest.raises(SchemaMissing) as info:
            require_schema(conn, name)
        assert str(info.value) == (
            f"schema '{name}' is at version 12; this version of worker-pg needs "
            f"{latest_version()}: run `worker migrate --schema {name}`"
        )
        assert migrate(conn, name)[0] == "0013_trace_context"  # the rest, from there
        assert require_schema(conn, name) == latest_version()
    finally:
        conn.execute(f"DROP SCHEMA IF EXISTS {name} CASCADE")


@pytest.mark.parametrize("bad", ["", "Worker", "a-b", 'x"; drop table t; --', "1abc", "a" * 64])
def test_bad_schema_names_are_refused(bad: str) -> None:
    with pytest.raises(ConfigError, match="invalid schema name"):
        validate_schema_name(bad)


def test_cli_rejects_bad_schema_name_in_one_line(pg_dsn: str) -> None:
    r = run_cli("status", "--dsn", pg_dsn, "--schema", "bad;name")
    assert r.returncode == 2
    assert "invalid schema name" in r.stderr
    assert "Traceback" not in r.stderr


def test_render_quotes_schema_and_keeps_other_braces(conn: psycopg.Connection) -> None:
    text = render("SELECT '{}'::jsonb FROM {schema}.tasks", "abc").as_string(conn)
    assert text == "SELECT '{}'::jsonb FROM \"abc\".tasks"


def test_named_query_files_parse_without_duplicates() -> None:
    parsed = parse_named("-- name: a\nSELECT 1;\n-- name: b\nSELECT 2;")
    assert parsed == {"a": "SELECT 1", "b": "SELECT 2"}
    with pytest.raises(ValueError, match="defined twice"):
        parse_named("-- name: a\nSELECT 1;\n-- name: a\nSELECT 2;")


def test_store_statements_fit_the_drivers_statement_cache() -> None:
    """psycopg converts a statement's placeholders once and caches the result only for statements
    under 4 kB with at most 50 parameters; a longer one is parsed again on every execution, which
    a chain's hop paid on its claim. The .sql files keep their comments and indentation, the
    statements sent do not."""
    folder = Path(worker.__file__).parent / "store"
    for path in sorted(folder.glob("*.sql")):
        for name, text in parse_named(path.read_text()).items():
            size = len(text.replace("{schema}", '"' + "s" * 63 + '"').encode())
            assert size <= _queries.MAX_CACHED_STATEMENT_LENGTH, (path.name, name, size)
            params = set(re.findall(r"%\((\w+)\)s", text))
            assert len(params) <= _queries.MAX_CACHED_STATEMENT_PARAMS, (path.name, name)
            assert all(line == line.strip() for line in text.splitlines()), (path.name, name)


# -- plans on a large table ------------------------------------------------------------------------


def _plan_nodes(plan: dict[str, Any]) -> list[dict[str, Any]]:
    nodes = [plan]
    for child in plan.get("Plans", []):
        nodes.extend(_plan_nodes(child))
    return nodes


def _explain(conn: psycopg.Connection, statement: Any, params: dict[str, Any]) -> list[dict]:
    with conn.transaction(force_rollback=True):
        text = statement.as_bytes(conn)
        row = conn.execute(b"EXPLAIN (FORMAT JSON) " + text, params).fetchone()
    assert row is not None
    return _plan_nodes(row[0][0]["Plan"])


@pytest.fixture
def big_table(conn: psycopg.Connection, schema: str) -> str:
    """60k finished rows, 20k queued in two queues, 2k running, 20k scheduled, and 35k done rows
    in each slot of the history (schema/0025): enough for the planner to care."""
    t = f"{schema}.tasks"
    conn.execute(
        f"INSERT INTO {schema}.task_history (id, task, queue, state, finished_at, attempts, slot)"
        " SELECT -g, 'old', 'default', 'done', now() - interval '30 minutes', 1, 1 + g % 8"
        " FROM generate_series(1, 280000) AS g"
    )
    conn.execute(f"VACUUM ANALYZE {schema}.task_history")
    conn.execute(
        f"INSERT INTO {t} (task, queue, state, finished_at, attempts)"
        " SELECT 'old', 'default', 'done', now() - interval '2 hours', 1"
        " FROM generate_series(1, 60000)"
    )
    conn.execute(
        f"INSERT INTO {t} (task, queue, priority) SELECT 'new', CASE WHEN g % 2 = 0 THEN"
        " 'default' ELSE 'other' END, g % 3 FROM generate_series(1, 20000) g"
    )
    conn.execute(
        f"INSERT INTO {t} (task, state, attempts, worker_id, lease_expires_at)"
        " SELECT 'running', 'in_progress', 1, gen_random_uuid(), now() + interval '30 s'"
        " FROM generate_series(1, 2000)"
    )
    conn.execute(
        f"INSERT INTO {t} (task, queue, run_at) SELECT 'later', 'default',"
        " now() + g * interval '1 s' FROM generate_series(1, 20000) g"
    )
    conn.execute(f"VACUUM ANALYZE {t}")
    return schema


def _no_seq_scan(nodes: list[dict[str, Any]]) -> None:
    # history_slots (schema/0025) holds eight rows for good, one page: a scan of it is the
    # cheapest read there is, whatever the planner's statistics say (a fresh copy has none).
    scans = [
        n
        for n in nodes
        if n["Node Type"] == "Seq Scan" and n.get("Relation Name") != "history_slots"
    ]
    assert not scans, f"sequential scan in plan: {scans}"


def test_claim_plan_reads_the_claim_index_only(conn: psycopg.Connection, big_table: str) -> None:
    """All of a worker's queues in one statement, one with a cursor placed: index ranges only."""
    q = every_statement(big_table)
    start = datetime(1, 1, 1, tzinfo=UTC)
    nodes = _explain(
        conn,
        q["claim"],
        {
            "queues": ["default", "mail", "reports"],
            "limit": 100,
            "worker_id": str(uuid.uuid4()),
            "lease_seconds": 30.0,
            "cursor_priority": [-(10**9), 0, -(10**9)],
            "floor_run_at": [start, datetime.now(UTC), start],
            "floor_id": [0, 1000, 0],
            "handler_tasks": [f"t{i}" for i in range(50)],
            "handler_max_attempts": [3] * 50,
            "lookahead": 0.5,
            **pace_params(None),
        },
    )
    _no_seq_scan(nodes)
    index_scans = {n.get("Index Name") for n in nodes if "Index" in n["Node Type"]}
    assert "tasks_claim_idx" in index_scans
    # (The limited queues' sort is inside claim_limited_batch, not in this plan.)
    assert not [n for n in nodes if n["Node Type"] == "Sort"], "claim must not sort"


def test_promote_and_behind_plans_read_their_indexes(
    conn: psycopg.Connection, big_table: str
) -> None:
    q = every_statement(big_table)
    nodes = _explain(conn, q["promote"], {"limit": 1000, "channel": f"{big_table}.tasks"})
    _no_seq_scan(nodes)
    assert "tasks_scheduled_idx" in {n.get("Index Name") for n in nodes}
    assert not [n for n in nodes if n["Node Type"] == "Sort"], "promote must not sort"
    nodes = _explain(
        conn,
        q["behind"],
        {
            "queues": ["default", "mail"],
            "cursor_priority": [0, 0],
            "floor_run_at": [datetime.now(UTC), datetime.now(UTC)],
            "floor_id": [1000, 1000],
        },
    )
    _no_seq_scan(nodes)
    assert "tasks_claim_idx" in {n.get("Index Name") for n in nodes}


@pytest.mark.parametrize(
    "name",
    [
        "complete",
        "complete_delete",
        "complete_with_result",
        "complete_move",
        "task_outcomes",
        "release",
        "heartbeat",
        "hand_back",
    ],
)
def test_ack_plans_use_no_table_scan(conn: psycopg.Connection, big_table: str, name: str) -> None:
    ids = [r[0] for r in conn.execute(f"SELECT id FROM {big_table}.tasks LIMIT 100")]
    params = {
        "ids": ids,
        "attempts": [1] * len(ids),
        "errors": ["UnknownTask"] * len(ids),
        "results": ['{"a": 1}'] * len(ids),
        "worker_id": str(uuid.uuid4()),
        "lease_seconds": 30.0,
        "history": 10,
        "history_chars": 2000,
    }
    nodes = _explain(conn, every_statement(big_table)[name], params)
    _no_seq_scan(nodes)
    # By primary key: a scan of the partial lease index walks every dead entry it holds.
    used = {n.get("Index Name") for n in nodes if "Index" in n["Node Type"]}
    # Acknowledgements touch no permit (a permit is free once its attempt ends, schema/0020).
    # The history (schema/0025): a move reads the current slot's row; a read by id probes each
    # slot's primary key.
    used = {u for u in used if not u.startswith("task_history_")}
    assert used - {"workers_pkey", "history_slots_current_idx"} == {"tasks_pkey"}, used


def test_retry_rescue_purge_plans_use_no_table_scan(
    conn: psycopg.Connection, big_table: str
) -> None:
    q = every_statement(big_table)
    ids = [r[0] for r in conn.execute(f"SELECT id FROM {big_table}.tasks LIMIT 100")]
    n = len(ids)
    _no_seq_scan(
        _explain(
            conn,
            q["retry"],
            {
                "ids": ids,
                "attempts": [1] * n,
                "delays": [1.0] * n,
                "errors": ["x"] * n,
                "permanent": [False] * n,
                "max_attempts": [3] * n,
                "worker_id": str(uuid.uuid4()),
                "history": 10,
                "history_chars": 2000,
            },
        )
    )
    for since in (None, datetime.now(UTC)):
        _no_seq_scan(
            _explain(
                conn,
                q["rescue"],
                {"limit": 1000, "history": 10, "history_chars": 2000, "since": since},
            )
        )
    _no_seq_scan(
        _explain(
            conn,
            q["purge"],
            {
                "done_seconds": 3600,
                "failed_seconds": 86400,
                "cron_keep_seconds": 86400,
                "limit": 5000,
            },
        )
    )
