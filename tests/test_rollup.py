"""The minute rollup behind the charts (schema/0018): what a minute records is what the task table
says, one worker records each minute however many try at once, old minutes go, and a running
worker records minutes without being asked."""

from __future__ import annotations

import threading
import time
from datetime import datetime, timedelta
from typing import Any

import psycopg
import pytest
from conftest import wait_until

from worker.db.sql import queries
from worker.engine import rollup
from worker.monitor.console.data import ConsoleData
from worker.tasks.registry import Registry


def _percentile(values: list[float], q: float) -> float:
    """percentile_cont: linear interpolation between the closest ranks."""
    ordered = sorted(values)
    at = q * (len(ordered) - 1)
    low = int(at)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (at - low)


def seed(conn: psycopg.Connection, schema: str, minute: datetime) -> dict[str, Any]:
    """Tasks finished during ``minute`` (and around it), waiting, and running: what a minute of
    the rollup must say about them."""
    s = schema

    def finished(queue: str, state: str, wait: float | None, at: datetime) -> None:
        conn.execute(
            f"INSERT INTO {s}.tasks (task, queue, state, attempts, run_at, started_at,"
            " finished_at) VALUES ('t', %s, %s, 1, %s, %s, %s)",
            (
                queue,
                state,
                at - timedelta(seconds=30),
                None if wait is None else at - timedelta(seconds=30) + timedelta(seconds=wait),
                at,
            ),
        )

    inside = minute + timedelta(seconds=40)
    waits = {"emails": [0.5, 1.0, 2.0, 3.0, 10.0], "reports": [0.25, 7.5]}
    for queue, values in waits.items():
        for w in values:
            finished(queue, "done", w, inside)
    finished("emails", "failed", 4.0, inside)  # failed for good: measured too
    waits["emails"].append(4.0)
    finished("emails", "done", None, inside)  # never started (written by SQL): not measured
    finished("emails", "cancelled", 99.0, inside)  # cancelled: not measured
    finished("emails", "done", 99.0, minute + timedelta(minutes=1, seconds=1))  # the next minute
    finished("emails", "done", 99.0, minute - timedelta(seconds=1))  # the minute before
    conn.execute(
        f"INSERT INTO {s}.tasks (task, queue) SELECT 't', q FROM unnest(%s::text[]) AS q",
        (["emails", "emails", "emails", "idle"],),
    )
    conn.execute(
        f"INSERT INTO {s}.tasks (task, queue, state, attempts, started_at, lease_expires_at)"
        " SELECT 't', 'reports', 'in_progress', 1, now(), now() + interval '1 minute'"
        " FROM generate_series(1, 2)"
    )
    return waits


def test_a_minute_records_the_tables_figures(conn: psycopg.Connection, schema: str) -> None:
    minute = conn.execute("SELECT date_trunc('minute', now()) - interval '3 minutes'").fetchone()[0]  # type: ignore[index]
    waits = seed(conn, schema, minute)
    assert rollup.record_minute(conn, queries(schema), minute=minute) == minute
    rows = conn.execute(
        f"SELECT queue, queued, in_progress, waited, wait_p50, wait_p99 FROM {schema}.queue_minutes"
        " WHERE minute = %s ORDER BY queue",
        (minute,),
    ).fetchall()
    got = {r[0]: r[1:] for r in rows}
    assert set(got) == {"emails", "idle", "reports"}
    assert got["idle"] == (1, 0, 0, None, None)
    for queue, queued, running in (("emails", 3, 0), ("reports", 0, 2)):
        values = waits[queue]
        q, r, n, p50, p99 = got[queue]
        assert (q, r, n) == (queued, running, len(values)), queue
        assert p50 == pytest.approx(_percentile(values, 0.5))
        assert p99 == pytest.approx(_percentile(values, 0.99))
    total = conn.execute(
        f"SELECT queued, queued_capped, in_progress FROM {schema}.stats_minutes WHERE minute = %s",
        (minute,),
    ).fetchone()
    assert total == (4, False, 2)
    # Recorded once: a second try finds it there and changes nothing.
    assert rollup.record_minute(conn, queries(schema), minute=minute) is None
    assert conn.execute(f"SELECT count(*) FROM {schema}.queue_minutes").fetchone() == (3,)


def test_the_default_minute_is_the_last_one_over(conn: psycopg.Connection, schema: str) -> None:
    recorded = rollup.record_minute(conn, queries(schema))
    expected = conn.execute(
        "SELECT date_trunc('minute', now() - make_interval(secs => %s)) - interval '1 minute'",
        (rollup.SETTLE_SECONDS,),
    ).fetchone()[0]  # type: ignore[index]
    assert recorded is not None and abs((expected - recorded).total_seconds()) <= 60
    assert recorded.second == 0 and recorded < expected + timedelta(minutes=1)


