"""The README's samples marked ``<!-- sample: FILE -->`` run as written: each is saved under its
file name in a folder of its own and run in a child process (so their ``@worker.task`` names stay
out of this process's registry), against a database of their own whose schema is the default
``worker``, as a reader's would be."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
import uuid
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
from psycopg.conninfo import make_conninfo

from worker._migrate import migrate

ROOT = Path(__file__).resolve().parent.parent
_SAMPLE = re.compile(r"<!-- sample: ([\w.]+) -->\n```python\n(.*?)```", re.DOTALL)


def samples() -> dict[str, str]:
    return dict(_SAMPLE.findall((ROOT / "README.md").read_text()))


def test_the_marked_samples_are_found() -> None:
    assert set(samples()) == {
        "shop.py",
        "test_shop.py",
        "billing.py",
        "produce_bills.py",
        "app.py",
        "site_settings.py",
        "orders.py",
        "traced.py",
    }


@pytest.fixture
def database(pg_dsn: str) -> Iterator[str]:
    """A database of its own, migrated into the default schema, dropped afterwards."""
    name = f"readme_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(pg_dsn, autocommit=True) as admin:
        admin.execute(f"CREATE DATABASE {name}")
    dsn = make_conninfo(pg_dsn, dbname=name)
    try:
        with psycopg.connect(dsn, autocommit=True) as conn:
            migrate(conn, "worker")
        yield dsn
    finally:
        with psycopg.connect(pg_dsn, autocommit=True) as admin:
            admin.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")


def run(
    folder: Path, dsn: str, *args: str, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    for name, code in samples().items():
        (folder / name).write_text(code)
    env = {**os.environ, "DATABASE_URL": dsn, "PYTHONPATH": str(folder), **(env or {})}
    return subprocess.run(
        [sys.executable, *args], cwd=folder, env=env, capture_output=True, text=True, timeout=120
    )


def test_the_testing_sample_passes(tmp_path: Path, database: str) -> None:
    out = run(tmp_path, database, "-m", "pytest", "-q", "-p", "no:cacheprovider", "test_shop.py")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "3 passed" in out.stdout
    # Its fixture rolled everything back.
    with psycopg.connect(database) as conn:
        assert conn.execute("SELECT count(*) FROM worker.tasks").fetchone() == (0,)


def test_the_typed_payload_sample(tmp_path: Path, database: str) -> None:
    out = run(tmp_path, database, "produce_bills.py")
    assert out.returncode == 0, out.stderr
    assert out.stdout == (
        "task 'bill': payload does not fit Invoice: field 'number': expected int, got str\n"
    )
    drain = textwrap.dedent(
        """
        import os, psycopg, billing
        from worker import testing
        with psycopg.connect(os.environ["DATABASE_URL"]) as conn:
            testing.run_due(conn).check()
        """
    )
    out = run(tmp_path, database, "-c", drain)
    assert out.returncode == 0, out.stderr
    assert out.stdout == "billing #42 to ada@example.com\nbilling #43 to bob@example.com\n"


def test_the_fastapi_sample(tmp_path: Path, database: str) -> None:
    """A commit enqueues and the embedded worker runs the task; a rollback enqueues nothing; the
    lifespan's end stops the worker cleanly (it unregistered)."""
    drive = textwrap.dedent(
        """
        import os, time, psycopg
        from fastapi.testclient import TestClient
        import app

        def rows(conn):
            sql = "SELECT payload->>'email', state::text FROM worker.tasks ORDER BY id"
            return conn.execute(sql).fetchall()

        with psycopg.connect(os.environ["DATABASE_URL"], autocommit=True) as conn:
            with TestClient(app.app) as client:
                assert client.post("/signup", params={"email": "ada@example.com"}).json() == {
                    "ok": True
                }
                blocked = client.post("/signup", params={"email": "x@blocked.example"})
                assert blocked.status_code == 400
                assert isinstance(client.post("/ping").json()["id"], int)
                deadline = time.monotonic() + 30
                while any(s != "done" for _, s in rows(conn)) and time.monotonic() < deadline:
                    time.sleep(0.05)
            print(rows(conn))
            sql = "SELECT count(*) FROM worker.workers WHERE stopped_at IS NULL"
            print(conn.execute(sql).fetchone()[0])
        """
    )
    out = run(tmp_path, database, "-c", drive)
    assert out.returncode == 0, out.stdout + out.stderr
    lines = out.stdout.splitlines()
    assert "welcome ada@example.com" in lines
    assert "welcome ping" in lines
    assert lines[-2:] == ["[('ada@example.com', 'done'), ('ping', 'done')]", "0"]


