"""Shared fixtures: a real PostgreSQL (embedded unless WORKER_TEST_DSN is set), one fresh schema
per test, and helpers to run workers in threads or as real processes."""

from __future__ import annotations

import compileall
import inspect
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import uuid
import warnings
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from worker.db.migrate import migrate
from worker.db.sql import statements
from worker.dev.embedded import EmbeddedError, EmbeddedPostgres, find_pg_bin
from worker.engine.loop import Worker, WorkerConfig
from worker.tasks.registry import Registry

ROOT = Path(__file__).resolve().parent.parent

# Modules whose every test starts PostgreSQL servers of its own (or processes that do).
_SERVER_MODULES = {"test_embedded", "test_pgbouncer", "test_bench", "test_first_run"}


# Files whose tests take about a minute or more in all on two busy cores, longest first. Under
# `--dist loadfile` a file runs whole in one test process, and files are handed out in the
# order collected (`--no-loadscope-reorder`): these go first, so that no long file is what one
# process still runs at the end while the other has nothing left to do. The other files follow,
# most tests first. The list only orders the run; a file missing from it runs later, no less.
_LONG_FILES = (
    "test_pool.py",
    "test_pythons.py",
    "test_runtime.py",
    "test_limits.py",
    "test_secrets.py",
    "test_workflows.py",
    "test_results.py",
    "test_outage_log.py",
    "test_bulk.py",
    "test_explain.py",
    "test_matrix.py",
    "test_metrics.py",
    "test_bench.py",
    "test_faults.py",
    "test_pause.py",
    "test_cancel_running.py",
    "test_doc_samples.py",
    "test_cli_input.py",
    "test_exit_codes.py",
    "test_console_ui.py",
    "test_cron.py",
    "test_django_migrations.py",
    "test_wheel.py",
    "test_dead_workers.py",
)


# Fixtures that start or connect to a PostgreSQL server (fixturenames holds every fixture a
# test needs, its fixtures' fixtures included).
_SERVER_FIXTURES = {"pg_dsn", "private_server", "make_server", "shared_server", "special"}


def pytest_configure(config: pytest.Config) -> None:
    """Compile the package and the modules the tests' processes import, once, before any test
    starts a process. When the environment sets PYTHONDONTWRITEBYTECODE nothing else writes
    bytecode, and every `worker` process the suite starts (hundreds: commands, pools and their
    children) compiled each module it imports again: 0.15 s of CPU of the 0.4 s a command takes
    to start. Stale files are compiled again; test files are pytest's to rewrite."""
    if hasattr(config, "workerinput"):
        return  # an xdist test process: the controller has done it
    for folder in (ROOT / "worker", ROOT / "tests"):
        compileall.compile_dir(folder, quiet=1, rx=re.compile(r"/test_[^/]*\.py$"))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark ``db`` every test that needs PostgreSQL or runs `worker` processes (which try to reach
    one), so that ``pytest -m "not db"`` runs the rest (SQL parsing, backoff, cron arithmetic,
    journal records, escaping, redaction, layout) in seconds. Tests that run processes without a
    server fixture carry the mark themselves. The ``deploy`` smoke tests (an image build and a
    stack started, minutes each) run only when ``-m`` names them (``pytest -m deploy``);
    otherwise they are skipped, saying so."""
    asked = "deploy" in (config.getoption("markexpr", "") or "")
    for item in items:
        module = getattr(item, "module", None)
        name = module.__name__.rsplit(".", 1)[-1] if module else ""
        fixtures = set(getattr(item, "fixturenames", ()))
        if fixtures & _SERVER_FIXTURES or name in _SERVER_MODULES or _runs_worker(item):
            item.add_marker(pytest.mark.db)
        if not asked and item.get_closest_marker("deploy"):
            reason = "deploy smoke: run with `pytest -m deploy` (builds the image)"
            item.add_marker(pytest.mark.skip(reason=reason))
    # The long files first, then the others, most tests first; a file's tests keep their order.
    rank = {name: i for i, name in enumerate(_LONG_FILES)}
    tests = Counter(item.path.name for item in items)
    items.sort(key=lambda item: (rank.get(item.path.name, len(rank)), -tests[item.path.name]))


_PROCESS_CALLS = ("run_cli(", "spawn_cli(", "worker_cli(", "EmbeddedPostgres(")


def _runs_worker(item: pytest.Item) -> bool:
    """Whether the test's own code runs `worker` processes or starts a server."""
    function = getattr(item, "function", None)
    try:
        source = inspect.getsource(function) if function else ""
    except (OSError, TypeError):
        return False
    return any(call in source for call in _PROCESS_CALLS)


