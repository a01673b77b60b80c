"""`manage.py migrate` sets the queue up in a Django project (tests/django_site): the app's
migrations apply the worker's own, in the schema the settings name, on a database of their own;
once, whoever ran first (`worker migrate` or Django); and one Django migration stands for each
worker migration, so a release's new schema version reaches Django projects."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
import textwrap
import uuid
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path

import psycopg
import pytest
from conftest import ROOT
from psycopg.conninfo import make_conninfo

from worker.db.migrate import latest_version, migrate, migrations

MIGRATIONS = ROOT / "worker" / "contrib" / "django" / "migrations"
SCHEMA = "shop_queue"


@pytest.fixture
def fresh(pg_dsn: str) -> Iterator[str]:
    """A database of its own, with nothing in it (Django's records of applied migrations are
    per database), dropped afterwards."""
    name = f"djm_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(pg_dsn, autocommit=True) as admin:
        admin.execute(f"CREATE DATABASE {name}")
    try:
        yield make_conninfo(pg_dsn, dbname=name)
    finally:
        with psycopg.connect(pg_dsn, autocommit=True) as admin:
            admin.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")


def django(dsn: str, *args: str) -> subprocess.CompletedProcess[str]:
    """`python -m django ARGS` (manage.py without the file) in the test project."""
    env = {
        **os.environ,
        "DJANGO_SITE_DSN": dsn,
        "DJANGO_SITE_SCHEMA": SCHEMA,
        "DJANGO_SETTINGS_MODULE": "django_site.settings",
        "PYTHONPATH": str(ROOT / "tests"),
    }
    return subprocess.run(
        [sys.executable, *args], env=env, capture_output=True, text=True, timeout=120
    )


def applied(dsn: str) -> list[tuple[int, str, datetime]]:
    with psycopg.connect(dsn) as conn:
        return conn.execute(
            f"SELECT version, name, applied_at FROM {SCHEMA}.schema_migrations ORDER BY version"
        ).fetchall()


def schemas(dsn: str) -> set[str]:
    with psycopg.connect(dsn) as conn:
        rows = conn.execute(
            "SELECT nspname FROM pg_namespace WHERE nspname NOT LIKE 'pg\\_%'"
            " AND nspname <> 'information_schema'"
        ).fetchall()
    return {name for (name,) in rows}


def test_migrate_is_the_only_set_up_step(fresh: str) -> None:
    """On a fresh database: `manage.py migrate`, then `.enqueue()`, then `worker_run` runs it."""
    out = django(fresh, "-m", "django", "migrate")
    assert out.returncode == 0, out.stderr
    for m in migrations():
        assert f"Applying worker_django.{m.version:04d}_{m.name}... OK" in out.stdout
    # The worker's own migrations, every one, in the schema of the backends on this database
    # (not in that of the backend on another database alias).
    assert [(v, n) for v, n, _ in applied(fresh)] == [(m.version, m.name) for m in migrations()]
    assert schemas(fresh) == {"public", SCHEMA}

    enqueue = textwrap.dedent(
        """
        import django
        django.setup()
        from django_site.tasks import add
        print(add.enqueue(2, 3).id)
        """
    )
    out = django(fresh, "-c", enqueue)
    assert out.returncode == 0, out.stderr
    task_id = out.stdout.strip()
    out = django(fresh, "-m", "django", "worker_run", "--burst", "--poll-interval", "0.1")
    assert out.returncode == 0, out.stderr
    with psycopg.connect(fresh) as conn:
        row = conn.execute(
            f"SELECT state::text, result FROM {SCHEMA}.tasks WHERE id = %s", (int(task_id),)
        ).fetchone()
    assert row == ("done", {"sum": 5})


def test_a_second_migrate_is_a_no_op(fresh: str) -> None:
    assert django(fresh, "-m", "django", "migrate").returncode == 0
    before = applied(fresh)
    out = django(fresh, "-m", "django", "migrate")
    assert out.returncode == 0, out.stderr
    assert "No migrations to apply." in out.stdout
    assert applied(fresh) == before
    with psycopg.connect(fresh, autocommit=True) as conn:
        assert migrate(conn, SCHEMA) == []  # and `worker migrate` finds nothing to do either


def test_migrate_after_worker_migrate_applies_nothing_twice(fresh: str) -> None:
    with psycopg.connect(fresh, autocommit=True) as conn:
        migrate(conn, SCHEMA)
    before = applied(fresh)
    out = django(fresh, "-m", "django", "migrate")
    assert out.returncode == 0, out.stderr
    assert f"Applying worker_django.{latest_version():04d}_" in out.stdout
    assert applied(fresh) == before


def test_the_migrations_cannot_be_unapplied(fresh: str) -> None:
    """Unapplying would have to drop the tasks: Django refuses, saying how to remove the queue."""
    assert django(fresh, "-m", "django", "migrate").returncode == 0
    before = applied(fresh)
    out = django(fresh, "-m", "django", "migrate", "worker_django", "zero")
    assert out.returncode != 0
    assert (
        "IrreversibleError: worker_django's migrations cannot be unapplied: the worker's schema "
        f"({SCHEMA}) keeps its tables and its tasks."
    ) in out.stderr
    assert applied(fresh) == before
    out = django(fresh, "-m", "django", "showmigrations", "worker_django")
    assert out.stdout.count("[X]") == len(migrations())


def _module(path: Path) -> tuple[int | None, list[tuple[str, str]]]:
    """(the version its ApplyWorkerSchema brings the schema to, its dependencies)."""
    tree = ast.parse(path.read_text())
    version = None
    dependencies: list[tuple[str, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and getattr(node.func, "id", "") == "ApplyWorkerSchema":
            version = ast.literal_eval(node.args[0])
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", "") == "dependencies":
            dependencies = ast.literal_eval(node.value)
    return version, dependencies


def test_every_worker_migration_has_its_django_migration() -> None:
    """A new schema/NNNN_name.sql needs migrations/NNNN_name.py (ApplyWorkerSchema(NNNN), after
    the one before): without it, `manage.py migrate` would never bring a Django project's schema
    to the version its workers need."""
    worker_names = [f"{m.version:04d}_{m.name}" for m in migrations()]
    django_names = sorted(p.stem for p in MIGRATIONS.glob("[0-9][0-9][0-9][0-9]_*.py"))
    assert django_names == worker_names
    previous = None
    for m, name in zip(migrations(), django_names, strict=True):
        version, dependencies = _module(MIGRATIONS / f"{name}.py")
        assert version == m.version, name
        assert dependencies == ([("worker_django", previous)] if previous else []), name
        previous = name
