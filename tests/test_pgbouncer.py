"""Behind PgBouncer in transaction pooling mode: migrate and run through the pooler.

Skipped, with the reason, when the pgbouncer binary is not installed (.ci/run installs
Debian's package).
"""

from __future__ import annotations

import os
import pwd
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
from conftest import run_cli, states, wait_until
from psycopg.conninfo import conninfo_to_dict

import worker

PGBOUNCER = shutil.which("pgbouncer") or (
    "/usr/sbin/pgbouncer" if Path("/usr/sbin/pgbouncer").exists() else None
)
pytestmark = pytest.mark.skipif(PGBOUNCER is None, reason="pgbouncer is not installed")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def bouncer_dsn(pg_dsn: str) -> Iterator[str]:
    target = conninfo_to_dict(pg_dsn)
    port = _free_port()
    folder = Path(tempfile.mkdtemp(prefix="worker-pgbouncer-"))
    folder.chmod(0o755)
    (folder / "pgbouncer.ini").write_text(
        "[databases]\n"
        f"* = host={target.get('host', '127.0.0.1')} port={target.get('port', 5432)}"
        f" user={target.get('user', 'postgres')}\n"
        "[pgbouncer]\n"
        f"listen_addr = 127.0.0.1\nlisten_port = {port}\n"
        f"unix_socket_dir =\nauth_type = any\npool_mode = transaction\n"
        f"max_client_conn = 200\ndefault_pool_size = 2\n"
        f"logfile = {folder}/pgbouncer.log\n"
    )
    user = None
    if os.geteuid() == 0:  # pgbouncer refuses to run as root
        user = "worker-pg" if _user_exists("worker-pg") else "nobody"
        shutil.chown(folder, user)
    proc = subprocess.Popen(
        [PGBOUNCER, str(folder / "pgbouncer.ini")],
        user=user,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    dsn = (
        f"postgresql://{target.get('user', 'postgres')}@127.0.0.1:{port}/"
        f"{target.get('dbname', 'postgres')}"
    )
    try:
        wait_until(lambda: _accepts(dsn), timeout=15)
        yield dsn
    finally:
        proc.terminate()
        proc.wait(timeout=10)
        shutil.rmtree(folder, ignore_errors=True)


def _user_exists(name: str) -> bool:
    try:
        pwd.getpwnam(name)
    except KeyError:
        return False
    return True


def _accepts(dsn: str) -> bool:
    try:
        with psycopg.connect(dsn, connect_timeout=2) as c:
            c.execute("SELECT 1")
        return True
    except psycopg.Error:
        time.sleep(0.1)
        return False


def test_migrate_and_run_through_transaction_pooling(
    bouncer_dsn: str, pg_dsn: str, schema: str, conn: psycopg.Connection
) -> None:
    assert run_cli("migrate", "--dsn", bouncer_dsn, "--schema", schema).returncode == 0
    conn.execute(
        f"CREATE TABLE {schema}.executions (task_id bigint, attempt int, pid int,"
        " started timestamptz, finished timestamptz)"
    )
    conn.execute(f"INSERT INTO {schema}.tasks (task) SELECT 'record' FROM generate_series(1, 600)")
    # Three processes share two server connections, so consecutive statements of one client
    # land on different server connections: prepared statements would break here.
    r = run_cli(
        "run",
        "tasks_module",
        "--pgbouncer",
        "--burst",
        "--processes",
        "3",
        "--batch-size",
        "10",
        "--concurrency",
        "4",
        "--dsn",
        bouncer_dsn,
        "--schema",
        schema,
        env={"WORKER_DSN": pg_dsn, "WORKER_SCHEMA": schema},
        timeout=120,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    assert "prepared statement" not in r.stderr
    assert states(conn, schema) == {"done": 600}


def test_results_and_waits_through_transaction_pooling(
    bouncer_dsn: str, pg_dsn: str, schema: str, conn: psycopg.Connection
) -> None:
    """Stored results and every kind of wait work through the pooler, polling (LISTEN hears
    nothing there): nothing prepared, nothing left behind on the server connections."""
    ids = [worker.enqueue(bouncer_dsn, "r_async", {"n": i}, schema=schema) for i in range(30)]
    failing = worker.enqueue(bouncer_dsn, "r_fail", {}, schema=schema)
    r = run_cli(
        "run",
        "results_module",
        "--pgbouncer",
        "--burst",
        "--processes",
        "2",
        "--dsn",
        bouncer_dsn,
        "--schema",
        schema,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    with worker.Waiter(bouncer_dsn, schema=schema, listen=False, poll_interval=0.05) as waiter:
        assert waiter.wait_many(ids, timeout=10) == [["async", i] for i in range(30)]
        with pytest.raises(worker.TaskFailed):
            waiter.wait(failing, timeout=10)
    for task_id in ids[:8]:  # more reads than psycopg's prepare threshold
        assert worker.wait(bouncer_dsn, task_id, timeout=10, schema=schema, listen=False)
    out = run_cli("wait", str(ids[0]), "--no-listen", "--dsn", bouncer_dsn, "--schema", schema)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == '["async", 0]'