@pytest.fixture(scope="session")
def pg_dsn() -> Iterator[str]:
    """The database every test uses. Without WORKER_TEST_DSN an embedded server is started for
    the session (fsync off: the tests check behaviour, `worker bench` measures speed)."""
    env = os.environ.get("WORKER_TEST_DSN")
    if env:
        yield env
        return
    # Not under pytest's temporary folder: as root the server runs as another user, and every
    # pytest session that starts (the tests run some) takes the others' search bit off
    # /tmp/pytest-of-root, which cut the server off its own data folder (a PANIC at its next
    # checkpoint, and every later test of this process failing to connect).
    folder = Path(tempfile.mkdtemp(prefix="worker-tests-pg-"))
    try:
        server = EmbeddedPostgres(folder / "data", durable=False)
        dsn = server.start()
        try:
            yield dsn
        finally:
            server.stop()
    finally:
        shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture
def conn(pg_dsn: str) -> Iterator[psycopg.Connection]:
    with psycopg.connect(pg_dsn, autocommit=True) as c:
        yield c


def _schema_name() -> str:
    return f"t_{uuid.uuid4().hex[:12]}"


def _dump_schema(dsn: str, schema: str) -> str:
    """``schema`` as pg_dump writes it, its rows included (the record of the migrations applied),
    as statements one connection can run: without psql's meta-commands."""
    params = conninfo_to_dict(dsn)
    env = {**os.environ, "PGPASSWORD": str(params.get("password") or "")}
    done = subprocess.run(
        [
            str(find_pg_bin() / "pg_dump"),
            f"--schema={schema}",
            "--no-owner",
            "--no-privileges",
            "--inserts",
            "--dbname",
            make_conninfo(dsn, password=None) if params.get("password") else dsn,
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
        check=True,
    )
    return "\n".join(line for line in done.stdout.splitlines() if not line.startswith("\\"))


@pytest.fixture(scope="session")
def _migrated_schema(pg_dsn: str) -> tuple[str, str] | None:
    """A schema migrated once per test process, as the SQL that makes it again (a placeholder
    name and the dump that holds it): running that dump under a test's own name takes a fraction
    of the time the 20-odd migrations take, each in its transaction, and the suite makes a
    schema for most of its tests. Used only once a copy made from it dumps exactly as the
    migrated schema does; None (every schema is migrated) when pg_dump cannot read the server."""
    template, copy = _schema_name(), _schema_name()
    with psycopg.connect(pg_dsn, autocommit=True) as c:
        try:
            migrate(c, template)
            try:
                ddl = _dump_schema(pg_dsn, template)
                c.execute(ddl.replace(template, copy))
                again = _dump_schema(pg_dsn, copy)
            except (OSError, subprocess.SubprocessError, EmbeddedError):
                return None  # no pg_dump, or one older than the server: migrate each schema
        finally:
            c.execute(f"DROP SCHEMA IF EXISTS {template} CASCADE")
            c.execute(f"DROP SCHEMA IF EXISTS {copy} CASCADE")
    if again != ddl.replace(template, copy):
        warnings.warn(
            "a schema made from a migrated schema's dump differs from it; every test's schema "
            "is migrated instead (slower)",
            stacklevel=1,
        )
        return None
    return template, ddl


@pytest.fixture
def schema(pg_dsn: str, _migrated_schema: tuple[str, str] | None) -> Iterator[str]:
    """A freshly migrated schema with a unique name, dropped afterwards: tests never share rows.
    Made from the session's migrated schema (see _migrated_schema) when it can be."""
    name = _schema_name()
    with psycopg.connect(pg_dsn, autocommit=True) as c:
        if _migrated_schema is None:
            migrate(c, name)
        else:
            template, ddl = _migrated_schema
            c.execute(ddl.replace(template, name))
    yield name
    with psycopg.connect(pg_dsn, autocommit=True) as c:
        c.execute(f"DROP SCHEMA IF EXISTS {name} CASCADE")


def wait_until(predicate: Callable[[], Any], timeout: float = 20.0, interval: float = 0.05) -> Any:
    """Poll until ``predicate()`` is truthy; fail the test with a clear message otherwise."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {timeout}s")
        time.sleep(interval)


def states(conn: psycopg.Connection, schema: str) -> dict[str, int]:
    rows = conn.execute(f"SELECT state::text, count(*) FROM {schema}.tasks GROUP BY 1").fetchall()
    return {s: n for s, n in rows}


class ThreadWorker:
    """A Worker running in a thread of the test process, for behaviour that needs no signals."""

    def __init__(self, config: WorkerConfig, tasks: Registry, **kwargs: Any) -> None:
        self.worker = Worker(config, tasks, **kwargs)
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.exit_code: int | None = None

    def _run(self) -> None:
        self.exit_code = self.worker.run()

    def __enter__(self) -> ThreadWorker:
        self.thread.start()
        return self

    def stop(self, timeout: float = 30.0) -> None:
        self.worker.stop()
        self.thread.join(timeout)
        assert not self.thread.is_alive(), "worker thread did not stop"

    def __exit__(self, *exc: object) -> None:
        if self.thread.is_alive():
            self.stop()


@pytest.fixture
def private_server(tmp_path: Path) -> Iterator[EmbeddedPostgres]:
    """A server of this test's own, which it may stop and start (the session's must stay up)."""
    server = EmbeddedPostgres(tmp_path / "pgdata", durable=False)
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def thread_worker(pg_dsn: str, schema: str) -> Callable[..., ThreadWorker]:
    """Build a ThreadWorker on the test's schema: ``with thread_worker(registry, **config):``."""

    def make(tasks: Registry, **overrides: Any) -> ThreadWorker:
        defaults: dict[str, Any] = {"poll_interval": 0.2, "lease_seconds": 30.0}
        defaults.update(overrides)
        return ThreadWorker(WorkerConfig(dsn=pg_dsn, schema=schema, **defaults), tasks)

    return make


