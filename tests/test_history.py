"""The history (schema/0025): a plain task that ends done leaves the task table at its
acknowledgement for a slot of ``task_history``, stays readable by id (``task_rows``) for its
retention, and retention empties whole slots (``rotate_history``) instead of deleting rows."""

from __future__ import annotations

import json
import threading
import time
import uuid
from typing import Any

import psycopg
import pytest
from conftest import every_statement, run_cli, wait_until

import worker
from worker import store
from worker.coord import pause
from worker.engine import rollup
from worker.monitor.console.data import browse_statement
from worker.monitor.console.filter import Filter
from worker.ops import bulk, status

WORKER = str(uuid.uuid4())


def _running(conn: psycopg.Connection, schema: str, n: int = 1, **cols: Any) -> list[int]:
    """n rows in progress for WORKER at attempt 1 (written directly: the claim is not tested
    here)."""
    ids = [worker.enqueue(conn, "h_task", {"i": i}, schema=schema) for i in range(n)]
    sets = "".join(f", {k} = %({k})s" for k in cols)
    conn.execute(
        f"UPDATE {schema}.tasks SET state = 'in_progress', attempts = 1, worker_id = %(w)s, "
        f"started_at = now(), lease_expires_at = now() + interval '30 s'{sets} "
        "WHERE id = ANY(%(ids)s)",
        {"w": WORKER, "ids": ids, **cols},
    )
    return ids


def _where(conn: psycopg.Connection, schema: str, task_id: int) -> tuple[str | None, str | None]:
    live = conn.execute(f"SELECT state::text FROM {schema}.tasks WHERE id = %s", (task_id,))
    hist = conn.execute(f"SELECT state::text FROM {schema}.task_history WHERE id = %s", (task_id,))
    a, b = live.fetchone(), hist.fetchone()
    return (a[0] if a else None, b[0] if b else None)


def test_complete_moves_plain_done_rows_to_the_current_slot(
    conn: psycopg.Connection, schema: str
) -> None:
    ids = _running(conn, schema, 3)
    with conn.transaction():
        kept = store.complete(conn, schema, worker_id=WORKER, done=[(i, 1) for i in ids], move=True)
    assert kept == dict.fromkeys(ids, "done")
    for i in ids:
        assert _where(conn, schema, i) == (None, "done")
    rows = conn.execute(
        f"SELECT h.slot, h.finished_at IS NOT NULL, h.lease_expires_at, h.attempts, h.payload "
        f"FROM {schema}.task_history AS h ORDER BY h.id"
    ).fetchall()
    current = conn.execute(
        f"SELECT slot FROM {schema}.history_slots WHERE state = 'current'"
    ).fetchone()[0]
    assert rows == [(current, True, None, 1, {"i": i}) for i in range(3)]


def test_the_move_is_fenced_as_complete(conn: psycopg.Connection, schema: str) -> None:
    (a,) = _running(conn, schema)
    (b,) = _running(conn, schema)
    with conn.transaction():
        kept = store.complete(
            conn, schema, worker_id=WORKER, done=[(a, 2)], move=True
        ) | store.complete(conn, schema, worker_id=str(uuid.uuid4()), done=[(b, 1)], move=True)
    assert kept == {}
    assert _where(conn, schema, a) == ("in_progress", None)
    assert _where(conn, schema, b) == ("in_progress", None)


