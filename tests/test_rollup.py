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