def test_one_worker_records_a_minute_however_many_try(
    pg_dsn: str, conn: psycopg.Connection, schema: str
) -> None:
    """While one worker records a minute, another that tries waits for it, then finds it done:
    the minute's rows are written once."""
    minute = conn.execute("SELECT date_trunc('minute', now()) - interval '2 minutes'").fetchone()[0]  # type: ignore[index]
    seed(conn, schema, minute)
    q = queries(schema)
    other_result: list[Any] = []
    with (
        psycopg.connect(pg_dsn, autocommit=True) as first,
        psycopg.connect(pg_dsn, autocommit=True) as second,
    ):
        with first.transaction():
            assert rollup.record_minute(first, q, minute=minute) == minute
            other = threading.Thread(
                target=lambda: other_result.append(rollup.record_minute(second, q, minute=minute))
            )
            other.start()
            time.sleep(0.5)
            assert other.is_alive()  # waiting for the first one's transaction
        other.join(10)
    assert other_result == [None]
    counts = conn.execute(
        f"SELECT (SELECT count(*) FROM {schema}.stats_minutes),"
        f" (SELECT count(*) FROM {schema}.queue_minutes)"
    ).fetchone()
    assert counts == (1, 3)


def test_minutes_past_the_keep_are_forgotten(conn: psycopg.Connection, schema: str) -> None:
    old = conn.execute(
        "SELECT date_trunc('minute', now()) - make_interval(secs => %s) - interval '5 minutes'",
        (rollup.KEEP_SECONDS,),
    ).fetchone()[0]  # type: ignore[index]
    conn.execute(f"INSERT INTO {schema}.stats_minutes (minute) VALUES (%s)", (old,))
    conn.execute(
        f"INSERT INTO {schema}.queue_minutes (minute, queue, queued) VALUES (%s, 'q', 1)", (old,)
    )
    assert rollup.record_minute(conn, queries(schema)) is not None
    left = conn.execute(
        f"SELECT (SELECT count(*) FROM {schema}.stats_minutes WHERE minute = %s),"
        f" (SELECT count(*) FROM {schema}.queue_minutes WHERE minute = %s)",
        (old, old),
    ).fetchone()
    assert left == (0, 0)


def test_a_running_worker_records_the_last_minute(
    conn: psycopg.Connection, schema: str, thread_worker: Any
) -> None:
    """Maintenance records the minute that ended last, unasked (its first try comes at a random
    moment of the first 15 s, so that a fleet started together does not try in step)."""
    with thread_worker(Registry()):
        row = wait_until(
            lambda: conn.execute(
                f"SELECT minute, sampled_at FROM {schema}.stats_minutes"
            ).fetchone(),
            timeout=rollup.INTERVAL_SECONDS + 15,
        )
    minute, sampled_at = row
    assert minute.second == 0 and sampled_at - minute >= timedelta(minutes=1)


def test_every_replica_charts_the_same_minutes(
    pg_dsn: str, conn: psycopg.Connection, schema: str
) -> None:
    """Two servers of the console read the rollup, not anything of their own: the same depth and
    wait figures, those of the table."""
    q = queries(schema)
    for ago in (4, 3, 2):
        minute = conn.execute(
            "SELECT date_trunc('minute', now()) - make_interval(mins => %s)", (ago,)
        ).fetchone()[0]  # type: ignore[index]
        seed(conn, schema, minute)
        rollup.record_minute(conn, q, minute=minute)
    one, two = ConsoleData(pg_dsn, schema, ttl=0), ConsoleData(pg_dsn, schema, ttl=0)
    try:
        first, second = one.trends(), two.trends()
    finally:
        one.close()
        two.close()
    assert first.error is None and first == second
    stored = conn.execute(
        f"SELECT sampled_at, queued, in_progress FROM {schema}.stats_minutes ORDER BY minute"
    ).fetchall()
    assert [(d.at, d.queued, d.in_progress) for d in first.depth] == stored
    waits = conn.execute(
        f"SELECT minute, waited, wait_p50, wait_p99 FROM {schema}.queue_minutes"
        " WHERE queue = 'emails' ORDER BY minute"
    ).fetchall()
    assert [(w.minute, w.tasks, w.p50, w.p99) for w in first.waits["emails"]] == waits
    assert list(first.waits) == ["emails", "reports"]  # the busiest queue first


def _depths(conn: psycopg.Connection, schema: str, minute: datetime) -> tuple[Any, ...]:
    per_queue = conn.execute(
        f"SELECT queue, queued, in_progress FROM {schema}.queue_minutes WHERE minute = %s"
        " ORDER BY queue",
        (minute,),
    ).fetchall()
    total = conn.execute(
        f"SELECT queued, queued_capped, in_progress FROM {schema}.stats_minutes WHERE minute = %s",
        (minute,),
    ).fetchone()
    return per_queue, total