def test_a_large_batch_moves_in_pieces_each_row_with_its_own_result(
    conn: psycopg.Connection, schema: str
) -> None:
    """A batch larger than one acknowledging statement takes goes in pieces: every plain row
    still ours moves with its own result, a row at a stale attempt anywhere in the batch stays
    in progress, and a row the move leaves (a cancel request) ends in the task table."""
    n = 2 * store.ACK_PIECE + 11
    ids = _running(conn, schema, n)
    stale = set(ids[7 :: store.ACK_PIECE // 2])
    asked = ids[-2]
    conn.execute(f"UPDATE {schema}.tasks SET cancel_requested_at = now() WHERE id = %s", (asked,))
    done = [(i, 2 if i in stale else 1, json.dumps({"r": i})) for i in ids]
    with conn.transaction():
        kept = store.complete_with_result(conn, schema, worker_id=WORKER, done=done, move=True)
    moved = [i for i in ids if i not in stale and i != asked]
    assert kept == {**dict.fromkeys(moved, "done"), asked: "cancelled"}
    results = dict(conn.execute(f"SELECT id, result FROM {schema}.task_history").fetchall())
    assert results == {i: {"r": i} for i in moved}
    for i in stale:
        assert _where(conn, schema, i) == ("in_progress", None)
    assert _where(conn, schema, asked) == ("cancelled", None)


def test_rows_the_move_leaves_finish_in_the_task_table(
    conn: psycopg.Connection, schema: str
) -> None:
    (cancel,) = _running(conn, schema)
    conn.execute(f"UPDATE {schema}.tasks SET cancel_requested_at = now() WHERE id = %s", (cancel,))
    (cron,) = _running(conn, schema, cron_key="k", cron_at="2026-01-01T00:00:00Z")
    (flow,) = _running(conn, schema)
    wf = conn.execute(f"INSERT INTO {schema}.workflows DEFAULT VALUES RETURNING id").fetchone()[0]
    conn.execute(f"UPDATE {schema}.tasks SET workflow_id = %s WHERE id = %s", (wf, flow))
    (plain,) = _running(conn, schema)
    with conn.transaction():
        kept = store.complete(
            conn,
            schema,
            worker_id=WORKER,
            done=[(cancel, 1), (cron, 1), (flow, 1), (plain, 1)],
            move=True,
        )
    assert kept == {cancel: "cancelled", cron: "done", flow: "done", plain: "done"}
    assert _where(conn, schema, cancel) == ("cancelled", None)
    assert _where(conn, schema, cron) == ("done", None)
    assert _where(conn, schema, flow) == ("done", None)
    assert _where(conn, schema, plain) == (None, "done")


def test_a_result_moves_with_its_row_and_waiters_read_it(
    pg_dsn: str, conn: psycopg.Connection, schema: str
) -> None:
    a, b = _running(conn, schema, 2)
    conn.execute(f"UPDATE {schema}.tasks SET cancel_requested_at = now() WHERE id = %s", (b,))
    with conn.transaction():
        kept = store.complete_with_result(
            conn, schema, worker_id=WORKER, done=[(a, 1, '{"x": [1, 2]}'), (b, 1, "3")], move=True
        )
    assert kept == {a: "done", b: "cancelled"}
    assert _where(conn, schema, a) == (None, "done")
    assert worker.wait(pg_dsn, a, timeout=5, schema=schema) == {"x": [1, 2]}
    assert _where(conn, schema, b) == ("cancelled", None)


def test_reads_by_id_find_a_moved_task(conn: psycopg.Connection, schema: str) -> None:
    (a,) = _running(conn, schema)
    with conn.transaction():
        store.complete(conn, schema, worker_id=WORKER, done=[(a, 1)], move=True)
    got = status.get_task(conn, schema, a)
    assert got is not None and got["state"] == "done" and got["payload"] == {"i": 0}
    assert store.cancel_tasks(conn, schema, [a, 10**12], by="me") == [
        (a, "finished", "done"),
        (10**12, "missing", None),
    ]
    assert store.delete_tasks(conn, schema, [a]) == 1
    assert _where(conn, schema, a) == (None, None)
    assert status.get_task(conn, schema, a) is None


def test_a_rescue_racing_the_move_passes_over_the_row(
    pg_dsn: str, conn: psycopg.Connection, schema: str
) -> None:
    """The acknowledgement deletes the row while a rescue waits for its lock: the rescue finds
    it gone and changes nothing (a partition move would fail it instead: 'tuple to be locked
    was already moved to another partition')."""
    (a,) = _running(conn, schema)
    conn.execute(
        f"UPDATE {schema}.tasks SET lease_expires_at = now() - interval '1 s' WHERE id = %s", (a,)
    )
    out: dict[str, Any] = {}
    with psycopg.connect(pg_dsn) as acker:
        kept = store.complete(acker, schema, worker_id=WORKER, done=[(a, 1)], move=True)
        assert kept == {a: "done"}

        def rescue() -> None:
            with psycopg.connect(pg_dsn, autocommit=True) as c:
                out["rows"] = c.execute(
                    f"UPDATE {schema}.tasks SET state = 'queued', lease_expires_at = NULL "
                    "WHERE id = %s AND state = 'in_progress'",
                    (a,),
                ).rowcount

        t = threading.Thread(target=rescue)
        t.start()
        time.sleep(0.3)  # the rescue waits for the acknowledgement's row lock
        acker.commit()
        t.join(10)
    assert out == {"rows": 0}
    assert _where(conn, schema, a) == (None, "done")


def _slots(conn: psycopg.Connection, schema: str) -> dict[int, str]:
    return dict(conn.execute(f"SELECT slot, state FROM {schema}.history_slots ORDER BY slot"))


def test_rotation_opens_the_next_slot_after_a_slice_and_empties_slots_past_retention(
    conn: psycopg.Connection, schema: str
) -> None:
    assert _slots(conn, schema) == {1: "current", **{s: "empty" for s in range(2, 9)}}
    # Opened now (the test's schema may be a copy of one migrated minutes ago).
    conn.execute(f"UPDATE {schema}.history_slots SET opened_at = now() WHERE slot = 1")
    # Within its slice, the current slot stays.
    assert store.rotate_history(conn, schema, done_seconds=3600) == 0
    assert _slots(conn, schema)[1] == "current"
    (a,) = _running(conn, schema)
    with conn.transaction():
        store.complete(conn, schema, worker_id=WORKER, done=[(a, 1)], move=True)
    conn.execute(
        f"UPDATE {schema}.history_slots SET opened_at = now() - interval '11 minutes' "
        "WHERE slot = 1"
    )
    assert store.rotate_history(conn, schema, done_seconds=3600) == 0
    assert _slots(conn, schema) == {1: "closed", 2: "current", **{s: "empty" for s in range(3, 9)}}
    (b,) = _running(conn, schema)
    with conn.transaction():
        store.complete(conn, schema, worker_id=WORKER, done=[(b, 1)], move=True)
    assert (
        conn.execute(f"SELECT slot FROM {schema}.task_history WHERE id = %s", (b,)).fetchone()[0]
        == 2
    )
    # Closed less than the retention ago: kept.
    assert store.rotate_history(conn, schema, done_seconds=3600) == 0
    assert _where(conn, schema, a) == (None, "done")
    # Its newest row past the retention: the slot is emptied, whole.
    conn.execute(
        f"UPDATE {schema}.history_slots SET closed_at = now() - interval '61 minutes' "
        "WHERE slot = 1"
    )
    assert store.rotate_history(conn, schema, done_seconds=3600) == 1
    assert _where(conn, schema, a) == (None, None)
    assert _where(conn, schema, b) == (None, "done")
    assert _slots(conn, schema)[1] == "empty"


def test_rotation_never_opens_a_slot_that_holds_rows(conn: psycopg.Connection, schema: str) -> None:
    conn.execute(
        f"UPDATE {schema}.history_slots SET state = 'closed', closed_at = now() "
        "WHERE state = 'empty'"
    )
    conn.execute(
        f"UPDATE {schema}.history_slots SET opened_at = now() - interval '1 day' "
        "WHERE state = 'current'"
    )
    assert store.rotate_history(conn, schema, done_seconds=3600) == 0
    assert _slots(conn, schema)[1] == "current"  # longer than a slice, but nowhere to go


def test_a_reader_holding_a_slot_delays_its_emptying_without_waiting_for_it(
    pg_dsn: str, conn: psycopg.Connection, schema: str
) -> None:
    (a,) = _running(conn, schema)
    with conn.transaction():
        store.complete(conn, schema, worker_id=WORKER, done=[(a, 1)], move=True)
    conn.execute(
        f"UPDATE {schema}.history_slots "
        "SET state = CASE slot WHEN 1 THEN 'closed' ELSE 'current' END, "
        "closed_at = CASE slot WHEN 1 THEN now() - interval '2 hours' END, "
        "opened_at = CASE slot WHEN 2 THEN now() END WHERE slot IN (1, 2)"
    )
    with psycopg.connect(pg_dsn) as reader:
        reader.execute(f"SELECT * FROM {schema}.task_rows WHERE id = %s", (a,)).fetchone()
        began = time.monotonic()
        assert store.rotate_history(conn, schema, done_seconds=3600) == 0
        assert time.monotonic() - began < 2
        assert _where(conn, schema, a) == (None, "done")
    assert store.rotate_history(conn, schema, done_seconds=3600) == 1
    assert _where(conn, schema, a) == (None, None)


@pytest.mark.parametrize("move", [False, True])
def test_without_the_move_nothing_reaches_the_history(
    conn: psycopg.Connection, schema: str, move: bool
) -> None:
    (a,) = _running(conn, schema)
    with conn.transaction():
        store.complete(conn, schema, worker_id=WORKER, done=[(a, 1)], move=move)
    assert _where(conn, schema, a) == ((None, "done") if move else ("done", None))


def test_the_history_and_task_rows_have_every_column_of_tasks(
    conn: psycopg.Connection, schema: str
) -> None:
    """A migration that adds a column to tasks must add it to task_history and task_rows too."""

    def columns(table: str) -> list[tuple[str, str]]:
        return conn.execute(
            "SELECT a.attname, format_type(a.atttypid, a.atttypmod) FROM pg_attribute AS a "
            "WHERE a.attrelid = %s::regclass AND a.attnum > 0 AND NOT a.attisdropped "
            "ORDER BY a.attnum",
            (f"{schema}.{table}",),
        ).fetchall()

    tasks = columns("tasks")
    assert columns("task_history") == [*tasks, ("slot", "smallint")]
    assert columns("task_rows") == tasks
    for s in range(1, 9):
        assert columns(f"task_history_{s}") == [*tasks, ("slot", "smallint")]


def test_the_lists_and_counts_of_finished_rows_read_the_history_too(
    conn: psycopg.Connection, schema: str
) -> None:
    """The console's lists and throughput, status's counts, the minute rollup, the gauges'
    estimates and the check of a queue's name count a moved row as they count one done in
    place."""
    moved, other, kept = _running(conn, schema, 3)
    conn.execute(f"UPDATE {schema}.tasks SET queue = 'hq'")
    with conn.transaction():
        store.complete(conn, schema, worker_id=WORKER, done=[(moved, 1), (other, 1)], move=True)
        store.complete(conn, schema, worker_id=WORKER, done=[(kept, 1)])
    assert _where(conn, schema, moved) == (None, "done")
    q = every_statement(schema)

    counts, exact = status.finished_counts(conn, schema, cap=1000)
    assert counts == {("hq", "done"): 3} and exact

    for f in (Filter(state="done"), Filter(state="done", queue="hq"), Filter()):
        name, params = browse_statement(f, None, limit=50, scan=1000)
        rows = conn.execute(q[name], params).fetchall()
        assert {r[0] for r in rows if r[-2]} == {moved, other, kept}, (f, rows)

    minute = conn.execute("SELECT date_trunc('minute', now())").fetchone()[0]
    done, failed = conn.execute(
        q["throughput_minutes"], {"minutes": [minute], "cap": 1000}
    ).fetchone()[1:]
    assert (done, failed) == (3, 0)

    assert rollup.record_minute(conn, q, minute=minute) == minute
    waited = conn.execute(
        f"SELECT waited FROM {schema}.queue_minutes WHERE minute = %s AND queue = 'hq'", (minute,)
    ).fetchone()
    assert waited == (3,)

    conn.execute(f"DELETE FROM {schema}.tasks WHERE id = %s", (kept,))
    assert pause.never_named(conn, schema, "hq") is None  # named by its moved done rows

    conn.execute(f"ANALYZE {schema}.tasks")
    conn.execute(f"ANALYZE {schema}.task_history")
    estimates = dict(conn.execute(q["metrics_state_estimates"], {"schema": schema}).fetchall())
    assert estimates.get("done") == 2.0  # the moved rows: the task table holds no done row now


def test_a_bulk_delete_of_done_tasks_deletes_moved_ones_too(
    conn: psycopg.Connection, schema: str
) -> None:
    moved, other, kept, elsewhere = _running(conn, schema, 4)
    conn.execute(f"UPDATE {schema}.tasks SET queue = 'hq' WHERE id <> %s", (elsewhere,))
    with conn.transaction():
        store.complete(
            conn, schema, worker_id=WORKER, done=[(moved, 1), (other, 1), (elsewhere, 1)], move=True
        )
        store.complete(conn, schema, worker_id=WORKER, done=[(kept, 1)])
    assert _where(conn, schema, kept) == ("done", None)
    flt = bulk.Filter(queue="hq", states=("done",))
    seen = bulk.preview(conn, schema, "delete", flt, batch=2)
    assert seen.matched == 3 and {e["id"] for e in seen.examples} == {moved, other, kept}
    done = bulk.apply(conn, schema, "delete", flt, actor="me", batch=2)
    assert (done.matched, done.changed) == (3, 3)
    for i in (moved, other, kept):
        assert _where(conn, schema, i) == (None, None)
    assert _where(conn, schema, elsewhere) == (None, "done")


def test_a_worker_with_keep_history_moves_what_it_completes(
    pg_dsn: str, conn: psycopg.Connection, schema: str, thread_worker: Any
) -> None:
    """The whole path: a worker with keep_history acknowledges into the history (with results,
    and a transactional handler's row in its own transaction), waiters read them, and no plain
    task stays in the task table."""
    reg = worker.Registry()
    reg.task("h_plain")(lambda p: None)
    reg.task("h_result", store_result=True)(lambda p: {"twice": p["n"] * 2})
    reg.task("h_in_tx", transactional=True)(lambda p, ctx: ctx.conn.execute("SELECT 1"))
    plain = [worker.enqueue(conn, "h_plain", {"i": i}, schema=schema) for i in range(19)]
    plain.append(worker.enqueue(conn, "h_in_tx", {}, schema=schema))
    with_result = worker.enqueue(conn, "h_result", {"n": 21}, schema=schema)
    with thread_worker(reg, keep_history=True):
        assert worker.wait(pg_dsn, with_result, timeout=30, schema=schema) == {"twice": 42}
        wait_until(
            lambda: conn.execute(f"SELECT count(*) FROM {schema}.task_history").fetchone()[0] == 21
        )
    assert conn.execute(f"SELECT count(*) FROM {schema}.tasks").fetchone()[0] == 0
    assert {_where(conn, schema, i) for i in [*plain, with_result]} == {(None, "done")}


def test_a_heartbeat_racing_the_move_does_not_call_the_row_lost(
    conn: psycopg.Connection, schema: str
) -> None:
    """The lease keeper may still list a job whose acknowledgement just committed: a row it
    finds done by this worker, in the task table or moved, is not lost; one rescued is."""
    moved, rescued = _running(conn, schema, 2)
    with conn.transaction():
        store.complete(conn, schema, worker_id=WORKER, done=[(moved, 1)], move=True)
    conn.execute(
        f"UPDATE {schema}.tasks SET state = 'queued', lease_expires_at = NULL WHERE id = %s",
        (rescued,),
    )
    beat = store.heartbeat(
        conn, schema, worker_id=WORKER, tasks=[(moved, 1), (rescued, 1)], lease_seconds=30
    )
    assert beat.lost == {(rescued, 1)}


def test_worker_run_keep_history_moves_what_its_processes_complete(
    pg_dsn: str, conn: psycopg.Connection, schema: str
) -> None:
    """`worker run --keep-history` (two processes, so the flag reaches the supervisor's
    children): every task it completes leaves the task table for the history, and `worker
    status --id` still finds one."""
    ids = [worker.enqueue(conn, "noop", {"i": i}, schema=schema) for i in range(40)]
    r = run_cli(
        "run", "tasks_module", "--burst", "--processes", "2", "--keep-history",
        "--dsn", pg_dsn, "--schema", schema, timeout=120,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-2000:]
    assert conn.execute(f"SELECT count(*) FROM {schema}.tasks").fetchone()[0] == 0
    assert {_where(conn, schema, i) for i in ids} == {(None, "done")}
    shown = run_cli("status", "--id", str(ids[0]), "--json", "--dsn", pg_dsn, "--schema", schema)
    assert shown.returncode == 0, shown.stderr
    assert json.loads(shown.stdout)["state"] == "done"
