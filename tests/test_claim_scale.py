"""The claim at scale (issue 11): its cost does not grow with delayed rows, dead entries or the
number of queues served; rows behind the cursor are still found; notifications only for rows
that can run; delays by the database clock."""

from __future__ import annotations

import contextlib
import itertools
import json
import threading
import time
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg
import pytest
from conftest import every_statement, states, wait_until
from psycopg import sql

import worker
from worker import store as tr
from worker.db import connect as factory
from worker.db.sql import notify_channel
from worker.engine.batch import Batcher
from worker.engine.maintenance import Maintenance, MaintenanceConfig
from worker.store.claims import pace_params


def _claim_plan(conn: psycopg.Connection, schema: str, **params: Any) -> dict[str, Any]:
    """EXPLAIN (ANALYZE, BUFFERS) of the worker's claim statement, rolled back."""
    q = every_statement(schema)
    values = {
        "queues": ["q"],
        "limit": 10,
        "worker_id": "00000000-0000-0000-0000-000000000001",
        "lease_seconds": 30,
        "handler_tasks": [],
        "handler_max_attempts": [],
        "cursor_priority": [-(10**9)],
        "floor_run_at": ["0001-01-01T00:00:00+00"],
        "floor_id": [0],
        "lookahead": 0.5,
        **pace_params(None),
    }
    values.update(params)
    with conn.transaction(force_rollback=True):
        row = conn.execute(
            sql.SQL("EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) ") + q["claim"], values
        ).fetchone()
    assert row is not None
    return row[0][0]


def _batcher(
    schema: str,
    worker_id: str,
    *,
    queues: tuple[str, ...] | list[str] = ("q",),
    batch: int = 500,
    poll: float = 1.0,
) -> Batcher:
    """The claiming side of a worker (of queue q, claiming 500 rows at a time, unless told)."""
    return Batcher(
        every_statement(schema),
        worker_id,
        queues=list(queues),
        batch_size=batch,
        lease_seconds=30,
        delete_done=False,
        max_attempts={},
        poll_interval=poll,
        channel=notify_channel(schema),
    )


def _buffers(plan: dict[str, Any]) -> int:
    """Buffers the claim's search read (the `picked` CTE: the index ranges, and the rows it
    locked). The UPDATE that follows writes new row versions wherever the free-space map sends
    it, which varies from run to run and says nothing about what the search walked."""

    def find(node: dict[str, Any]) -> dict[str, Any] | None:
        if node.get("Subplan Name") == "CTE picked":
            return node
        for child in node.get("Plans", []):
            found = find(child)
            if found is not None:
                return found
        return None

    search = find(plan["Plan"])
    assert search is not None, "no `picked` CTE in the claim's plan"
    return int(search.get("Shared Hit Blocks", 0)) + int(search.get("Shared Read Blocks", 0))


def test_delayed_rows_cost_the_claim_nothing(conn: psycopg.Connection, schema: str) -> None:
    """200k rows delayed by a day, in the claimed queue and at a higher priority: the claim of
    the one due row reads about as many buffers as on a table with no delayed rows. (Before,
    delayed rows were in the claim index and each short claim walked all of them.)"""
    conn.execute(f"INSERT INTO {schema}.tasks (task, queue) VALUES ('due', 'q')")
    base = _buffers(_claim_plan(conn, schema))
    conn.execute(
        f"INSERT INTO {schema}.tasks (task, queue, priority, run_at)"
        " SELECT 'later', 'q', 5, now() + interval '1 day' FROM generate_series(1, 200000)"
    )
    conn.execute(f"VACUUM ANALYZE {schema}.tasks")
    assert states(conn, schema) == {"scheduled": 200000, "queued": 1}
    plan = _claim_plan(conn, schema)
    assert _buffers(plan) <= base + 10, (base, _buffers(plan))
    assert plan["Plan"]["Actual Rows"] == 1


def test_due_scheduled_rows_are_promoted_and_run(
    conn: psycopg.Connection, schema: str, thread_worker
) -> None:
    """A delayed task runs once due (promoted by the worker, no leader), a retry with a backoff
    waits as scheduled, and both finish done."""
    reg = worker.Registry()
    seen: list[str] = []
    reg.task("later")(lambda p: seen.append("later"))
    task_id = worker.enqueue(conn, "later", delay=1.0, schema=schema)
    assert conn.execute(
        f"SELECT state::text FROM {schema}.tasks WHERE id = %s", (task_id,)
    ).fetchone() == ("scheduled",)
    started = time.monotonic()
    with thread_worker(reg, poll_interval=5.0):
        wait_until(lambda: seen == ["later"], timeout=10)
    # Due after 1 s; the worker knew when (the promotion says when the next row is due), so
    # it did not wait for its 5 s poll.
    assert time.monotonic() - started < 4


def test_a_delay_counts_from_the_database_clock(conn: psycopg.Connection, schema: str) -> None:
    """delay= is added to the database's now(), not the producer's clock: run_at - created_at is
    exactly the delay, for enqueue and for enqueue_many (whose COPY cannot compute it)."""
    one = worker.enqueue(conn, "t", delay=90, schema=schema)
    worker.enqueue_many(conn, "t", [{"n": 1}, {"n": 2}], delay=45.5, schema=schema)
    rows = conn.execute(
        f"SELECT id, extract(epoch FROM run_at - created_at)::float8 FROM {schema}.tasks"
        " ORDER BY id"
    ).fetchall()
    assert rows[0] == (one, 90.0)
    assert [r[1] for r in rows[1:]] == [45.5, 45.5]