def test_the_django_sample(tmp_path: Path, database: str) -> None:
    """An order placed commits its task, a blocked one rolls it back; `manage.py worker_run`
    (here `python -m django worker_run`, the same command without a manage.py) runs it, and
    get_result() reads its return value."""
    env = {"DJANGO_SETTINGS_MODULE": "site_settings"}
    place = textwrap.dedent(
        """
        import django
        django.setup()
        import orders
        print(orders.place_order(7, "ada@example.com"))
        try:
            orders.place_order(8, "eve@blocked.example")
        except ValueError as exc:
            print("refused:", exc)
        """
    )
    out = run(tmp_path, database, "-c", place, env=env)
    assert out.returncode == 0, out.stderr
    first, refused = out.stdout.splitlines()
    assert refused == "refused: blocked"
    out = run(tmp_path, database, "-m", "django", "worker_run", "--burst", env=env)
    assert out.returncode == 0, out.stderr
    assert "receipt for order 7 to ada@example.com" in out.stdout
    read = "import django; django.setup(); import orders\n" + (
        f"r = orders.send_receipt.get_result({first!r}); print(r.status, r.return_value)"
    )
    out = run(tmp_path, database, "-c", read, env=env)
    assert out.returncode == 0, out.stderr
    assert out.stdout == "SUCCESSFUL {'sent_to': 'ada@example.com'}\n"
    with psycopg.connect(database) as conn:
        rows = conn.execute("SELECT task, payload FROM worker.tasks").fetchall()
    assert rows == [("orders.send_receipt", {"args": [7, "ada@example.com"], "kwargs": {}})]


def printed_spans(stdout: str) -> dict[str, dict]:
    """The spans ConsoleSpanExporter printed (indented JSON objects among other output), by name."""
    spans, pos, decoder = {}, 0, json.JSONDecoder()
    while (start := stdout.find("{\n", pos)) != -1:
        span, pos = decoder.raw_decode(stdout, start)
        spans[span["name"]] = span
    return spans


def test_the_opentelemetry_sample(tmp_path: Path, database: str) -> None:
    """The request's span parents the send span; the worker's process span (another process)
    links to it, and the handler's span is a child of the process span."""
    out = run(tmp_path, database, "traced.py")
    assert out.returncode == 0, out.stderr
    produced = printed_spans(out.stdout)
    send, checkout = produced["send default"], produced["checkout"]
    assert send["kind"] == "SpanKind.PRODUCER"
    assert send["parent_id"] == checkout["context"]["span_id"]
    out = run(
        tmp_path, database, "-m", "worker", "run", "traced", "--otel", "--burst", "--processes", "1"
    )
    assert out.returncode == 0, out.stderr
    assert "shipping order 42" in out.stdout.splitlines()
    consumed = printed_spans(out.stdout)
    process, label = consumed["process default"], consumed["print label"]
    assert process["kind"] == "SpanKind.CONSUMER"
    assert [link["context"]["span_id"] for link in process["links"]] == [send["context"]["span_id"]]
    assert process["links"][0]["context"]["trace_id"] == send["context"]["trace_id"]
    assert label["parent_id"] == process["context"]["span_id"]
    assert process["attributes"]["worker.task.outcome"] == "done"
