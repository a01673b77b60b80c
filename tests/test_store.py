"""One store: every statement that changes a task row runs from ``worker/store`` and nowhere else.

Three ways in, each checked:

* the ``.sql`` files: a named statement outside ``worker/store`` that inserts, updates, deletes
  or copies into the task table, or calls a SQL function that does (found in the migrations),
  fails the static test;
* Python source: a string literal outside the store that holds such a statement fails it too;
* at run time: every statement executed while a workload runs (enqueue one, many and async; a
  worker's claims, acknowledgements, retries, results, hand-backs, transactional handlers and
  stop; rescue, purge and cron; cancel, retry and delete by id; bulk actions; retry --failed;
  worker.testing) is recorded with the first frame of the package that sent it, and every one
  that writes the task table must come from the store. A probe module placed in another room
  shows the recorder catching a write from there.
"""

from __future__ import annotations

import ast
import asyncio
import importlib
import re
import sys
import threading
import time
import traceback
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from conftest import wait_until

import worker
import worker.testing
from worker import store
from worker.db.sql import parse_named
from worker.engine.loop import Worker, WorkerConfig
from worker.ops import actions, bulk

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "worker"
STORE = PACKAGE / "store"
# The benchmark's bare-SQL ceiling is, by definition, the queue's statements without the package
# around them; its fixtures fill the table directly. Nothing else is exempt.
EXEMPT = {
    "dev/bench.sql": {
        "bench_claim",
        "bench_ack",
        "bench_ack_delete",
        "bench_fill_finished",
        "bench_fill_history",
        "bench_fill_delayed",
    }
}

_WRITE = re.compile(
    r"\b(?:UPDATE|DELETE\s+FROM|INSERT\s+INTO|COPY|MERGE\s+INTO|TRUNCATE)\s+"
    r"(?:ONLY\s+)?[\w\"{}.]*\b(?:tasks\b(?!_)|task_history\b)",
    re.IGNORECASE,
)
_FUNCTION = re.compile(
    r"CREATE\s+(?:OR\s+REPLACE\s+)?(?:FUNCTION|PROCEDURE)\s+\{schema\}\.(\w+)\s*\((.*?)"
    r"\$(\w*)\$(.*?)\$\3\$",
    re.IGNORECASE | re.DOTALL,
)


def task_writing_functions() -> set[str]:
    """The SQL functions of the migrations that change task rows, directly or through another."""
    bodies: dict[str, str] = {}
    for path in sorted((ROOT / "schema").glob("*.sql")):
        for m in _FUNCTION.finditer(path.read_text()):
            bodies[m.group(1)] = bodies.get(m.group(1), "") + m.group(4)
    writing = {name for name, body in bodies.items() if _WRITE.search(body)}
    while True:
        more = {
            name
            for name, body in bodies.items()
            if name not in writing and any(re.search(rf"\.{w}\s*\(", body) for w in writing)
        }
        if not more:
            return writing
        writing |= more


WRITERS = task_writing_functions()
_CALLS = re.compile(r"\.(" + "|".join(sorted(WRITERS)) + r")\s*\(", re.IGNORECASE)


def writes_tasks(text: str) -> bool:
    return bool(_WRITE.search(text) or _CALLS.search(text))


def test_the_migrations_functions_that_write_tasks_are_found() -> None:
    """The detector is not vacuous: it knows the functions that change task rows."""
    assert {"enqueue", "requeue", "cancel_tasks", "bulk_step", "claim_limited"} <= WRITERS
    assert "bulk" in WRITERS  # through bulk_step
    assert "pause_queue" not in WRITERS and "set_queue_limit" not in WRITERS


def test_no_named_statement_outside_the_store_writes_the_task_table() -> None:
    found = []
    for path in sorted(PACKAGE.rglob("*.sql")):
        rel = path.relative_to(PACKAGE).as_posix()
        if path.parent == STORE:
            continue
        for name, text in parse_named(path.read_text()).items():
            if writes_tasks(text) and name not in EXEMPT.get(rel, set()):
                found.append(f"{rel}: {name}")
    assert found == []


def test_the_store_holds_the_statements_that_write_tasks() -> None:
    """And the store's files are where they are: the check above has something to compare."""
    names = {n for p in STORE.glob("*.sql") for n in parse_named(p.read_text())}
    assert {"claim", "complete", "retry", "rescue", "purge", "enqueue", "requeue"} <= names
    writing = {
        n for p in STORE.glob("*.sql") for n, t in parse_named(p.read_text()).items()
        if writes_tasks(t)
    }  # fmt: skip
    assert len(writing) >= 20


def _literals(path: Path) -> Iterator[tuple[int, str]]:
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            yield node.lineno, node.value