def test_notifications_only_for_rows_that_can_run(
    pg_dsn: str, conn: psycopg.Connection, schema: str
) -> None:
    """A dedupe hit and a delayed row wake nobody; a runnable row notifies with its queue."""
    worker.enqueue(conn, "t", queue="mail", dedupe_key="k", schema=schema)
    with psycopg.connect(pg_dsn, autocommit=True) as listener:
        listener.execute(f'LISTEN "{notify_channel(schema)}"')
        worker.enqueue(conn, "t", queue="mail", dedupe_key="k", schema=schema)  # a hit
        conn.execute(
            f"INSERT INTO {schema}.tasks (task, queue, dedupe_key) VALUES ('t', 'mail', 'k')"
            " ON CONFLICT DO NOTHING"
        )
        worker.enqueue(conn, "t", queue="mail", delay=3600, schema=schema)
        assert list(listener.notifies(timeout=0.5)) == []
        worker.enqueue(conn, "t", queue="reports", schema=schema)
        got = [n.payload for n in listener.notifies(timeout=2, stop_after=1)]
        assert len(got) == 1
        # The queue, and the run_at of the earliest row in microseconds (schema/0015).
        run_at = conn.execute(
            f"SELECT (extract(epoch FROM run_at) * 1000000)::bigint FROM {schema}.tasks"
            " WHERE queue = 'reports'"
        ).fetchone()[0]
        assert got[0] == f"reports,\x1e{run_at}"
        assert tr.parse_notification(got[0]) == (["reports"], run_at)


def test_a_notification_claims_only_the_queues_it_names(
    conn: psycopg.Connection, schema: str
) -> None:
    """A worker serving 200 queues reads one statement per wake-up, over the named queues only;
    every queue once per poll interval."""
    names = [f"q{i}" for i in range(200)]
    b = _batcher(schema, "00000000-0000-0000-0000-000000000002", queues=names, batch=10, poll=60.0)
    now = time.monotonic()
    with conn.transaction():
        first = b.claim(conn, 10, now)  # the first claim reads every queue
    assert first is not None and sorted(first.queues) == sorted(names)
    b.committed(first)
    assert not b.wants_claim(now + 1)
    worker.enqueue(conn, "t", queue="q7", schema=schema)
    assert b.notified("q7,not_mine")
    assert not b.notified("not_mine")
    with conn.transaction():
        got = b.claim(conn, 10, now + 1)
    assert got is not None and got.queues == ["q7"] and [r.queue for r in got.rows] == ["q7"]
    b.committed(got)
    assert not b.wants_claim(now + 2) and b.wants_claim(now + 61)


def test_a_row_committed_far_behind_the_cursor_is_still_claimed(
    conn: psycopg.Connection, schema: str, thread_worker
) -> None:
    """The claim starts after its cursor (plus a short look-back), so a row that appears far
    behind it (here a run_at an hour in the past, as a long producer transaction or an explicit
    time gives) is found by the maintenance thread's check and claimed within seconds."""
    reg = worker.Registry()
    done: list[int] = []
    reg.task("t")(lambda p: done.append(p["n"]))
    with thread_worker(reg, poll_interval=0.1):
        for n in range(5):
            worker.enqueue(conn, "t", {"n": n}, schema=schema)
        wait_until(lambda: len(done) == 5)
        started = time.monotonic()
        conn.execute(
            f"INSERT INTO {schema}.tasks (task, queue, payload, run_at)"
            " VALUES ('t', 'default', '{\"n\": 99}', now() - interval '1 hour')"
        )
        wait_until(lambda: 99 in done, timeout=10)
        assert time.monotonic() - started < 5


def test_dead_entries_behind_the_cursor_are_not_walked(
    pg_dsn: str, conn: psycopg.Connection, schema: str
) -> None:
    """While another session holds a snapshot (vacuum can remove nothing), 20,000 rows are
    claimed in small batches. A claim from the worker's cursor then reads a few buffers; the
    same claim from the start of the queue walks every dead entry. Short claims keep the
    cursor."""
    b = _batcher(schema, "00000000-0000-0000-0000-000000000003")
    with psycopg.connect(pg_dsn) as holder:
        holder.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
        holder.execute("SELECT 1").fetchone()  # the snapshot is taken: the horizon is held
        worker.enqueue_many(conn, "t", ({"n": i} for i in range(20000)), queue="q", schema=schema)
        claimed = 0
        while claimed < 20000:
            with conn.transaction():
                got = b.claim(conn, 500, time.monotonic())
            assert got is not None
            b.committed(got)
            claimed += len(got.rows)
        worker.enqueue(conn, "t", {"n": -1}, queue="q", schema=schema)
        with conn.transaction():  # a short claim: it finds the one new row
            got = b.claim(conn, 500, time.monotonic())
        assert got is not None and len(got.rows) == 1
        b.committed(got)
        worker.enqueue(conn, "t", {"n": -2}, queue="q", schema=schema)
        pos = b.cursor.position("q")
        from_cursor = _claim_plan(
            conn,
            schema,
            cursor_priority=[pos[0]],
            floor_run_at=[pos[1]],
            floor_id=[pos[2]],
        )
        from_start = _claim_plan(conn, schema)
        holder.rollback()
    assert from_cursor["Plan"]["Actual Rows"] == 1 and from_start["Plan"]["Actual Rows"] == 1
    assert _buffers(from_cursor) < 100, _buffers(from_cursor)
    assert _buffers(from_start) > 10 * _buffers(from_cursor), (
        _buffers(from_start),
        _buffers(from_cursor),
    )


