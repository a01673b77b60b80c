"""``schema/current.sql`` is today's schema in one file: what the migrations of ``schema/`` build,
as pg_dump writes it (tables, indexes, functions, triggers), so a reader sees the task table and
the functions as they are without replaying sixteen migrations in their head. This test migrates
a fresh database and compares; when a migration is added, regenerate the file with
``WORKER_WRITE_SNAPSHOT=1 python -m pytest tests/test_schema_snapshot.py``."""

from __future__ import annotations

import difflib
import os
import re
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from worker.db.migrate import migrate
from worker.dev.embedded import find_pg_bin

ROOT = Path(__file__).resolve().parent.parent
SNAPSHOT = ROOT / "schema" / "current.sql"
HEADER = """\
-- The schema as the migrations in this folder build it, for reading: `worker migrate` applies
-- the numbered files, never this one. Made by pg_dump --schema-only from a database migrated to
-- the latest version (tests/test_schema_snapshot.py checks that it is current).
"""


@pytest.fixture
def migrated(pg_dsn: str) -> Iterator[str]:
    name = f"snap_{uuid.uuid4().hex[:10]}"
    with psycopg.connect(pg_dsn, autocommit=True) as admin:
        admin.execute(f"CREATE DATABASE {name}")
    dsn = make_conninfo(pg_dsn, dbname=name)
    try:
        with psycopg.connect(dsn, autocommit=True) as conn:
            migrate(conn, "worker")
        yield dsn
    finally:
        with psycopg.connect(pg_dsn, autocommit=True) as admin:
            admin.execute(f"DROP DATABASE {name} WITH (FORCE)")


def dump(dsn: str) -> str:
    params = conninfo_to_dict(dsn)
    env = {**os.environ, "PGPASSWORD": str(params.get("password") or "")}
    done = subprocess.run(
        [
            str(find_pg_bin() / "pg_dump"),
            "--schema-only",
            "--schema=worker",
            "--no-owner",
            "--no-privileges",
            "--no-comments",
            "--no-tablespaces",
            "--dbname",
            make_conninfo(dsn, password=None) if params.get("password") else dsn,
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
        check=True,
    )
    return normalise(done.stdout)


def normalise(text: str) -> str:
    """The statements alone: no session SETs, no version comments, no blank-line runs, no column
    options the server added itself."""
    keep = []
    for line in text.splitlines():
        if re.match(r"(SET |SELECT pg_catalog\.set_config|\\(un)?restrict |-- Dumped )", line):
            continue
        if line.startswith("--") and not line.startswith("-- Name:"):
            continue
        # Per-column options a server may add on its own (the migrations set none).
        if re.match(r"ALTER TABLE ONLY \S+ ALTER COLUMN \S+ SET \(", line):
            continue
        keep.append(line.rstrip())
    out = re.sub(r"\n{3,}", "\n\n", "\n".join(keep)).strip()
    return HEADER + "\n" + out + "\n"


def test_the_snapshot_is_what_the_migrations_build(migrated: str) -> None:
    got = dump(migrated)
    if os.environ.get("WORKER_WRITE_SNAPSHOT"):
        SNAPSHOT.write_text(got)
    want = SNAPSHOT.read_text() if SNAPSHOT.exists() else ""
    diff = "".join(
        difflib.unified_diff(
            want.splitlines(True), got.splitlines(True), "schema/current.sql", "migrated"
        )
    )
    assert not diff, (
        "schema/current.sql is not what the migrations build; regenerate it with "
        "WORKER_WRITE_SNAPSHOT=1 python -m pytest tests/test_schema_snapshot.py\n" + diff[:5000]
    )


def test_the_snapshot_holds_todays_table_and_functions() -> None:
    """Not vacuous: the file names the task table and the functions a SQL producer calls."""
    text = SNAPSHOT.read_text()
    for needle in (
        "CREATE TABLE worker.tasks",
        "CREATE FUNCTION worker.enqueue(",
        "CREATE FUNCTION worker.requeue(",
        "CREATE INDEX tasks_claim_idx",
    ):
        assert needle in text, needle
    assert text.count("CREATE FUNCTION worker.enqueue(") == 1  # today's, not four versions