def test_no_python_string_outside_the_store_writes_the_task_table() -> None:
    found = [
        f"{path.relative_to(ROOT)}:{line}"
        for path in sorted(PACKAGE.rglob("*.py"))
        if STORE not in path.parents
        for line, text in _literals(path)
        if writes_tasks(text) and _looks_like_sql(text)
    ]
    assert found == []


def _looks_like_sql(text: str) -> bool:
    """A statement, not prose that names one ("rows the UPDATE took")."""
    return bool(re.match(r"\s*(WITH|UPDATE|DELETE|INSERT|COPY|SELECT|CALL|MERGE)\b", text, re.I))


# -- at run time ---------------------------------------------------------------------------------


class Recorder:
    """Every statement psycopg executes in this process while installed, with the first frame of
    the package outside ``worker/db`` (the generic helpers there run what their callers give)."""

    def __init__(self) -> None:
        self.writes: list[tuple[str, str]] = []  # (caller file, statement head)
        self.seen = 0
        self._saved: list[tuple[Any, str, Any]] = []
        self._lock = threading.Lock()

    def _note(self, conn: Any, query: Any) -> None:
        try:
            text = query if isinstance(query, str | bytes) else query.as_string(conn)
        except Exception:
            text = str(query)
        if isinstance(text, bytes):
            text = text.decode(errors="replace")
        with self._lock:
            self.seen += 1
        if not writes_tasks(text):
            return
        caller = "(outside the package)"
        for frame in reversed(traceback.extract_stack()[:-2]):
            path = Path(frame.filename).resolve()
            if PACKAGE in path.parents and (PACKAGE / "db") not in path.parents:
                caller = path.relative_to(PACKAGE).as_posix()
                break
        with self._lock:
            self.writes.append((caller, " ".join(text.split())[:80]))

    def install(self) -> None:
        recorder = self

        def wrap(cls: Any, name: str, *, is_async: bool = False) -> None:
            original = getattr(cls, name)
            if is_async:

                async def patched(self: Any, query: Any, *a: Any, **k: Any) -> Any:
                    recorder._note(self.connection, query)
                    return await original(self, query, *a, **k)
            else:

                def patched(self: Any, query: Any, *a: Any, **k: Any) -> Any:  # type: ignore[misc]
                    recorder._note(self.connection, query)
                    return original(self, query, *a, **k)

            self._saved.append((cls, name, original))
            setattr(cls, name, patched)

        wrap(psycopg.Cursor, "execute")
        wrap(psycopg.Cursor, "copy")
        wrap(psycopg.AsyncCursor, "execute", is_async=True)

    def uninstall(self) -> None:
        for cls, name, original in reversed(self._saved):
            setattr(cls, name, original)

    def outside_the_store(self) -> list[tuple[str, str]]:
        return [(c, s) for c, s in self.writes if not c.startswith("store/")]


@pytest.fixture
def recorder() -> Iterator[Recorder]:
    r = Recorder()
    r.install()
    try:
        yield r
    finally:
        r.uninstall()


def test_a_write_from_another_room_is_caught(
    conn: psycopg.Connection, schema: str, recorder: Recorder
) -> None:
    """The recorder is not vacuous: a module of another room that updates the task table is
    named as the writer."""
    probe = PACKAGE / "ops" / "_store_probe.py"
    probe.write_text(
        "def touch(conn, schema):\n"
        "    conn.execute(f'UPDATE {schema}.tasks SET priority = priority WHERE false')\n"
    )
    try:
        module = importlib.import_module("worker.ops._store_probe")
        module.touch(conn, schema)
    finally:
        probe.unlink()
        sys.modules.pop("worker.ops._store_probe", None)
    assert recorder.outside_the_store() == [
        ("ops/_store_probe.py", f"UPDATE {schema}.tasks SET priority = priority WHERE false")
    ]


def _registry() -> worker.Registry:
    reg = worker.Registry()

    @reg.task("ok")
    def ok(payload: Any) -> None:
        return None

    @reg.task("boom", max_attempts=2, retry_backoff=0.01)
    def boom(payload: Any) -> None:
        raise ValueError("boom")

    @reg.task("result", store_result=True)
    def result(payload: Any) -> Any:
        return {"n": payload.get("n")}

    @reg.task("txn", transactional=True)
    def txn(payload: Any, ctx: worker.Context) -> None:
        assert ctx.conn is not None
        ctx.conn.execute("SELECT 1")

    @reg.task("slow")
    def slow(payload: Any, ctx: worker.Context) -> None:
        deadline = time.monotonic() + 20
        while not ctx.cancelled and time.monotonic() < deadline:
            time.sleep(0.02)

    return reg