def test_a_late_notification_sends_the_claim_back_only_as_far_as_its_rows(
    pg_dsn: str, conn: psycopg.Connection, schema: str
) -> None:
    """While another session holds a snapshot, 20,000 rows enqueued in 40 transactions are
    claimed. A notification of rows already claimed comes late (the worker read on past them
    before it got to the notification), naming the run_at of the 38th transaction; so does the
    maintenance thread's probe, for another row. The next claim reads the queue from that run_at,
    a few buffers, not from the queue's start over every dead entry (which a late notification
    did before, many times a minute under load, each walk longer as the dead entries grew)."""
    b = _batcher(schema, "00000000-0000-0000-0000-000000000004")

    def claim_all() -> int:
        got = b.claim(conn, 500, time.monotonic())
        assert got is not None
        b.committed(got)
        return len(got.rows)

    def from_position() -> dict[str, Any]:
        pos = b.cursor.position("q")
        return _claim_plan(
            conn, schema, cursor_priority=[pos[0]], floor_run_at=[pos[1]], floor_id=[pos[2]]
        )

    with psycopg.connect(pg_dsn) as holder:
        holder.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
        holder.execute("SELECT 1").fetchone()  # the snapshot is taken: the horizon is held
        starts = []
        for _ in range(40):
            with conn.transaction():
                worker.enqueue_many(
                    conn, "t", ({"n": i} for i in range(500)), queue="q", schema=schema
                )
                starts.append(conn.execute("SELECT now()").fetchone()[0])
        claimed = 0
        while claimed < 20000:
            with conn.transaction():
                claimed += claim_all()
        worker.enqueue(conn, "t", {"n": -1}, queue="q", schema=schema)
        late = (starts[37] - datetime(1970, 1, 1, tzinfo=UTC)) // timedelta(microseconds=1)
        assert b.cursor.passed("q", late)  # behind the floor: the old code read from the start
        assert b.notified(f"q,\x1e{late}")
        floor = b.cursor.position("q")[1]
        assert starts[36] < floor < starts[37]
        rewound = from_position()
        with conn.transaction():
            assert claim_all() == 1  # the one new row
        assert b.cursor.position("q")[1] >= starts[38]  # the floor trails the claims again
        worker.enqueue(conn, "t", {"n": -2}, queue="q", schema=schema)
        b.rewind([("q", late)])  # the maintenance thread's probe, as it reports a row
        probed = from_position()
        from_start = _claim_plan(conn, schema)
        holder.rollback()
    for plan in (rewound, probed, from_start):
        assert plan["Plan"]["Actual Rows"] == 1
    assert _buffers(rewound) * 5 < _buffers(from_start), (_buffers(rewound), _buffers(from_start))
    assert _buffers(probed) * 5 < _buffers(from_start), (_buffers(probed), _buffers(from_start))