def worker_cli(*args: str, env: dict[str, str] | None = None, **kwargs: Any) -> list[str]:
    """The argv of a real `worker` process (python -m worker), for subprocess tests."""
    return [sys.executable, "-m", "worker", *args]


def run_cli(
    *args: str, env: dict[str, str] | None = None, timeout: float = 60.0
) -> subprocess.CompletedProcess[str]:
    """Run `worker ARGS...` to completion and capture its output."""
    full_env = {**os.environ, "PYTHONPATH": str(ROOT / "tests"), **(env or {})}
    return subprocess.run(
        worker_cli(*args), capture_output=True, text=True, timeout=timeout, env=full_env, cwd=ROOT
    )


def spawn_cli(
    *args: str, env: dict[str, str] | None = None, **kwargs: Any
) -> subprocess.Popen[str]:
    """Start `worker ARGS...` in the background (tests/ is on PYTHONPATH for task modules)."""
    full_env = {**os.environ, "PYTHONPATH": str(ROOT / "tests"), **(env or {})}
    return subprocess.Popen(worker_cli(*args), env=full_env, cwd=ROOT, text=True, **kwargs)


def dashboard_exprs() -> list[str]:
    """Every PromQL expression the Grafana dashboards in deploy/ hold (panel targets, variable
    queries), for the deploy tests."""
    out: list[str] = []

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            for key, value in node.items():
                if key in ("expr", "definition", "query") and isinstance(value, str):
                    out.append(value)
                else:
                    walk(value)
        elif isinstance(node, list):
            for item in node:
                walk(item)

    for path in sorted((ROOT / "deploy" / "grafana" / "dashboards").glob("*.json")):
        walk(json.loads(path.read_text()))
    return out


def every_statement(schema: str) -> Any:
    """Every named statement of the package (the core's, the store's, the monitor's, the
    developer tools'), for tests that run one directly."""
    folders = sorted({p.parent for p in (ROOT / "worker").rglob("*.sql")})
    return statements(schema, *folders)