def test_every_task_row_change_of_a_whole_workload_comes_from_the_store(
    conn: psycopg.Connection, pg_dsn: str, schema: str, recorder: Recorder
) -> None:
    reg = _registry()
    # Producers: one, many (COPY), async, delayed, keyed by dedupe.
    worker.enqueue(conn, "ok", {}, schema=schema)
    worker.enqueue(conn, "ok", {}, delay=0.1, schema=schema)
    worker.enqueue(conn, "ok", {}, dedupe_key="k", schema=schema)
    worker.enqueue_many(conn, "ok", [{}] * 5, schema=schema)
    worker.enqueue_many(conn, "ok", [{}] * 2, delay=0.1, schema=schema)

    async def produce() -> None:
        async with await psycopg.AsyncConnection.connect(pg_dsn, autocommit=True) as a:
            await worker.enqueue_async(a, "ok", {}, schema=schema)

    asyncio.run(produce())
    for n in range(3):
        worker.enqueue(conn, "result", {"n": n}, schema=schema)
    worker.enqueue(conn, "boom", {}, schema=schema)
    worker.enqueue(conn, "txn", {}, schema=schema)
    worker.enqueue(conn, "nobody.has.this", {}, schema=schema)
    slow_id = worker.enqueue(conn, "slow", {}, schema=schema)

    config = WorkerConfig(
        dsn=pg_dsn, schema=schema, poll_interval=0.1, lease_seconds=30.0, keep_done_seconds=3600
    )
    w = Worker(config, reg)
    thread = threading.Thread(target=w.run, daemon=True)
    thread.start()
    try:
        wait_until(
            lambda: (
                conn.execute(
                    f"SELECT count(*) FROM {schema}.tasks WHERE task = 'boom' AND state = 'failed'"
                ).fetchone()[0]
                == 1
                and conn.execute(
                    f"SELECT count(*) FROM {schema}.tasks WHERE state = 'done'"
                ).fetchone()[0]
                >= 14
            ),
            timeout=30,
        )
        wait_until(lambda: slow_id in w.table.running_ids(), timeout=10)
        worker.cancel(conn, slow_id, schema=schema)  # a running task: its handler is told
        wait_until(
            lambda: (
                conn.execute(
                    f"SELECT state::text FROM {schema}.tasks WHERE id = %s", (slow_id,)
                ).fetchone()[0]
                == "cancelled"
            ),
            timeout=10,
        )
    finally:
        w.stop()
        thread.join(30)
    assert not thread.is_alive()

    # Operators: by id, by filter, everything failed; the console's delete.
    failed = conn.execute(f"SELECT id FROM {schema}.tasks WHERE state = 'failed'").fetchall()
    actions.retry(conn, schema, [r[0] for r in failed])
    conn.execute(f"UPDATE {schema}.tasks SET state = 'failed', finished_at = now() WHERE false")
    bulk.retry_failed(conn, schema)
    queued = worker.enqueue(conn, "ok", {}, queue="elsewhere", schema=schema)
    actions.cancel(conn, schema, [queued], by="alice")
    flt = bulk.Filter(queue="elsewhere", states=("cancelled",))
    bulk.apply(conn, schema, "retry", flt, actor="alice")
    bulk.apply(conn, schema, "cancel", bulk.Filter(queue="elsewhere"), actor="alice")
    bulk.preview(conn, schema, "delete", bulk.Filter(queue="elsewhere", states=("cancelled",)))
    done = conn.execute(f"SELECT id FROM {schema}.tasks WHERE state = 'done' LIMIT 2").fetchall()
    actions.delete(conn, schema, [r[0] for r in done])

    # Rescue, retention, and the test helpers (a dead process's rows and cron slots: the
    # static checks above, and the supervisor and cron tests).
    with conn.transaction():
        conn.execute(
            f"UPDATE {schema}.tasks SET state = 'in_progress', attempts = 1, worker_id = %s,"
            " lease_expires_at = now() - interval '1 s' WHERE id = %s",
            ("00000000-0000-4000-8000-000000000009", queued),
        )
    store.rescue(conn, schema)
    store.purge(conn, schema, done_seconds=0, failed_seconds=0, cron_keep_seconds=0)
    worker.enqueue(conn, "ok", {}, schema=schema)
    with conn.transaction():
        worker.testing.run_due(conn, tasks=reg, schema=schema)

    # The fixture's own UPDATEs above ran from this test file, outside the package.
    ours = [w for w in recorder.writes if w[0] != "(outside the package)"]
    assert recorder.seen > 50 and len(ours) > 20
    assert {c for c, _ in ours} >= {"store/inserts.py", "store/claims.py", "store/acks.py"}
    assert recorder.outside_the_store() == [
        w for w in recorder.writes if w[0] == "(outside the package)"
    ]