def test_promotion_by_concurrent_workers_moves_each_row_once(pg_dsn: str, schema: str) -> None:
    """Any worker promotes (no leader): four sessions promoting at once move each due row
    exactly once, and each says when the next scheduled row is due."""
    with psycopg.connect(pg_dsn, autocommit=True) as c:
        c.execute(
            f"INSERT INTO {schema}.tasks (task, queue, state, run_at)"
            " SELECT 't', 'q', 'scheduled', now() - interval '1 second'"
            " FROM generate_series(1, 5000)"
        )
        c.execute(
            f"INSERT INTO {schema}.tasks (task, queue, run_at)"
            " VALUES ('t', 'q', now() + interval '100 seconds')"
        )
    q = every_statement(schema)
    results: list[tr.Promoted] = []
    lock = threading.Lock()

    def promote() -> None:
        with psycopg.connect(pg_dsn, autocommit=True) as c:
            while True:
                with c.transaction():
                    p = tr.promote(c, q.schema, limit=300, channel=notify_channel(schema))
                with lock:
                    results.append(p)
                if p.count == 0:
                    return

    threads = [threading.Thread(target=promote) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sum(p.count for p in results) == 5000
    last = [p for p in results if p.count == 0]
    assert last and all(p.next_due_in is not None and 90 < p.next_due_in <= 100 for p in last)
    with psycopg.connect(pg_dsn) as c:
        assert states(c, schema) == {"scheduled": 1, "queued": 5000}


def test_json_payload_survives(conn: psycopg.Connection, schema: str) -> None:
    """Delayed rows keep their payloads through promotion."""
    task_id = worker.enqueue(conn, "t", {"a": [1, 2]}, delay=0.001, schema=schema)
    time.sleep(0.01)
    with conn.transaction():
        tr.promote(conn, schema, limit=10, channel=notify_channel(schema))
    row = conn.execute(
        f"SELECT state::text, payload::text FROM {schema}.tasks WHERE id = %s", (task_id,)
    ).fetchone()
    assert row is not None and row[0] == "queued" and json.loads(row[1]) == {"a": [1, 2]}


def test_a_worker_of_many_queues_finds_work_without_notifications(
    conn: psycopg.Connection, schema: str, thread_worker
) -> None:
    """Serving 50 queues without LISTEN, the claim no longer reads every queue on each poll: the
    maintenance thread asks which queues hold work, and the claim reads those. Rows still run."""
    reg = worker.Registry()
    done: list[str] = []
    reg.task("t")(lambda p: done.append(p["q"]))
    names = [f"q{i}" for i in range(50)]
    with thread_worker(reg, queues=names, listen=False, poll_interval=0.2):
        for name in ("q3", "q49", "q17"):
            worker.enqueue(conn, "t", {"q": name}, queue=name, schema=schema)
        wait_until(lambda: sorted(done) == ["q17", "q3", "q49"], timeout=10)


def _table_reads(conn: psycopg.Connection, schema: str) -> int:
    """Rows the server has read from the task table by sequential scans, so far."""
    row = conn.execute(
        "SELECT coalesce(seq_tup_read, 0) FROM pg_stat_user_tables"
        " WHERE schemaname = %s AND relname = 'tasks'",
        (schema,),
    ).fetchone()
    assert row is not None
    return int(row[0])


def test_a_worker_started_on_an_empty_table_stays_on_the_indexes_as_it_grows(
    conn: psycopg.Connection, schema: str, thread_worker
) -> None:
    """The worker's statements are prepared, and the server caches a generic plan after a few
    runs, costed for the table of that moment. A worker that starts on an empty table (a new
    install, a truncated table) must not keep a sequential scan for good: once the table holds
    50,000 finished rows, running 20 more tasks must not read them even once. (Measured before
    the fix: 2,000 buffers per claim with 9,000 rows, and growing with the table.)"""
    reg = worker.Registry()
    reg.task("noop", queue="q")(lambda p: None)

    def run_one() -> None:
        task_id = worker.enqueue(conn, "noop", schema=schema)
        wait_until(
            lambda: conn.execute(
                f"SELECT state = 'done' FROM {schema}.tasks WHERE id = %s", (task_id,)
            ).fetchone()[0]
        )

    with thread_worker(reg, poll_interval=0.2):
        for _ in range(30):  # well past the five runs after which plans may be cached
            run_one()
        conn.execute(
            f"INSERT INTO {schema}.tasks (task, queue, state, finished_at)"
            " SELECT 'old', 'q', 'done', now() FROM generate_series(1, 50000)"
        )
        time.sleep(2.5)  # the server publishes table statistics about once a second
        before = _table_reads(conn, schema)
        for _ in range(20):
            run_one()
        time.sleep(2.5)
        read = _table_reads(conn, schema) - before
    assert read < 50000, f"the worker's statements read {read} rows by sequential scans"


def test_the_cursor_probe_is_spaced_by_its_own_cost(pg_dsn: str, schema: str) -> None:
    """The probe for rows behind the cursor walks dead index entries while a long transaction
    holds vacuum back; each run then costs more. It must not run back to back: a probe that
    takes 100 ms runs at most about once per 5 s, one that is cheap once a second."""
    calls: list[float] = []

    def probe(conn: psycopg.Connection, cost: float) -> None:
        calls.append(time.monotonic())
        conn.execute("SELECT pg_sleep(%s)", (cost,))

    def run(cost: float, seconds: float) -> list[float]:
        calls.clear()
        maintenance = Maintenance(
            pg_dsn,
            every_statement(schema),
            MaintenanceConfig(
                rescue_seconds=3600,
                purge_seconds=3600,
                keep_done_seconds=3600,
                keep_failed_seconds=3600,
                cron_keep_seconds=3600,
            ),
            counted=lambda conn: contextlib.nullcontext(),
            on_rescued=lambda rows: None,
            on_cron=lambda n: None,
            cron=None,
            probe=lambda conn: probe(conn, cost),
        )
        maintenance.start()
        time.sleep(seconds)
        maintenance.stop()
        return list(calls)

    cheap = run(0.0, 4.5)
    assert 3 <= len(cheap) <= 6, cheap
    costly = run(0.1, 11.0)
    gaps = [b - a for a, b in itertools.pairwise(costly)]
    assert 2 <= len(costly) <= 3 and all(g >= 4.5 for g in gaps), gaps


def test_a_row_committed_long_after_its_transaction_began_is_claimed_at_once(
    pg_dsn: str, conn: psycopg.Connection, schema: str, thread_worker
) -> None:
    """A producer's transaction inserts a row, works for two seconds while other rows are
    enqueued and claimed (the worker's cursor moves past the row's run_at, the transaction's
    start), then commits. The notification carries the row's run_at (schema/0015), so the
    worker reads the queue from that run_at at once: neither its poll (30 s here) nor the
    cursor probe (30 s apart while notifications arrive) is what finds the row."""
    reg = worker.Registry()
    done: list[int] = []
    reg.task("t")(lambda p: done.append(p["n"]))
    with thread_worker(reg, poll_interval=30.0):
        for n in range(3):
            worker.enqueue(conn, "t", {"n": n}, schema=schema)
        wait_until(lambda: len(done) == 3)
        time.sleep(1.5)  # the first probe (a second after the start) has run: the next is far
        with psycopg.connect(pg_dsn) as producer:
            worker.enqueue(producer, "t", {"n": 99}, schema=schema)
            time.sleep(1.2)
            for n in range(3, 6):
                worker.enqueue(conn, "t", {"n": n}, schema=schema)
                wait_until(lambda n=n: n in done)
                time.sleep(0.5)
            producer.commit()
            committed = time.monotonic()
        wait_until(lambda: 99 in done, timeout=15)
        assert time.monotonic() - committed < 3


def test_rescue_walks_only_leases_that_ran_out_since_its_last_pass(
    pg_dsn: str, conn: psycopg.Connection, schema: str
) -> None:
    """While a snapshot is held, 20,000 rows run and finish; each leaves a dead entry with an
    expired lease in the lease index. A rescue pass bounded by the previous pass's start reads
    a few buffers; an unbounded one walks every dead entry. Both rescue the one row whose lease
    just ran out."""
    q = every_statement(schema)

    def plan(since: object) -> tuple[int, int]:
        with conn.transaction(force_rollback=True):
            row = conn.execute(
                sql.SQL("EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) ") + q["rescue"],
                {"limit": 1000, "since": since, **tr.HISTORY},
            ).fetchone()
        assert row is not None
        top = row[0][0]["Plan"]
        return int(top["Actual Rows"]), int(top.get("Shared Hit Blocks", 0)) + int(
            top.get("Shared Read Blocks", 0)
        )

    with psycopg.connect(pg_dsn) as holder:
        holder.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
        holder.execute("SELECT 1").fetchone()
        worker.enqueue_many(conn, "t", ({"n": i} for i in range(20000)), queue="q", schema=schema)
        conn.execute(
            f"UPDATE {schema}.tasks SET state = 'in_progress', attempts = 1,"
            " lease_expires_at = now() - interval '5 minutes'"
        )
        conn.execute(
            f"UPDATE {schema}.tasks SET state = 'done', finished_at = now(),"
            " lease_expires_at = NULL"
        )
        worker.enqueue(conn, "t", {"n": -1}, queue="q", schema=schema)
        conn.execute(
            f"UPDATE {schema}.tasks SET state = 'in_progress', attempts = 1,"
            " lease_expires_at = now() - interval '1 second' WHERE state = 'queued'"
        )
        since = conn.execute("SELECT now() - interval '1 minute'").fetchone()[0]
        bounded_rows, bounded = plan(since)
        full_rows, full = plan(None)
        holder.rollback()
    assert bounded_rows == 1 and full_rows == 1
    assert bounded < 100, bounded
    assert full > 10 * bounded, (full, bounded)


def test_a_queue_whose_name_holds_a_comma_is_still_woken(
    pg_dsn: str, conn: psycopg.Connection, schema: str, thread_worker
) -> None:
    """Notifications list queues separated by commas; a queue named 'a,b' cannot be listed, so
    its notification names every queue instead of waking the workers of 'a' and 'b'. Its worker
    starts the task at once, not at its next poll (30 s here)."""
    reg = worker.Registry()
    done: list[int] = []
    reg.task("t")(lambda p: done.append(p["n"]))
    with psycopg.connect(pg_dsn, autocommit=True) as listener:
        listener.execute(f'LISTEN "{notify_channel(schema)}"')
        worker.enqueue(conn, "t", {"n": 0}, queue="a,b", schema=schema)
        assert [n.payload for n in listener.notifies(timeout=2, stop_after=1)] == [""]
    with thread_worker(reg, queues=["a,b"], poll_interval=30.0):
        wait_until(lambda: done == [0])
        time.sleep(0.5)
        began = time.monotonic()
        worker.enqueue(conn, "t", {"n": 1}, queue="a,b", schema=schema)
        wait_until(lambda: 1 in done, timeout=10)
        assert time.monotonic() - began < 3


@pytest.mark.parametrize("with_result", [False, True], ids=["complete", "complete_with_result"])
def test_acknowledgements_read_only_their_rows_whatever_the_table_held_before(
    pg_dsn: str, conn: psycopg.Connection, schema: str, with_result: bool
) -> None:
    """A worker that starts on a small table must not keep, for its acknowledgements, a plan
    made for a small table: one that reads the whole primary key and looks for the batch in
    it. With autovacuum off (or before it analyses), such a plan stayed cached, and each
    acknowledgement of one row read every row of the table."""
    q = every_statement(schema)
    conn.execute(f"ALTER TABLE {schema}.tasks SET (autovacuum_enabled = false)")
    conn.execute(f"VACUUM ANALYZE {schema}.tasks")  # empty, as after a TRUNCATE and a vacuum
    me = "00000000-0000-0000-0000-0000000000aa"
    with factory.connect(pg_dsn, factory.CLAIM) as w:  # prepared, plans on the indexes

        def one_round() -> int:
            conn.execute(f"INSERT INTO {schema}.tasks (task, queue) VALUES ('t', 'q')")
            [c] = tr.claim(w, q.schema, queues=["q"], limit=1, worker_id=me, lease_seconds=30)
            with w.transaction():
                if with_result:
                    acked = tr.complete_with_result(
                        w, q.schema, worker_id=me, done=[(c.id, c.attempt, '{"n": 1}')]
                    )
                else:
                    acked = tr.complete(w, q.schema, worker_id=me, done=[(c.id, c.attempt)])
                assert acked == {c.id: "done"}
                row = w.execute(
                    "SELECT idx_tup_fetch FROM pg_stat_xact_user_tables"
                    " WHERE schemaname = %s AND relname = 'tasks'",
                    (schema,),
                ).fetchone()
            return int(row[0]) if row else 0

        for _ in range(12):  # past the five executions after which a generic plan is cached
            one_round()
        conn.execute(
            f"INSERT INTO {schema}.tasks (task, queue, state, attempts, worker_id, started_at,"
            " lease_expires_at) SELECT 't', 'other', 'in_progress', 1, gen_random_uuid(), now(),"
            " now() + interval '1 hour' FROM generate_series(1, 30000)"
        )
        read = one_round()
        assert read < 100, f"{read} rows read to acknowledge one"  # not the table's 30,000


def test_a_large_batch_is_acknowledged_whole_and_fenced_row_by_row(
    conn: psycopg.Connection, schema: str
) -> None:
    """A batch of 237 rows: every row still ours ends done with its own result, and a row at a
    stale attempt or owned by another worker, anywhere in the batch, is left as it is. The same
    row may come twice, at a stale attempt and at its own (cancelled, retried and claimed again
    by this worker before the first outcome was acknowledged): the one at its own attempt ends
    it."""
    me = "00000000-0000-0000-0000-0000000000ab"
    other = "00000000-0000-0000-0000-0000000000ac"
    n = 237
    ids = [
        r[0]
        for r in conn.execute(
            f"INSERT INTO {schema}.tasks (task, queue, state, attempts, worker_id, started_at,"
            " lease_expires_at) SELECT 't', 'q', 'in_progress', 2, %s, now(),"
            " now() + interval '1 hour' FROM generate_series(1, %s) ORDER BY 1 RETURNING id",
            (me, n),
        ).fetchall()
    ]
    stale = set(ids[5::75])  # acknowledged at attempt 1
    taken = ids[-1]
    conn.execute(f"UPDATE {schema}.tasks SET worker_id = %s WHERE id = %s", (other, taken))
    twice = ids[100]
    done = [(i, 1 if i in stale else 2, json.dumps({"id": i})) for i in ids]
    done.insert(50, (twice, 1, json.dumps({"stale": True})))  # before its own attempt
    acked = tr.complete_with_result(conn, schema, worker_id=me, done=done)
    assert acked == {i: "done" for i in ids if i not in stale and i != taken}
    ended = conn.execute(f"SELECT id, result FROM {schema}.tasks WHERE state = 'done'")
    rows = dict(ended.fetchall())
    assert rows == {i: {"id": i} for i in acked}
    left = conn.execute(
        f"SELECT count(*) FROM {schema}.tasks WHERE state = 'in_progress'"
    ).fetchone()[0]
    assert left == len(stale) + 1
    plain = [(i, 2) for i in sorted(stale)]  # their right attempt now, without results
    plain.insert(0, (max(stale), 1))  # and one of them once more, at its stale attempt first
    assert tr.complete(conn, schema, worker_id=me, done=plain) == {i: "done" for i in stale}


def test_a_rescue_walks_dead_lease_entries_before_it_holds_up_the_worker(
    pg_dsn: str, conn: psycopg.Connection, schema: str
) -> None:
    """A rescue runs in the worker's counted transaction, and the worker's claims and
    acknowledgements wait for that one. Under a long transaction elsewhere, the lease index keeps
    an entry for every task finished since it began; the rescue looks for leases that ran out
    first, holding nothing, and enters that transaction only when it found one, to read from
    there: here it reads a handful of entries, not the 3,000 dead ones before the one to take."""
    me = "00000000-0000-0000-0000-0000000000ab"
    entered: list[int] = []

    def lease_entries_read(c: psycopg.Connection) -> int:
        # This session's count, pending since its last report (reports wait for the end of a
        # transaction): the difference across the transaction is what it read.
        return int(
            c.execute(
                "SELECT pg_stat_get_xact_tuples_returned(%s::regclass)",
                (f"{schema}.tasks_lease_idx",),
            ).fetchone()[0]
        )

    @contextlib.contextmanager
    def counted(c: psycopg.Connection) -> Any:
        with c.transaction():
            before = lease_entries_read(c)
            yield
            entered.append(lease_entries_read(c) - before)

    def maintenance() -> Maintenance:
        config = MaintenanceConfig(
            rescue_seconds=3600,
            purge_seconds=3600,
            keep_done_seconds=3600,
            keep_failed_seconds=3600,
            cron_keep_seconds=3600,
        )
        return Maintenance(
            pg_dsn,
            every_statement(schema),
            config,
            counted=counted,
            on_rescued=lambda rows: None,
            on_cron=lambda n: None,
            cron=None,
        )

    with psycopg.connect(pg_dsn) as holder:
        holder.execute("SELECT txid_current()")  # held open: vacuum keeps every dead entry
        conn.execute(
            f"INSERT INTO {schema}.tasks (task, queue, state, attempts, worker_id, started_at,"
            " lease_expires_at) SELECT 't', 'q', 'in_progress', 1, %s, now() - interval '2 hours',"
            " now() - interval '1 hour' + g * interval '1 ms' FROM generate_series(1, 3000) AS g",
            (me,),
        )
        conn.execute(
            f"UPDATE {schema}.tasks SET state = 'done', finished_at = now(),"
            " lease_expires_at = NULL WHERE state = 'in_progress'"
        )
        first = maintenance()
        try:
            assert first.rescue() == 0
        finally:
            first.stop()
        assert entered == []  # nothing ran out: the worker was never held up
        lapsed = conn.execute(
            f"INSERT INTO {schema}.tasks (task, queue, state, attempts, worker_id, started_at,"
            " lease_expires_at) VALUES ('t', 'q', 'in_progress', 1, %s, now() - interval '1 hour',"
            " now() - interval '1 minute') RETURNING id",
            (me,),
        ).fetchone()[0]
        second = maintenance()  # its first pass is a full one, from the oldest lease
        try:
            assert second.rescue() == 1
        finally:
            second.stop()
        holder.rollback()
    assert len(entered) == 1 and entered[0] < 50, entered
    row = conn.execute(f"SELECT state::text FROM {schema}.tasks WHERE id = %s", (lapsed,))
    assert row.fetchone()[0] == "queued"


def test_a_heartbeat_reads_only_its_rows_whatever_the_statistics_say(
    pg_dsn: str, conn: psycopg.Connection, schema: str
) -> None:
    """The heartbeat renews a worker's leases on a connection of its own, planned per beat from
    the table's statistics. Analysed while the table was empty (autovacuum off, or before its
    first visit), a join of the table with the beat's ids read the whole primary key index for
    each beat: under a long transaction elsewhere, past the statement timeout, and the leases
    went unrenewed. It reads its own rows by primary key, whatever the table holds."""
    _statistics_of_an_empty_table(conn, schema)
    me = "00000000-0000-0000-0000-0000000000ad"
    mine = _running_as(conn, schema, me, 3)
    with factory.connect(pg_dsn, factory.LEASE) as w, w.transaction():
        before = _key_entries_read(w, schema)
        beat = tr.heartbeat(
            w, schema, worker_id=me, tasks=[(i, 1) for i in mine], lease_seconds=3600
        )
        read = _key_entries_read(w, schema) - before
    assert beat.lost == set() and beat.cancel == set()
    assert read < 100, f"{read} primary key entries read to renew 3 leases"
    renewed = conn.execute(
        f"SELECT count(*) FROM {schema}.tasks WHERE id = ANY(%s)"
        " AND lease_expires_at > now() + interval '50 minutes'",
        (mine,),
    ).fetchone()[0]
    assert renewed == 3


def test_the_sweep_of_workflow_steps_reads_no_row_whatever_the_statistics_say(
    pg_dsn: str, conn: psycopg.Connection, schema: str
) -> None:
    """The sweep that settles workflow steps (settle_missed) runs after every rescue pass on
    every worker. Planned from statistics that said the table was nearly empty, its update of
    the waiting steps it frees read the whole primary key index each time, with no step to
    free: under a long transaction elsewhere, 1.7 s every few seconds."""
    _statistics_of_an_empty_table(conn, schema)
    with factory.connect(pg_dsn, factory.MAINTENANCE) as w, w.transaction():
        before = _key_entries_read(w, schema)
        assert tr.settle_missed(w, schema, limit=1000) == 0
        read = _key_entries_read(w, schema) - before
    assert read < 100, f"{read} primary key entries read to find nothing to settle"


def _statistics_of_an_empty_table(conn: psycopg.Connection, schema: str) -> None:
    """The statistics a vacuum of a busy queue may leave (one live row in hundreds of pages: the
    planner then believes the table holds next to nothing, however much it grows), and then
    30,000 rows in progress, of other workers."""
    conn.execute(f"ALTER TABLE {schema}.tasks SET (autovacuum_enabled = false)")
    conn.execute(
        f"INSERT INTO {schema}.tasks (task, queue, state, finished_at)"
        " SELECT 't', 'q', 'done', now() FROM generate_series(1, 30000)"
    )
    conn.execute(f"DELETE FROM {schema}.tasks WHERE id <> (SELECT max(id) FROM {schema}.tasks)")
    conn.execute(f"VACUUM {schema}.tasks")
    conn.execute(
        f"INSERT INTO {schema}.tasks (task, queue, state, attempts, worker_id, started_at,"
        " lease_expires_at) SELECT 't', 'q', 'in_progress', 1, gen_random_uuid(), now(),"
        " now() + interval '1 hour' FROM generate_series(1, 30000)"
    )


def _key_entries_read(
    w: psycopg.Connection, schema: str, indexes: tuple[str, ...] = ("tasks_pkey",)
) -> int:
    """Entries of these indexes (the task table's primary key unless told) this session read,
    pending since its last report (reports wait for the end of a transaction: a difference
    within one is what it read)."""
    row = w.execute(
        "SELECT sum(pg_stat_get_xact_tuples_returned(i::regclass))::bigint"
        " FROM unnest(%s::text[]) AS i",
        ([f"{schema}.{name}" for name in indexes],),
    ).fetchone()
    return int(row[0])


@pytest.mark.parametrize("outcome", ["fail", "hand_back", "release"])
def test_the_other_outcomes_read_only_their_rows_whatever_the_statistics_say(
    pg_dsn: str, conn: psycopg.Connection, schema: str, outcome: str
) -> None:
    """A failure, a hand-back and a release are planned per batch from the table's statistics,
    like the heartbeat: they read their rows by primary key whatever those say."""
    _statistics_of_an_empty_table(conn, schema)
    me = "00000000-0000-0000-0000-0000000000ae"
    [mine] = _running_as(conn, schema, me, 1)
    with factory.connect(pg_dsn, factory.CLAIM) as w, w.transaction():
        before = _key_entries_read(w, schema)
        if outcome == "fail":
            failure = tr.Failure(mine, 1, 0.0, "boom", permanent=False)
            states = tr.fail(w, schema, worker_id=me, failures=[failure])
        elif outcome == "hand_back":
            states = tr.hand_back(w, schema, worker_id=me, rows=[(mine, 1, "no handler")])
        else:
            states = tr.release(w, schema, worker_id=me, tasks=[(mine, 1)])
        read = _key_entries_read(w, schema) - before
    assert mine in states
    assert read < 100, f"{read} primary key entries read for one {outcome}"


def _claimed_by(conn: psycopg.Connection, schema: str, worker_id: str, ids: list[int]) -> None:
    """These enqueued rows in progress at attempt 1 (their last) for this worker, as its claim
    would leave them, their leases an hour away."""
    conn.execute(
        f"UPDATE {schema}.tasks SET state = 'in_progress', attempts = 1, max_attempts = 1,"
        " worker_id = %s, started_at = now(), lease_expires_at = now() + interval '1 hour'"
        " WHERE id = ANY(%s)",
        (worker_id, ids),
    )


def _running_as(conn: psycopg.Connection, schema: str, worker_id: str, n: int) -> list[int]:
    """n rows in progress at attempt 1 for this worker, their leases a minute away."""
    rows = conn.execute(
        f"INSERT INTO {schema}.tasks (task, queue, state, attempts, worker_id, started_at,"
        " lease_expires_at) SELECT 't', 'q', 'in_progress', 1, %s, now(),"
        " now() + interval '1 minute' FROM generate_series(1, %s) RETURNING id",
        (worker_id, n),
    )
    return [r[0] for r in rows.fetchall()]


def test_a_steps_acknowledgement_reaches_its_join_by_primary_key_whatever_the_statistics_say(
    pg_dsn: str, conn: psycopg.Connection, schema: str
) -> None:
    """The acknowledgement of a fan-in's steps settles their join in the same statement, with a
    plan made once per session from the table's statistics: it reads the join by primary key
    whatever those say, not the whole index at every batch."""
    _statistics_of_an_empty_table(conn, schema)
    me = "00000000-0000-0000-0000-0000000000af"
    chord = worker.group([worker.step("t.input", {"n": n}) for n in range(200)], then="t.join")
    ids = worker.enqueue_workflow(conn, chord, schema=schema)
    inputs, join = [ids[s] for s in chord.steps[:-1]], ids[chord.steps[-1]]
    _claimed_by(conn, schema, me, inputs)
    reads = []
    with factory.connect(pg_dsn, factory.CLAIM) as w:
        for piece in (inputs[:100], inputs[100:]):
            with w.transaction():
                before = _key_entries_read(w, schema)
                done = [(i, 1, json.dumps(i)) for i in piece]
                acked, _ = tr.complete_steps(w, schema, worker_id=me, done=done)
                reads.append(_key_entries_read(w, schema) - before)
            assert acked == dict.fromkeys(piece, "done")
    state, got = conn.execute(
        f"SELECT state::text, inputs FROM {schema}.tasks WHERE id = %s", (join,)
    ).fetchone()
    assert (state, got) == ("queued", inputs)
    # 100 steps and their join, a few entries more for the locks: not the 30,000 rows of others.
    assert max(reads) < 1000, f"{reads} primary key entries read per acknowledgement of 100 steps"


def test_a_workflow_is_enqueued_by_primary_key_whatever_the_statistics_say(
    conn: psycopg.Connection, schema: str
) -> None:
    """The trigger that checks and counts a workflow's edges as they are inserted looks up their
    steps by primary key, whatever the table's statistics say: enqueueing a chord reads its own
    rows, not the 30,000 of others once for every check."""
    _statistics_of_an_empty_table(conn, schema)
    reads = []
    for _ in range(2):
        chord = worker.group([worker.step("t.input", {"n": n}) for n in range(20)], then="t.join")
        with conn.transaction():
            before = _key_entries_read(conn, schema)
            ids = worker.enqueue_workflow(conn, chord, schema=schema)
            reads.append(_key_entries_read(conn, schema) - before)
        join = ids[chord.steps[-1]]
        state, pending = conn.execute(
            f"SELECT state::text, pending_deps FROM {schema}.tasks WHERE id = %s", (join,)
        ).fetchone()
        assert (state, pending) == ("waiting", 20)
    assert max(reads) < 1000, f"{reads} primary key entries read to enqueue a chord of 21 steps"


def _fan_out_from_one_step(
    w: psycopg.Connection, conn: psycopg.Connection, schema: str, width: int, outcome: str
) -> float:
    """Seconds the end of one step takes to settle its ``width`` dependents (each with a
    dependent of its own, cancelled in turn when the step failed for good)."""
    me = "00000000-0000-0000-0000-0000000000b0"
    flow = worker.Workflow()
    source = flow.add("t.source")
    for i in range(width):
        flow.add("t.leaf", {"i": i}, depends_on=[flow.add("t.mid", {"i": i}, depends_on=[source])])
    ids = worker.enqueue_workflow(conn, flow, schema=schema)
    first = ids[source]
    _claimed_by(conn, schema, me, [first])
    with w.transaction():
        began = time.perf_counter()
        if outcome == "done":
            tr.complete_steps(w, schema, worker_id=me, done=[(first, 1, "1")])
        else:
            failure = tr.Failure(first, 1, 0.0, "boom", permanent=True)
            tr.fail(w, schema, worker_id=me, failures=[failure])
            tr.settle_steps(w, schema, [first])
        spent = time.perf_counter() - began
    mids = conn.execute(
        f"SELECT state::text, count(*) FROM {schema}.tasks"
        " WHERE workflow_id = %s AND task = 't.mid' GROUP BY 1",
        (ids.id,),
    ).fetchall()
    assert mids == [("queued" if outcome == "done" else "cancelled", width)]
    return spent


@pytest.mark.parametrize("outcome", ["done", "failed"])
def test_a_steps_end_settles_its_dependents_in_time_that_grows_with_their_number(
    pg_dsn: str, conn: psycopg.Connection, schema: str, outcome: str
) -> None:
    """A step with ten times the dependents takes about ten times as long to settle them when
    it ends, not a hundred: the settlement reads each edge once (it used to look up every
    dependent's error among all the edges: 33 s for 20,000 dependents), whatever plans the
    session made before."""
    with factory.connect(pg_dsn, factory.CLAIM) as w:
        # The session's plans are made at the first call, here by an acknowledgement of a
        # step with one dependent, as a worker's usually are, before any wide settlement.
        _fan_out_from_one_step(w, conn, schema, 1, "done")
        small = _fan_out_from_one_step(w, conn, schema, 1_000, outcome)
        large = _fan_out_from_one_step(w, conn, schema, 10_000, outcome)
    assert large < 30 * max(small, 0.01), (
        f"{large:.2f} s for 10,000 dependents, {small:.2f} s for 1,000"
    )


def test_a_join_whose_edges_arrive_one_statement_at_a_time_reads_only_the_new_ones(
    conn: psycopg.Connection, schema: str
) -> None:
    """create_workflow (and a producer's plain INSERTs) adds a step's edges one statement at a
    time: each is checked and counted alone, without reading the join's earlier edges again
    (1,500 inputs: 1.1 million edge entries read, growing with the square of the width)."""
    n = 1_500
    steps = [{"key": f"s{i}", "task": "t.input"} for i in range(n)]
    steps.append({"key": "join", "task": "t.join", "depends_on": [f"s{i}" for i in range(n)]})
    edges = ("task_deps_pkey", "task_deps_depends_on_idx")
    create = sql.SQL("SELECT {}.create_workflow(%s::jsonb, 'wide join')").format(
        sql.Identifier(schema)
    )
    with conn.transaction():
        before = _key_entries_read(conn, schema, edges)
        conn.execute(create, (json.dumps(steps),))
        entries = _key_entries_read(conn, schema, edges) - before
    state, pending = conn.execute(
        f"SELECT state::text, pending_deps FROM {schema}.tasks WHERE task = 't.join'"
    ).fetchone()
    assert (state, pending) == ("waiting", n)
    assert entries < 20 * n, f"{entries} edge index entries read to add {n} edges to one join"