@pytest.mark.parametrize("max_queues", [100, 4])
def test_queue_depths_are_exact_however_the_rows_lie(
    pg_dsn: str, conn: psycopg.Connection, schema: str, monkeypatch: pytest.MonkeyPatch,
    max_queues: int,
) -> None:  # fmt: skip
    """Six queues of mixed priorities and due times, rows claimed from their fronts and from their
    middles while a transaction elsewhere keeps the dead entries: each queue's depth (capped), the
    running tasks and the fleet's total (capped) are what counting the table says, whether the
    skip scan finds every queue (100) or stops short of them (4)."""
    monkeypatch.setattr(rollup, "MAX_QUEUES", max_queues)
    monkeypatch.setattr(rollup, "QUEUE_CAP", 40)
    monkeypatch.setattr(rollup, "TOTAL_CAP", 150)
    s = schema
    with psycopg.connect(pg_dsn) as held:
        held.execute("SELECT txid_current()")  # holds vacuum back: the dead entries stay
        for n, queue in enumerate(["a", "b", "c", "d", "e", "f"]):
            conn.execute(
                f"INSERT INTO {s}.tasks (task, queue, priority, run_at)"
                " SELECT 't', %s, i %% 3, now() - make_interval(secs => (i * 7) %% 11)"
                " FROM generate_series(1, %s) AS i",
                (queue, 10 + 15 * n),
            )
        # Claimed: the first few of each queue in claim order, and every fifth row anywhere.
        conn.execute(
            f"UPDATE {s}.tasks SET state = 'in_progress', attempts = 1, started_at = now(),"
            " lease_expires_at = now() + interval '1 minute'"
            " WHERE id IN (SELECT id FROM (SELECT id, row_number() OVER (PARTITION BY queue"
            f"   ORDER BY -priority, run_at, id) AS k FROM {s}.tasks) AS r WHERE k <= 3)"
            " OR id % 5 = 0"
        )
        conn.execute(
            f"UPDATE {s}.tasks SET state = 'done', finished_at = now(), lease_expires_at = NULL"
            " WHERE id % 10 = 0"
        )
        minute = conn.execute(
            "SELECT date_trunc('minute', now()) - interval '2 minutes'"
        ).fetchone()[0]  # type: ignore[index]
        assert rollup.record_minute(conn, queries(s), minute=minute) == minute
        expected = conn.execute(
            f"SELECT queue, least(count(*) FILTER (WHERE state = 'queued'), 40),"
            "        count(*) FILTER (WHERE state = 'in_progress')"
            f"  FROM {s}.tasks WHERE state IN ('queued', 'in_progress') GROUP BY queue"
            " ORDER BY queue"
        ).fetchall()
        queued, running = conn.execute(
            f"SELECT count(*) FILTER (WHERE state = 'queued'),"
            f" count(*) FILTER (WHERE state = 'in_progress') FROM {s}.tasks"
        ).fetchone()  # type: ignore[misc]
    per_queue, total = _depths(conn, s, minute)
    # The busiest queues are kept when there are more than max_queues.
    busiest = sorted(expected, key=lambda r: (-(r[1] + r[2]), r[0]))[:max_queues]
    assert per_queue == sorted(busiest)
    assert queued > 150 and total == (150, True, running)


def test_the_depths_walk_the_dead_entries_once(
    pg_dsn: str, conn: psycopg.Connection, schema: str
) -> None:
    """While a long transaction holds vacuum back, every claimed row leaves a dead entry at the
    front of its queue in the claim index, by the hundred thousand in a busy hour. The rollup
    reads them once (its skip scan finds each queue's first live entry, and every count starts
    there), not once per count: it reads fewer than 1.5 entries per dead one (three counts that
    each started at the queue's start read more than 3)."""
    s = schema
    dead, live = 20_000, 300
    with psycopg.connect(pg_dsn) as held:
        held.execute("SELECT txid_current()")
        for queue in ("one", "two"):
            conn.execute(
                f"INSERT INTO {s}.tasks (task, queue) SELECT 't', %s FROM generate_series(1, %s)",
                (queue, dead // 2 + live),
            )
        conn.execute(
            f"UPDATE {s}.tasks SET state = 'done', attempts = 1, finished_at = now()"
            f" WHERE id IN (SELECT id FROM (SELECT id, row_number() OVER (PARTITION BY queue"
            f"   ORDER BY id) AS k FROM {s}.tasks) AS r WHERE k <= %s)",
            (dead // 2,),
        )
        minute = conn.execute(
            "SELECT date_trunc('minute', now()) - interval '2 minutes'"
        ).fetchone()[0]  # type: ignore[index]
        with conn.transaction():
            assert rollup.record_minute(conn, queries(s), minute=minute) == minute
            read = conn.execute(
                "SELECT pg_stat_get_xact_tuples_returned(%s::regclass)", (f"{s}.tasks_claim_idx",)
            ).fetchone()[0]  # type: ignore[index]
    per_queue, total = _depths(conn, s, minute)
    assert per_queue == [("one", live, 0), ("two", live, 0)]
    assert total == (2 * live, False, 0)
    assert dead <= read < 1.5 * dead
