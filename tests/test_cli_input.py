"""Every value a user types is checked: a flag out of range, a value the database refuses or a
bad schema name is one line on stderr and exit 2, never a traceback, and nothing is written."""

from __future__ import annotations

import json
import subprocess
import sys

import psycopg
import pytest
from conftest import ROOT, run_cli

from worker.cli.common import database_error

RUN = ["run", "tasks_module"]
ENQ = ["enqueue", "job"]

BAD_FLAGS = [
    (RUN, "--metrics-port", "99999"),
    (RUN, "--metrics-port", "0"),
    (RUN, "--concurrency", "100000"),
    (RUN, "--concurrency", "0"),
    (RUN, "--lease", "0"),
    (RUN, "--lease", "nan"),
    (RUN, "--lease", "1e309"),
    (RUN, "--processes", "500"),
    (RUN, "--processes", "0"),
    (RUN, "--batch-size", "0"),
    (RUN, "--batch-size", "10000000"),
    (RUN, "--grace", "-1"),
    (RUN, "--grace", "inf"),
    (RUN, "--poll-interval", "0"),
    (RUN, "--keep-done", "-5"),
    (RUN, "--start-timeout", "0"),
    (ENQ, "--priority", "99999999"),
    (ENQ, "--priority", "-1000001"),
    (ENQ, "--priority", "1.5"),
    (ENQ, "--max-attempts", "0"),
    (ENQ, "--max-attempts", "99999999999"),
    (ENQ, "--delay", "-1"),
    (ENQ, "--delay", "1e20"),
    (["status"], "--failed", "-1"),
    (["status"], "--failed", "100000000"),
    (["retry"], "--failed", "x"),
    (["cancel", "99999999999999999999"], "--json", None),
    (["demo"], "--processes", "1000"),
    (["demo"], "--rate", "0"),
    (["demo"], "--rate", "nan"),
    (["demo"], "--port", "70000"),
]


def one_line_error(r: subprocess.CompletedProcess[str]) -> str:
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    assert "Traceback" not in r.stderr
    lines = r.stderr.splitlines()
    assert len(lines) == 1, r.stderr
    return lines[0]


def count(conn: psycopg.Connection, schema: str) -> int:
    return conn.execute(f"SELECT count(*) FROM {schema}.tasks").fetchone()[0]


@pytest.mark.parametrize(("command", "flag", "value"), BAD_FLAGS)
def test_flags_out_of_range_are_one_line(
    pg_dsn: str, schema: str, conn: psycopg.Connection, command, flag, value
) -> None:
    extra = [flag] if value is None else [flag, value]
    line = one_line_error(run_cli(*command, *extra, "--dsn", pg_dsn, "--schema", schema))
    assert "error" in line
    assert count(conn, schema) == 0


@pytest.mark.parametrize(
    ("args", "match"),
    [
        (["enqueue", ""], "the task name must not be empty"),
        (["enqueue", "job", "--queue", ""], "--queue must not be empty"),
        (["enqueue", "job", "--payload", '{"a": "\\u0000"}'], "invalid input"),
        (["enqueue", "job", "--payload", "NaN"], "invalid input"),
        (["enqueue", "job", "--payload", "[" * 100_000], "--payload"),
        (["enqueue", "job", "--payload", "@/nonexistent/file.json"], "cannot read"),
        (["enqueue", "job", "--delay", "5", "--run-at", "2030-01-01T00:00:00+00:00"], "not both"),
        (["status", "--schema", "nl\n"], "invalid schema name"),
        (["status", "--schema", "Upper"], "invalid schema name"),
        (["status", "--ds", "x"], "unrecognized arguments"),
    ],
)
def test_values_the_database_would_refuse_are_one_line(
    pg_dsn: str, schema: str, conn: psycopg.Connection, args: list[str], match: str
) -> None:
    schema_args = [] if "--schema" in args else ["--schema", schema]
    line = one_line_error(run_cli(*args, "--dsn", pg_dsn, *schema_args))
    assert match in line
    assert count(conn, schema) == 0


def test_constraint_violations_name_the_field(conn: psycopg.Connection, schema: str) -> None:
    cases = {
        "task": ("", "q", 0, 1, "the task name must not be empty"),
        "queue": ("t", "", 0, 1, "--queue must not be empty"),
        "priority": ("t", "q", 99999999, 1, "--priority must be from -1000000 to 1000000"),
        "max_attempts": ("t", "q", 0, 0, "--max-attempts must be at least 1"),
    }
    for task, queue, priority, attempts, message in cases.values():
        with pytest.raises(psycopg.Error) as info:
            conn.execute(
                f"INSERT INTO {schema}.tasks (task, queue, priority, max_attempts)"
                " VALUES (%s, %s, %s, %s)",
                (task, queue, priority, attempts),
            )
        assert database_error(info.value) == (f"invalid input: {message}", 2)


def test_payload_from_a_file_and_from_stdin(
    pg_dsn: str, schema: str, conn: psycopg.Connection, tmp_path
) -> None:
    big = {"items": list(range(200_000))}  # well over what a command line takes
    path = tmp_path / "payload.json"
    path.write_text(json.dumps(big))
    common = ["--dsn", pg_dsn, "--schema", schema]
    r = run_cli("enqueue", "job", "--payload", f"@{path}", *common)
    assert r.returncode == 0, r.stderr
    r = subprocess.run(
        [sys.executable, "-m", "worker", "enqueue", "job", "--payload", "-", *common],
        input=json.dumps({"from": "stdin"}),
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=60,
    )
    assert r.returncode == 0, r.stderr
    rows = conn.execute(f"SELECT payload FROM {schema}.tasks ORDER BY id").fetchall()
    assert [row[0] for row in rows] == [big, {"from": "stdin"}]


def test_bad_payload_from_stdin_is_one_line(
    pg_dsn: str, schema: str, conn: psycopg.Connection
) -> None:
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "worker",
            "enqueue",
            "job",
            "--payload",
            "-",
            "--dsn",
            pg_dsn,
            "--schema",
            schema,
        ],
        input="{oops",
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=60,
    )
    assert "not valid JSON" in one_line_error(r)
    assert count(conn, schema) == 0
