"""Flow control (schema/0014): fleet-wide concurrency and rate limits, with real worker processes.

Each run of a handler writes its start and end to a side table by the database clock
(tests/limits_module.py); the limits are checked on those times, across processes.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import re
import statistics
import threading
import time
import uuid
from collections.abc import Iterator
from datetime import datetime, timedelta

import psutil
import psycopg
import pytest
from conftest import every_statement, run_cli, spawn_cli, wait_until
from test_metrics import fetch, scrape
from test_pool import kill_tree

import worker
from worker import store
from worker.db.migrate import migrations
from worker.db.sql import render
from worker.engine.vacuum import VacuumConfig, Vacuumer
from worker.monitor.server import serve
from worker.tasks.limits import list_limits


def _claim(conn: psycopg.Connection, schema: str, queues: list[str], want: int) -> list:
    """One claim of a fresh worker, as the worker makes it (committed when ``conn`` is in
    autocommit; left open otherwise)."""
    args = {"queues": queues, "limit": want, "worker_id": str(uuid.uuid4()), "lease_seconds": 30}
    if not conn.autocommit:
        return store.claim(conn, schema, **args)
    with conn.transaction():
        return store.claim(conn, schema, **args)


def _tables(conn: psycopg.Connection, schema: str) -> None:
    conn.execute(
        f"CREATE TABLE {schema}.runs (id bigint GENERATED ALWAYS AS IDENTITY, task_id bigint,"
        " attempt int, queue text, k text, pid int, started timestamptz, finished timestamptz)"
    )


def _slow_claims(conn: psycopg.Connection, schema: str, seconds: float) -> None:
    """A slow server, made slower where it hurts: each row a claim takes costs ``seconds`` more,
    inside the claiming transaction. Claims that counted and committed without taking turns
    would overlap for that long and together exceed the limits."""
    conn.execute(
        f"""CREATE FUNCTION {schema}.slow_claim() RETURNS trigger LANGUAGE plpgsql AS $$
            BEGIN PERFORM pg_sleep({float(seconds)}); RETURN NEW; END $$"""
    )
    conn.execute(
        f"CREATE TRIGGER slow_claim BEFORE UPDATE ON {schema}.tasks FOR EACH ROW"
        " WHEN (OLD.state = 'queued' AND NEW.state = 'in_progress')"
        f" EXECUTE FUNCTION {schema}.slow_claim()"
    )


@contextlib.contextmanager
def fleet(
    dsn: str, schema: str, *extra: str, processes: int = 4, lease: float = 10.0
) -> Iterator[object]:
    """`worker run limits_module` with ``processes`` worker processes; killed afterwards."""
    args = [
        "run", "limits_module", "--dsn", dsn, "--schema", schema, "--processes", str(processes),
        "--lease", str(lease), "--poll-interval", "0.2", "--log-level", "WARNING", *extra,
    ]  # fmt: skip
    proc = spawn_cli(*args, env={"WORKER_DSN": dsn, "WORKER_SCHEMA": schema})
    try:
        yield proc
    finally:
        kill_tree(proc)


def _max_overlap(
    conn: psycopg.Connection, schema: str, by: str, since: object = None, until: object = None
) -> dict[str, int]:
    """The most runs that overlapped in time, per ``by`` (a column of runs), by the database
    clock; only runs started within [since, until) when given. An end and a start at the same
    instant do not overlap."""
    where = (
        "WHERE started >= coalesce(%(since)s::timestamptz, '-infinity')"
        " AND started < coalesce(%(until)s::timestamptz, 'infinity')"
    )
    rows = conn.execute(
        f"""WITH r AS (SELECT * FROM {schema}.runs {where}), ev AS (
                SELECT {by} AS g, started AS t, 1 AS d FROM r
                UNION ALL
                SELECT {by}, finished, -1 FROM r)
            SELECT g, max(n)::int FROM (
                SELECT g, sum(d) OVER (PARTITION BY g ORDER BY t, d
                                       ROWS UNBOUNDED PRECEDING) AS n FROM ev) AS s
             GROUP BY g""",
        {"since": since, "until": until},
    ).fetchall()
    return {g: n for g, n in rows}


def _done(conn: psycopg.Connection, schema: str, queue: str) -> int:
    row = conn.execute(
        f"SELECT count(*) FROM {schema}.tasks WHERE queue = %s AND state = 'done'", (queue,)
    ).fetchone()
    assert row is not None
    return int(row[0])


def test_concurrency_limits_hold_across_processes_and_are_reached(
    pg_dsn: str, schema: str, conn: psycopg.Connection
) -> None:
    """Four worker processes, tasks over 50 keys, per-key limit 2 and queue limit 8 (as
    limits_module declares): at no instant do more than 2 runs of one key, or 8 of the queue,
    overlap; and both limits are reached (the fleet is not simply serialised). Each key's tasks
    are enqueued together, so in claim order the first 8 rows are of one key: the key limit binds
    at every claim. Tasks are written by a plain SQL INSERT that sets the key column. Each
    claimed row takes 5 ms more inside the claim (_slow_claims), so claims overlap. 2,000 tasks,
    40 per key, as the issue has it."""
    _tables(conn, schema)
    n = 2000
    conn.execute(
        f"INSERT INTO {schema}.tasks (task, queue, payload, limit_key)"
        " SELECT 'flow.run', 'flow', jsonb_build_object('k', 'k' || (i - 1) / 40, 'sleep', 0.05),"
        "        'k' || (i - 1) / 40"
        "   FROM generate_series(1, %s) AS i",
        (n,),
    )
    _slow_claims(conn, schema, 0.005)
    # 4 slots per process: the queue's limit of 8 is reached only by processes running at once.
    with fleet(pg_dsn, schema, "--concurrency", "4"):
        wait_until(lambda: _done(conn, schema, "flow") == n, timeout=90, interval=0.2)
    per_key = _max_overlap(conn, schema, "k")
    per_queue = _max_overlap(conn, schema, "queue")
    assert len(per_key) == 50
    assert max(per_key.values()) == 2, per_key
    assert sum(1 for v in per_key.values() if v == 2) >= 5, per_key  # reached, and not once
    assert per_queue == {"flow": 8}
    pids = conn.execute(f"SELECT count(DISTINCT pid) FROM {schema}.runs").fetchone()
    assert pids is not None and pids[0] >= 2  # several processes shared the limits


def test_rate_limit_holds_over_every_window_across_processes(
    pg_dsn: str, schema: str, conn: psycopg.Connection
) -> None:
    """A rate limit of 50 starts per second (limits_module) across four processes: no window of
    one second, wherever it starts, holds more than 50 starts (the queue's record of each start,
    tasks.started_at, by the database clock), and the fleet keeps up: at least 90% of the limit.
    Each claimed row takes 2 ms more inside the claim (_slow_claims), so claims overlap.
    550 tasks: 11 s of work at the limit, of which the first 10 s are measured."""
    _tables(conn, schema)
    n, seconds = 550, 10
    conn.execute(
        f"INSERT INTO {schema}.tasks (task, queue) SELECT 'rated.run', 'rated'"
        " FROM generate_series(1, %s)",
        (n,),
    )
    _slow_claims(conn, schema, 0.002)
    # 50 slots per process: any one claim could take a whole window's starts (the handler
    # opens no connection).
    with fleet(pg_dsn, schema, "--concurrency", "50"):
        wait_until(lambda: _done(conn, schema, "rated") == n, timeout=60, interval=0.2)
    row = conn.execute(
        f"""SELECT max(w.n),
                   (SELECT count(*) FROM {schema}.tasks
                     WHERE started_at < (SELECT min(started_at) FROM {schema}.tasks)
                                        + make_interval(secs => %s))
              FROM {schema}.tasks AS t
             CROSS JOIN LATERAL (
                SELECT count(*) AS n FROM {schema}.tasks AS o
                 WHERE o.started_at >= t.started_at
                   AND o.started_at < t.started_at + interval '1 second') AS w""",
        (seconds,),
    ).fetchone()
    assert row is not None
    busiest, early = int(row[0]), int(row[1])
    assert busiest <= 50
    assert busiest >= 45  # the limit was reached
    # Throughput over the first `seconds` seconds from the first start (the work left then is
    # less than a window's worth): at least 90% of the limit.
    assert early >= 0.9 * 50 * seconds, early
    workers = conn.execute(f"SELECT count(DISTINCT worker_id) FROM {schema}.tasks").fetchone()
    assert workers is not None and workers[0] >= 2


def _holders(conn: psycopg.Connection, schema: str, queue: str) -> dict[int, int]:
    """pid -> running rows of ``queue`` claimed under its limit, leases not expired."""
    rows = conn.execute(
        f"SELECT w.pid, count(*) FROM {schema}.tasks AS t JOIN {schema}.workers AS w"
        " ON w.id = t.worker_id WHERE t.queue = %s AND t.state = 'in_progress'"
        " AND t.limit_held AND t.lease_expires_at >= now() GROUP BY w.pid",
        (queue,),
    ).fetchall()
    return {pid: n for pid, n in rows}


def test_slots_of_a_killed_worker_return_within_about_one_and_a_half_leases(
    pg_dsn: str, schema: str, conn: psycopg.Connection
) -> None:
    """Two worker processes share a concurrency limit of 4 (set by an operator in SQL) on long
    tasks; the one holding the slots is SIGKILLed with its supervisor (so nothing hands its
    tasks back). The other process runs 4 tasks again within 1.5 leases of the kill, measured by
    the database clock, and never more than 4 ran at once."""
    _tables(conn, schema)
    lease = 2.0
    conn.execute(f"SELECT {schema}.set_queue_limit('open', concurrency => 4)")
    conn.execute(
        f"INSERT INTO {schema}.tasks (task, queue, payload) SELECT 'open.run', 'open',"
        " '{\"sleep\": 60}' FROM generate_series(1, 12)"
    )
    with (
        fleet(pg_dsn, schema, "--concurrency", "4", processes=1, lease=lease) as first,
        fleet(pg_dsn, schema, "--concurrency", "4", processes=1, lease=lease) as second,
    ):
        holders = wait_until(lambda: _holders(conn, schema, "open"), timeout=30)
        time.sleep(0.5)  # the other process's claims come back empty meanwhile
        holders = _holders(conn, schema, "open")
        assert sum(holders.values()) == 4 and len(holders) == 1, holders
        (victim,) = holders
        doomed = next(
            p for p in (first, second)
            if victim in {p.pid, *(k.pid for k in psutil.Process(p.pid).children(recursive=True))}
        )  # fmt: skip
        # The supervisor first (kill_tree), so that it cannot hand the tasks back: only the
        # lease frees the slots.
        kill_tree(doomed)  # type: ignore[arg-type]
        assert not psutil.pid_exists(victim) or psutil.Process(victim).status() == "zombie"
        killed_at = conn.execute("SELECT clock_timestamp()").fetchone()
        assert killed_at is not None
        back = wait_until(
            lambda: (
                {p: n for p, n in _holders(conn, schema, "open").items() if p != victim}
                if sum(n for p, n in _holders(conn, schema, "open").items() if p != victim) == 4
                else None
            ),
            timeout=4 * lease,
        )
        assert len(back) == 1
        row = conn.execute(
            f"SELECT extract(epoch FROM max(started_at) - %s) FROM {schema}.tasks"
            " WHERE state = 'in_progress' AND queue = 'open'",
            killed_at,
        ).fetchone()
        assert row is not None
        assert 0 < float(row[0]) <= 1.5 * lease
    # The killed process's runs ended with it; the survivor's are still running.
    conn.execute(
        f"UPDATE {schema}.runs SET finished = CASE WHEN pid = %s THEN %s ELSE now() END"
        " WHERE finished IS NULL",
        (victim, killed_at[0]),
    )
    assert _max_overlap(conn, schema, "queue") == {"open": 4}


def _latencies(conn: psycopg.Connection, schema: str, tag: str, n: int) -> list[float]:
    """Enqueue ``n`` tasks of fresh keys one by one (50 ms apart), each tagged; once all ran,
    the seconds from each one's insert to its start (database clock)."""
    for i in range(n):
        conn.execute(
            f"INSERT INTO {schema}.tasks (task, queue, payload, limit_key)"
            " VALUES ('flow.run', 'flow', jsonb_build_object('k', %s::text), %s)",
            (f"{tag}{i}", f"{tag}{i}"),
        )
        time.sleep(0.05)
    wait_until(
        lambda: (
            conn.execute(
                f"SELECT count(*) FROM {schema}.runs WHERE k LIKE %s", (tag + "%",)
            ).fetchone()
            == (n,)
        ),
        timeout=20,
    )
    rows = conn.execute(
        f"SELECT extract(epoch FROM r.started - t.created_at) FROM {schema}.runs AS r"
        f" JOIN {schema}.tasks AS t ON t.id = r.task_id WHERE r.k LIKE %s",
        (tag + "%",),
    ).fetchall()
    return [float(r[0]) for r in rows]


def test_a_key_at_its_limit_with_a_deep_backlog_does_not_delay_other_keys(
    pg_dsn: str, schema: str, conn: psycopg.Connection
) -> None:
    """The latency of tasks of other keys (insert to start) with one key at its limit and
    5,000 of its tasks queued ahead of them in claim order stays within twice their latency
    without that backlog (medians of 20; latencies under 20 ms count as 20 ms, below what this
    test can tell apart on a shared machine). A claim that read the queue in order and stopped at
    the first rows would start none of them until the backlog drained (minutes)."""
    _tables(conn, schema)
    with fleet(pg_dsn, schema, "--concurrency", "4", processes=2):
        wait_until(
            lambda: (
                conn.execute(
                    f"SELECT count(*) FROM {schema}.workers WHERE stopped_at IS NULL"
                ).fetchone()
                == (2,)
            )
        )
        before = statistics.median(_latencies(conn, schema, "calm", 20))
        conn.execute(
            f"INSERT INTO {schema}.tasks (task, queue, payload, limit_key)"
            " SELECT 'flow.run', 'flow', '{\"k\": \"hot\", \"sleep\": 30}', 'hot'"
            " FROM generate_series(1, 5000)"
        )
        wait_until(
            lambda: (
                conn.execute(f"SELECT count(*) FROM {schema}.runs WHERE k = 'hot'").fetchone()
                == (2,)
            )
        )
        during = statistics.median(_latencies(conn, schema, "busy", 20))
        hot = conn.execute(
            f"SELECT count(*) FROM {schema}.tasks WHERE limit_key = 'hot' AND state = 'in_progress'"
        ).fetchone()
    assert hot == (2,)  # the hot key stayed at its limit throughout
    assert max(during, 0.02) <= 2 * max(before, 0.02), (before, during)


def _now(dsn: str) -> object:
    with psycopg.connect(dsn, autocommit=True) as c:
        row = c.execute("SELECT clock_timestamp()").fetchone()
    assert row is not None
    return row[0]


def _cli(dsn: str, schema: str, *args: str) -> tuple[object, object]:
    """Run `worker ARGS` (an operator's command): the database clock before and after it."""
    before = _now(dsn)
    done = run_cli(*args, "--dsn", dsn, "--schema", schema)
    assert done.returncode == 0, done.stderr
    return before, _now(dsn)


def test_operators_change_limits_at_run_time_and_code_leaves_their_setting_alone(
    pg_dsn: str, schema: str, conn: psycopg.Connection
) -> None:
    """Two worker processes of 4 slots each run a steady stream of short tasks on a queue that
    has no limits. An operator limits it to 2 (`worker limits set`), raises it to 5, then clears
    it: a second after each command, at most that many run at once and that many are reached
    (8, the fleet's slots, once cleared). Meanwhile the code's declaration of queue "flow" did
    not replace the operator's setting made before the workers started, while queue "rated",
    which no operator set, holds what the code declares."""
    _tables(conn, schema)
    conn.execute(f"SELECT {schema}.set_queue_limit('flow', concurrency => 3, updated_by => 'ops')")
    conn.execute(
        f"INSERT INTO {schema}.tasks (task, queue, payload) SELECT 'open.run', 'open',"
        " '{\"sleep\": 0.3}' FROM generate_series(1, 600)"
    )
    with fleet(pg_dsn, schema, "--concurrency", "4", processes=2):
        wait_until(lambda: _max_overlap(conn, schema, "queue").get("open") == 8, timeout=20)
        marks = [_cli(pg_dsn, schema, "limits", "set", "open", "--concurrency", "2")]
        time.sleep(2.0)
        marks.append(_cli(pg_dsn, schema, "limits", "set", "open", "--concurrency", "5"))
        time.sleep(2.0)
        marks.append(_cli(pg_dsn, schema, "limits", "clear", "open"))
        # Longer: all eight slots busy at one instant with runs that all started a second or
        # more after the clear can take more than the next second on a busy machine.
        time.sleep(4.0)
        marks.append((None, None))
        rows = conn.execute(
            f"SELECT queue, concurrency, rate, source FROM {schema}.queue_limits ORDER BY 1"
        ).fetchall()
    assert rows == [("flow", 3, None, "operator"), ("rated", None, 50, "code")]
    # Each setting holds from a second after its command returned until the next one began.
    for ((_, start), (end, _)), limit in zip(itertools.pairwise(marks), (2, 5, 8), strict=True):
        since = conn.execute("SELECT %s::timestamptz + interval '1 second'", (start,)).fetchone()
        assert since is not None
        assert _max_overlap(conn, schema, "queue", since[0], end) == {"open": limit}, limit


def test_a_claim_in_flight_holds_its_permits_and_nobody_waits_for_it(
    pg_dsn: str, schema: str, conn: psycopg.Connection
) -> None:
    """Two claims of one limited queue (concurrency 8) at the same moment, on two connections:
    the first has taken 8 rows and not committed; meanwhile 8 more rows arrive at the front of
    the queue (higher priority), which the second claim's snapshot sees and the first's did not.
    The second claim neither waits for the first nor exceeds the limit: the first holds every
    permit, so it gets nothing, at once, and serves an unlimited queue in the same statement.
    Once the first commits, 8 run, not 16."""
    conn.execute(f"SELECT {schema}.set_queue_limit('q', concurrency => 8)")
    conn.execute(
        f"INSERT INTO {schema}.tasks (task, queue) SELECT 't', 'q' FROM generate_series(1, 8)"
    )
    with psycopg.connect(pg_dsn) as first, psycopg.connect(pg_dsn, autocommit=True) as second:
        assert len(_claim(first, schema, ["q"], 8)) == 8  # uncommitted
        conn.execute(
            f"INSERT INTO {schema}.tasks (task, queue, priority)"
            " SELECT 't', 'q', 10 FROM generate_series(1, 8)"
        )
        conn.execute(f"INSERT INTO {schema}.tasks (task, queue) VALUES ('plain', 'open')")
        began = time.monotonic()
        got = _claim(second, schema, ["q", "open"], 16)
        assert time.monotonic() - began < 1.0  # no wait on the first claim's locks
        assert [r.queue for r in got] == ["open"]
        first.commit()
    running = conn.execute(
        f"SELECT count(*) FROM {schema}.tasks WHERE state = 'in_progress' AND queue = 'q'"
    ).fetchone()
    assert running == (8,)


def test_limits_and_their_counts_show_in_status_the_page_and_metrics(
    pg_dsn: str, schema: str, conn: psycopg.Connection
) -> None:
    """An operator limits queue "q" to 2 running and 10 starts a minute, 2 of them at once (Python
    API); of its 3 tasks, 2 are claimed under the limit. `worker status` (text and JSON), `worker
    limits`, the
    status page and /metrics all show the limits, 2 running and 1 waiting."""
    assert worker.set_queue_limits(
        pg_dsn, "q", concurrency=2, rate="10/min", burst=2, schema=schema
    )
    conn.execute(
        f"INSERT INTO {schema}.tasks (task, queue) SELECT 't', 'q' FROM generate_series(1, 3)"
    )
    assert len(_claim(conn, schema, ["q"], 3)) == 2
    text = run_cli("status", "--dsn", pg_dsn, "--schema", schema)
    assert text.returncode == 0, text.stderr
    assert re.search(r"^q +2 +- +10/min +- +2 +1 +python$", text.stdout, re.M), text.stdout
    as_json = run_cli("limits", "--json", "--dsn", pg_dsn, "--schema", schema)
    (entry,) = json.loads(as_json.stdout)["limits"]
    assert entry["concurrency"] == 2 and entry["rate"] == {"starts": 10, "seconds": 60.0}
    assert (entry["running"], entry["waiting"], entry["recent_starts"]) == (2, 1, 2)
    server = serve("127.0.0.1", 0, dsn=pg_dsn, schema=schema, ttl=0)
    try:
        status, body = fetch(server.url)
        assert status == 200
        row = re.search(r'<tr data-limited="q">(.*?)</tr>', body)
        assert row is not None
        assert '<td data-col="running">2</td><td data-col="waiting">1</td>' in row[1]
        assert "<td>10/min</td>" in row[1]
        samples = scrape(server.url + "metrics")
    finally:
        server.stop()
    assert samples[("worker_queue_limit", (("kind", "concurrency"), ("queue", "q")))] == 2
    assert samples[("worker_queue_limit", (("kind", "rate"), ("queue", "q")))] == 10 / 60
    assert samples[("worker_queue_limited_running", (("queue", "q"),))] == 2
    assert samples[("worker_queue_limited_waiting", (("queue", "q"),))] == 1


def test_python_producers_write_the_key_the_task_declares(
    pg_dsn: str, schema: str, conn: psycopg.Connection
) -> None:
    """enqueue, enqueue_many and enqueue with an explicit key: the row carries the key the task
    declares (a payload field, or a function of the payload), or the producer's own; a task
    without a declaration gets none. Bad declarations and keys are refused."""
    reg = worker.Registry()
    by_field = reg.task("by.field", queue="flow", limit_key="customer")(lambda p: None)
    by_fn = reg.task("by.fn", queue="flow", limit_key=lambda p: f"c-{p['customer']}")(
        lambda p: None
    )
    plain = reg.task("plain", queue="flow")(lambda p: None)
    a = worker.enqueue(pg_dsn, by_field, {"customer": 7}, schema=schema)
    b = worker.enqueue(pg_dsn, by_fn, {"customer": 7}, schema=schema)
    c = worker.enqueue(pg_dsn, plain, {"customer": 7}, schema=schema)
    d = worker.enqueue(pg_dsn, plain, {}, limit_key="mine", schema=schema)
    worker.enqueue_many(pg_dsn, by_fn, [{"customer": i} for i in range(3)], schema=schema)
    keys = dict(conn.execute(f"SELECT id, limit_key FROM {schema}.tasks").fetchall())
    assert (keys[a], keys[b], keys[c], keys[d]) == ("7", "c-7", None, "mine")
    assert sorted(k for i, k in keys.items() if i not in (a, b, c, d)) == ["c-0", "c-1", "c-2"]
    with pytest.raises(ValueError, match="at most 255"):
        worker.enqueue(pg_dsn, plain, {}, limit_key="x" * 256, schema=schema)
    with pytest.raises(ValueError, match="N/PERIOD"):
        reg.limit("flow", rate="fast")
    with pytest.raises(ValueError, match="at least one limit"):
        reg.limit("flow")
    with pytest.raises(psycopg.errors.CheckViolation):
        conn.execute(f"INSERT INTO {schema}.tasks (task, limit_key) VALUES ('t', repeat('x', 256))")


def test_priority_holds_inside_a_limit(schema: str, conn: psycopg.Connection) -> None:
    """A queue limited to 2 running and 1 per key, with tasks of three keys: the claim takes
    the highest priorities that the limits allow, in priority order across keys."""
    conn.execute(f"SELECT {schema}.set_queue_limit('q', concurrency => 2, key_concurrency => 1)")
    conn.execute(
        f"INSERT INTO {schema}.tasks (task, queue, limit_key, priority) VALUES"
        " ('a-low', 'q', 'a', 1), ('a-top', 'q', 'a', 9), ('b-mid', 'q', 'b', 5),"
        " ('c-high', 'q', 'c', 7), ('none-low', 'q', NULL, 0)"
    )
    rows = _claim(conn, schema, ["q"], 10)
    assert [r.task for r in rows] == ["a-top", "c-high"]


def test_only_rows_under_a_concurrency_limit_hold_a_place_and_the_listing_counts_every_queue(
    schema: str, conn: psycopg.Connection
) -> None:
    """Rows claimed under a concurrency limit (the queue's or its keys') are marked as holding a
    place (limit_held), which the limit counts; rows of a queue limited by a rate alone are not
    (no index entry per row for a mark nothing counts), and `worker limits` still says how many
    of them run."""
    conn.execute(f"SELECT {schema}.set_queue_limit('conc', concurrency => 10)")
    conn.execute(f"SELECT {schema}.set_queue_limit('keyed', key_concurrency => 10)")
    conn.execute(f"SELECT {schema}.set_queue_limit('paced', rate => 1000, rate_seconds => 1)")
    conn.execute(
        f"INSERT INTO {schema}.tasks (task, queue, limit_key) SELECT 't', q, 'k'"
        " FROM unnest(ARRAY['conc', 'keyed', 'paced', 'open']) AS q, generate_series(1, 3)"
    )
    assert len(_claim(conn, schema, ["conc", "keyed", "paced", "open"], 20)) == 12
    marks = dict(
        conn.execute(
            f"SELECT queue, array_agg(DISTINCT limit_held) FROM {schema}.tasks GROUP BY queue"
        ).fetchall()
    )
    assert marks == {"conc": [True], "keyed": [True], "paced": [None], "open": [None]}
    running = {q.queue: q.running for q in list_limits(conn, schema)}
    assert running == {"conc": 3, "keyed": 3, "paced": 3}


def test_a_slot_frees_when_its_lease_expires_before_rescue(
    schema: str, conn: psycopg.Connection
) -> None:
    """A queue limited to 1 running, whose one running row (claimed under the limit) has a lease
    that ran out and was not rescued yet: the claim does not count it, and takes the next row.
    While the lease holds, it counts. A row without a key in a queue with per-key limits is
    claimed too."""
    conn.execute(f"SELECT {schema}.set_queue_limit('q', concurrency => 1, key_concurrency => 1)")
    conn.execute(
        f"INSERT INTO {schema}.tasks (task, queue, state, attempts, worker_id, started_at,"
        " lease_expires_at, limit_held, limit_key) VALUES ('dead', 'q', 'in_progress', 1,"
        " gen_random_uuid(), now() - interval '1 minute', now() + interval '1 minute', true, 'a')"
    )
    conn.execute(f"INSERT INTO {schema}.tasks (task, queue) VALUES ('next', 'q')")
    assert _claim(conn, schema, ["q"], 5) == []  # the lease holds: the slot is taken
    conn.execute(
        f"UPDATE {schema}.tasks SET lease_expires_at = now() - interval '1 second'"
        " WHERE task = 'dead'"
    )
    assert [r.task for r in _claim(conn, schema, ["q"], 5)] == ["next"]


# -- values out of range ---------------------------------------------------------------------------

BAD_LIMITS = [
    # (flags, what the one line says after "worker: error: ")
    (
        ["--rate", "99999999999/s"],
        "--rate must be 1 to 1000000000 starts per period, not 99999999999",
    ),
    (["--key-rate", "99999999999/min"], "--key-rate must be 1 to 1000000000 starts per period"),
    (
        ["--rate", "0/s"],
        "--rate must be 1 to 1000000000 starts per period, not 0 (to start nothing",
    ),
    (["--rate", "-1/s"], "--rate must be N/PERIOD, as 50/s, 1000/h or 10/5min, not '-1/s'"),
    (["--rate=-5/min"], "--rate must be N/PERIOD"),
    (["--rate", "5/x"], "--rate must be N/PERIOD, as 50/s, 1000/h or 10/5min, not '5/x'"),
    (["--rate", "5"], "--rate must be N/PERIOD"),
    (["--rate", "1e3/s"], "--rate must be N/PERIOD"),
    (["--rate", "5/0s"], "--rate must have a period of more than 0 s up to a year, not 0 s"),
    (["--rate", "5/400d"], "--rate must have a period of more than 0 s up to a year"),
    (
        ["--rate", "2000000/s"],
        "--rate must be at most 1000000 starts a second, not 2000000 per 1 s",
    ),
    (["--rate", "1/0.0000001s"], "--rate must be at most 1000000 starts a second"),
    (["--concurrency", "-1"], "--concurrency must be a whole number from 0 to 100000"),
    (["--concurrency", "200000"], "--concurrency must be a whole number from 0 to 100000"),
    (["--concurrency", "99999999999"], "--concurrency must be a whole number from 0 to 100000"),
    (["--concurrency", "abc"], "--concurrency must be a whole number from 0 to 100000"),
    (["--concurrency", "1.5"], "--concurrency must be a whole number from 0 to 100000 (tasks"),
    (["--key-concurrency", "100001"], "--key-concurrency must be a whole number from 0 to 100000"),
    (["--rate", "5/s", "--burst", "0"], "--burst must be a whole number from 1 to 100000"),
    (["--rate", "5/s", "--burst", "-3"], "--burst must be a whole number from 1 to 100000"),
    (["--rate", "5/s", "--burst", "100001"], "--burst must be a whole number from 1 to 100000"),
    (["--key-rate", "5/s", "--key-burst", "x"], "--key-burst must be a whole number"),
    (["--concurrency", "2", "--burst", "5"], "--burst goes with --rate"),
    (["--rate", "5/s", "--key-burst", "3"], "--key-burst goes with --key-rate"),
    ([], "give at least one of --concurrency, --key-concurrency, --rate, --key-rate"),
]


@pytest.mark.parametrize(("flags", "message"), BAD_LIMITS)
def test_limits_out_of_range_are_one_line_exit_2_and_change_nothing(
    pg_dsn: str, schema: str, conn: psycopg.Connection, flags: list[str], message: str
) -> None:
    """Checked in Python before the database sees them (a value the table's integer cannot hold
    made the database answer "function ... does not exist", exit 1)."""
    conn.execute(f"SELECT {schema}.set_queue_limit('q', concurrency => 3, rate => 10)")
    before = conn.execute(f"SELECT l::text FROM {schema}.queue_limits AS l").fetchall()
    r = run_cli("limits", "set", "q", *flags, "--dsn", pg_dsn, "--schema", schema)
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert r.stdout == "" and len(r.stderr.splitlines()) == 1, r.stderr
    assert r.stderr.startswith(f"worker: error: {message}"), r.stderr
    assert conn.execute(f"SELECT l::text FROM {schema}.queue_limits AS l").fetchall() == before


def test_limits_at_the_ends_of_their_ranges_are_taken(
    pg_dsn: str, schema: str, conn: psycopg.Connection
) -> None:
    r = run_cli(
        "limits", "set", "q", "--concurrency", "0", "--key-concurrency", "100000", "--rate",
        "1000000/s", "--burst", "100000", "--key-rate", "1/366d", "--key-burst", "1",
        "--dsn", pg_dsn, "--schema", schema,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    row = conn.execute(
        f"SELECT concurrency, key_concurrency, rate, rate_seconds, burst, key_rate,"
        f" key_rate_seconds, key_burst FROM {schema}.queue_limits"
    ).fetchone()
    assert row == (0, 100_000, 1_000_000, 1.0, 100_000, 1, 366 * 86400.0, 1)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ("rate => 99999999999", "rate must be 1 to 1000000000 starts per period, not 99999999999"),
        ("rate => 0", "rate must be 1 to 1000000000 starts per period, not 0"),
        ("key_rate => -1", "key_rate must be 1 to 1000000000 starts per period, not -1"),
        ("rate => 5, rate_seconds => 0", "rate_seconds must be more than 0 and at most 31622400"),
        ("rate => 5, rate_seconds => 'NaN'", "rate_seconds must be more than 0"),
        ("rate => 10, rate_seconds => 0.000001", "rate is at most 1000000 starts a second"),
        ("concurrency => 200000", "concurrency must be 0 to 100000 tasks running at once"),
        ("key_concurrency => -1", "key_concurrency must be 0 to 100000 tasks running at once"),
        ("concurrency => 1, burst => 3", "burst goes with rate"),
        ("concurrency => 1, key_rate_seconds => 3", "key_rate_seconds goes with key_rate"),
        ("rate => 5, burst => 0", "burst must be 1 to 100000 starts at once, not 0"),
        ("key_rate => 5, key_burst => 100001", "key_burst must be 1 to 100000 starts at once"),
        ("concurrency => 1, source => 'x'", "source is 'code' or 'operator', not x"),
        ("updated_by => 'ops'", "give at least one limit"),
    ],
)
def test_the_database_refuses_limits_out_of_range_with_a_clear_message(
    schema: str, conn: psycopg.Connection, args: str, message: str
) -> None:
    """For SQL callers, who have no Python in front of them."""
    conn.execute(f"SELECT {schema}.set_queue_limit('q', concurrency => 3)")
    before = conn.execute(f"SELECT l::text FROM {schema}.queue_limits AS l").fetchall()
    with pytest.raises(psycopg.errors.InvalidParameterValue) as info:
        conn.execute(f"SELECT {schema}.set_queue_limit('q', {args})")
    assert str(info.value).startswith(message), str(info.value)
    assert conn.execute(f"SELECT l::text FROM {schema}.queue_limits AS l").fetchall() == before


def test_the_python_api_refuses_limits_out_of_range(schema: str, conn: psycopg.Connection) -> None:
    for kwargs, message in [
        ({"rate": (0, 1.0)}, "rate must be 1 to 1000000000 starts per period, not 0"),
        ({"rate": "99999999999/s"}, "rate must be 1 to 1000000000"),
        ({"concurrency": 100_001}, "concurrency must be a whole number from 0 to 100000"),
        ({"concurrency": True}, "concurrency must be a whole number"),
        ({"key_rate": "5/s", "key_burst": 0}, "key_burst must be a whole number from 1 to"),
        ({"concurrency": 1, "burst": 2}, "burst goes with rate"),
    ]:
        with pytest.raises(ValueError, match=re.escape(message)):
            worker.set_queue_limits(conn, "q", schema=schema, **kwargs)
        with pytest.raises(ValueError, match=re.escape(message)):
            worker.limit("q", **kwargs)
    assert conn.execute(f"SELECT count(*) FROM {schema}.queue_limits").fetchone() == (0,)


def test_a_rate_of_0_set_before_is_migrated_to_what_it_meant(conn: psycopg.Connection) -> None:
    """A rate of 0 made every claim of a worker serving its queue divide by zero; migration 0019
    turns it into a concurrency of 0 (nothing starts), which claims run."""
    name = f"m_{uuid.uuid4().hex[:10]}"
    try:
        conn.execute(f"CREATE SCHEMA {name}")
        (this,) = (m for m in migrations() if m.name == "operator_checks")
        for m in migrations():
            if m.version >= this.version:
                break
            conn.execute(render(m.text, name))
        conn.execute(
            f"INSERT INTO {name}.queue_limits (queue, rate, rate_seconds, key_rate,"
            " key_rate_seconds, key_concurrency) VALUES ('a', 0, 1, NULL, NULL, 2),"
            " ('b', 5, 1, 0, 60, NULL)"
        )
        conn.execute(render(this.text, name))
        rows = conn.execute(
            f"SELECT queue, concurrency, key_concurrency, rate, key_rate"
            f" FROM {name}.queue_limits ORDER BY 1"
        ).fetchall()
        assert rows == [("a", 0, 2, None, None), ("b", None, 0, 5, None)]
    finally:
        conn.execute(f"DROP SCHEMA IF EXISTS {name} CASCADE")


class _SlowPool:
    """A worker's handler pool whose connections take ``delay`` seconds to lend (a pool with no
    free connection, a server that is coming back)."""

    def __init__(self, real: object, delay: float) -> None:
        self.real, self.delay = real, delay

    @contextlib.contextmanager
    def connection(self, *args: object, **kwargs: object) -> Iterator[psycopg.Connection]:
        time.sleep(self.delay)
        with self.real.connection(*args, **kwargs) as conn:  # type: ignore[attr-defined]
            yield conn

    def __getattr__(self, name: str) -> object:
        return getattr(self.real, name)


def test_a_transactional_handler_whose_transaction_opens_past_its_paced_start_is_given_back(
    schema: str, conn: psycopg.Connection, thread_worker: object
) -> None:
    """Regression (the composition matrix, rate+transactional:db-restart): the runner checked a
    paced task's start against its moment before lending its transactional handler a connection,
    so a handler whose connection took long (1.2 s while the server restarted) started late and
    crowded the next starts of the pace into one window (6 starts in 0.85 s under 5/s). Past its
    moment's slack, the handler must not start: the task goes back, uncounted, and runs when a
    connection comes in time."""
    conn.execute(f"SELECT {schema}.set_queue_limit('paced', rate => 5, rate_seconds => 1)")
    reg = worker.Registry()
    ran: list[int] = []

    @reg.task("paced.tx", queue="paced", transactional=True)
    def paced(payload: dict, ctx: worker.Context) -> None:
        ran.append(ctx.task_id)

    with thread_worker(reg, poll_interval=0.05, queues=["paced"]) as tw:  # type: ignore[operator]
        real = wait_until(lambda: tw.worker.pool, timeout=5)
        tw.worker.pool = _SlowPool(real, 0.3)  # past the slack (3% of 1 s) every time
        ids = [worker.enqueue(conn, "paced.tx", {}, schema=schema) for _ in range(3)]
        # Each claim gives a row its paced moment (started_at): three moments for each row
        # mean it was claimed, given back and claimed again, twice.
        moments: dict[int, set] = {i: set() for i in ids}

        def claimed_thrice() -> bool:
            for i, moment, attempts in conn.execute(
                f"SELECT id, started_at, attempts FROM {schema}.tasks"
            ).fetchall():
                assert attempts <= 1, attempts  # given back uncounted, every time
                if moment is not None:
                    moments[i].add(moment)
            return all(len(m) >= 3 for m in moments.values())

        wait_until(claimed_thrice, timeout=30)
        assert ran == []  # never started: each was given back each time
        tw.worker.pool = real  # connections come in time again: every task runs, once
        wait_until(
            lambda: (
                conn.execute(
                    f"SELECT count(*) FROM {schema}.tasks WHERE state = 'done'"
                ).fetchone()[0]
                == 3
            ),
            timeout=20,
        )
    assert sorted(ran) == ids


@pytest.mark.parametrize(
    "end",
    [
        # An acknowledgement, a retry, a rescue, an operator's cancel and a hand-written UPDATE:
        # whatever takes the attempt out of in_progress gives its slot back, at once.
        "UPDATE {s}.tasks SET state = 'done', finished_at = now(), lease_expires_at = NULL"
        " WHERE id = {id}",
        "UPDATE {s}.tasks SET state = 'queued', lease_expires_at = NULL WHERE id = {id}",
        "UPDATE {s}.tasks SET lease_expires_at = now() - interval '1 second' WHERE id = {id}",
        "DELETE FROM {s}.tasks WHERE id = {id}",
        "SELECT * FROM {s}.cancel_tasks(ARRAY[{id}]::bigint[])",
    ],
    ids=["done-by-hand", "requeued", "lease-lapsed", "deleted", "cancel-then-fail"],
)
def test_whatever_ends_an_attempt_frees_its_permit_and_nothing_else_does(
    schema: str, conn: psycopg.Connection, end: str
) -> None:
    """Concurrency 2, three queued tasks: two are claimed, the third waits (held). Ending one of
    the two attempts by any path frees exactly one slot for the next claim; a claim of an attempt
    still running never frees one (the limit is never exceeded, with 1 or 2 still running)."""
    conn.execute(f"SELECT {schema}.set_queue_limit('q', concurrency => 2)")
    conn.execute(
        f"INSERT INTO {schema}.tasks (task, queue) SELECT 't', 'q' FROM generate_series(1, 4)"
    )
    first = _claim(conn, schema, ["q"], 4)
    assert len(first) == 2
    assert _claim(conn, schema, ["q"], 4) == []  # both permits held
    ended = first[0].id
    conn.execute(end.format(s=schema, id=ended))
    if "cancel_tasks" in end:  # a running task's cancel is a request: it ends when it returns
        assert _claim(conn, schema, ["q"], 4) == []
        failure = store.Failure(ended, first[0].attempt, 0.0, "Cancelled", permanent=True)
        store.fail(conn, schema, worker_id=_claimer(conn, schema, ended), failures=[failure])
    again = _claim(conn, schema, ["q"], 4)
    assert len(again) == 1, again
    running = conn.execute(
        f"SELECT count(*) FROM {schema}.tasks WHERE state = 'in_progress'"
        " AND lease_expires_at > now()"
    ).fetchone()
    assert running == (2,)
    assert _claim(conn, schema, ["q"], 4) == []


def _claimer(conn: psycopg.Connection, schema: str, task_id: int) -> str:
    row = conn.execute(f"SELECT worker_id FROM {schema}.tasks WHERE id = %s", (task_id,)).fetchone()
    assert row is not None
    return str(row[0])


def test_permits_carry_no_index_a_claim_would_change(schema: str, conn: psycopg.Connection) -> None:
    """A claim writes the permits it takes; with no index on the columns it writes, that write is
    a heap-only update on the permit's page, so a queue's permits do not bloat with turnover and
    the claim's cost does not grow with it. Turn 2,000 permits over 20 times and check that nearly
    every update stayed heap-only and the table stayed within a few pages."""
    indexes = conn.execute(
        "SELECT indexrelid::regclass::text, pg_get_indexdef(indexrelid) FROM pg_index"
        " WHERE indrelid = %s::regclass",
        (f"{schema}.limit_permits",),
    ).fetchall()
    assert [d.split(" USING ")[1] for _, d in indexes] == ["btree (queue, limit_key, slot)"]
    conn.execute(f"SELECT {schema}.set_queue_limit('q', concurrency => 2000)")
    conn.execute(
        f"INSERT INTO {schema}.tasks (task, queue) SELECT 't', 'q' FROM generate_series(1, 40000)"
    )
    wid = str(uuid.uuid4())
    for _ in range(400):
        rows = store.claim(conn, schema, queues=["q"], limit=100, worker_id=wid, lease_seconds=30)
        store.complete(conn, schema, worker_id=wid, done=[(r.id, r.attempt) for r in rows])
    assert conn.execute(f"SELECT count(*) FROM {schema}.tasks WHERE state = 'done'").fetchone() == (
        40000,
    )
    if conn.info.server_version >= 150000:  # statistics are sent at the end of a transaction
        conn.execute("SELECT pg_stat_force_next_flush()")
    hot, updates, pages = conn.execute(
        "SELECT n_tup_hot_upd, n_tup_upd, pg_relation_size(relid) / 8192"
        " FROM pg_stat_user_tables WHERE relid = %s::regclass",
        (f"{schema}.limit_permits",),
    ).fetchone()
    assert updates >= 40000, updates
    assert hot >= 0.9 * updates, (hot, updates)
    assert pages <= 200, pages  # 2,000 permits at half-full pages: about 30 pages when fresh
    # What turnover leaves behind, the worker's vacuum service removes between autovacuum's visits.
    config = VacuumConfig(min_dead=10**9, min_dead_permits=100, min_gap_seconds=0)
    Vacuumer(every_statement(schema), schema, config).tick(conn, 10_000)
    conn.execute("SELECT pg_stat_clear_snapshot()")
    (vacuums,) = conn.execute(
        "SELECT vacuum_count FROM pg_stat_user_tables WHERE relid = %s::regclass",
        (f"{schema}.limit_permits",),
    ).fetchone()
    assert vacuums == 1


@pytest.mark.parametrize("limit", ["concurrency", "key_concurrency"])
def test_claims_racing_for_the_same_permits_never_exceed_the_limit(
    pg_dsn: str, schema: str, conn: psycopg.Connection, limit: str
) -> None:
    """Six connections claim one task at a time from a queue limited to 2 (or whose one key is),
    acknowledge it at once and claim again, until each has held 200: permits change hands 1,200
    times, often between one claim's snapshot and its lock. Each holder records, by the database
    clock, a moment after its claim committed and one before its acknowledgement; no three such
    spans ever overlap."""
    _tables(conn, schema)
    conn.execute(f"SELECT {schema}.set_queue_limit('q', {limit} => 2)")
    conn.execute(
        f"INSERT INTO {schema}.tasks (task, queue, limit_key)"
        " SELECT 't', 'q', 'k' FROM generate_series(1, 30000)"
    )
    held: list[int] = []

    def claimer() -> None:
        wid = str(uuid.uuid4())
        mine = 0
        with psycopg.connect(pg_dsn, autocommit=True) as c:
            while mine < 200:
                with c.transaction():
                    rows = store.claim(c, schema, queues=["q"], limit=1, worker_id=wid,
                                       lease_seconds=30)  # fmt: skip
                if not rows:
                    continue
                (row,) = rows
                run = c.execute(
                    f"INSERT INTO {schema}.runs (task_id, queue, started)"
                    " VALUES (%s, 'q', clock_timestamp()) RETURNING id",
                    (row.id,),
                ).fetchone()
                time.sleep(0.001)
                c.execute(
                    f"UPDATE {schema}.runs SET finished = clock_timestamp() WHERE id = %s", run
                )
                with c.transaction():
                    store.complete(c, schema, worker_id=wid, done=[(row.id, row.attempt)])
                held.append(row.id)
                mine += 1

    threads = [threading.Thread(target=claimer) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(set(held)) == 1200
    assert _max_overlap(conn, schema, "queue") == {"q": 2}


def test_a_claim_stuck_on_a_queues_pace_holds_the_others_up_20_ms_at_most(
    pg_dsn: str, schema: str, conn: psycopg.Connection
) -> None:
    """Another session holds a rate-limited queue's pace row inside an open transaction (a claim
    whose worker froze there). A claim of that queue and a plain one waits for the pace no longer
    than its 20 ms bound, not the claim connection's 2 s lock timeout: it takes the plain queue's
    row, leaves the limited queue's alone and says when to look again."""
    conn.execute(f"SELECT {schema}.set_queue_limit('paced', rate => 100, rate_seconds => 1)")
    conn.execute(f"INSERT INTO {schema}.tasks (task, queue) VALUES ('t', 'paced'), ('t', 'open')")
    with psycopg.connect(pg_dsn) as frozen, psycopg.connect(pg_dsn, autocommit=True) as other:
        frozen.execute(
            f"SELECT 1 FROM {schema}.limit_rates WHERE queue = 'paced' AND limit_key = ''"
            " FOR UPDATE"
        ).fetchone()
        waited = []
        for _ in range(5):
            began = conn.execute("SELECT clock_timestamp()").fetchone()
            with other.transaction():
                taken = store.claim_all(
                    other, schema, queues=["paced", "open"], limit=10,
                    worker_id=str(uuid.uuid4()), lease_seconds=30,
                )  # fmt: skip
            ended = conn.execute("SELECT clock_timestamp() - %s", began).fetchone()
            waited.append(ended[0].total_seconds())
            assert [r.queue for r in taken.rows] in (["open"], [])
            assert "paced" in taken.waits
        frozen.rollback()
    # The server's own clock: at most the 20 ms bound plus a claim's work, far below 2 s.
    assert statistics.median(waited) < 0.5, waited
    states = dict(conn.execute(f"SELECT queue, state::text FROM {schema}.tasks").fetchall())
    assert states == {"paced": "queued", "open": "in_progress"}


def _pace(conn: psycopg.Connection, schema: str, queue: str) -> datetime:
    row = conn.execute(
        f"SELECT tat FROM {schema}.limit_rates WHERE queue = %s AND limit_key = ''", (queue,)
    ).fetchone()
    assert row is not None
    return row[0]


def _claim_paced(
    conn: psycopg.Connection, schema: str, pace: store.Pace | None, limit: int
) -> list[store.Claimed]:
    """A claim of queue 'paced' with the starts taken ahead, in a transaction of its own unless
    the caller's is open (then in a savepoint of it)."""
    with conn.transaction():
        return store.claim_all(
            conn, schema, queues=["paced"], limit=limit, worker_id=str(uuid.uuid4()),
            lease_seconds=30, pace=pace,
        ).rows  # fmt: skip


def test_a_claim_of_starts_taken_ahead_holds_no_lock_on_the_pace(
    pg_dsn: str, schema: str, conn: psycopg.Connection
) -> None:
    """Worker A takes the starts of its next claim of a rate-limited queue ahead, claims with
    them, and stays inside that claim's transaction (frozen, or just slow to commit). Worker B
    takes its starts at once, all it asked for, after A's: it does not wait for A's commit, nor
    get the "try again in 20 ms" of a pace someone holds."""
    conn.execute(f"SELECT {schema}.set_queue_limit('paced', rate => 1000, rate_seconds => 1)")
    conn.execute(
        f"INSERT INTO {schema}.tasks (task, queue) SELECT 't', 'paced' FROM generate_series(1, 40)"
    )
    with (
        psycopg.connect(pg_dsn, autocommit=True) as a,
        psycopg.connect(pg_dsn, autocommit=True) as b,
    ):
        pace_a = store.pace_ahead(a, schema, "paced", 10)
        assert pace_a is not None and pace_a.n == 10 and pace_a.wait is None
        with a.transaction():  # A's claim stays open
            taken = _claim_paced(a, schema, pace_a, 10)
            assert len(taken) == 10
            assert all(r.start_in is not None for r in taken)
            pace_b = store.pace_ahead(b, schema, "paced", 10)
            assert pace_b is not None
            assert (pace_b.n, pace_b.wait) == (10, None)
            assert pace_b.m is not None and pace_a.end is not None
            assert pace_b.m >= pace_a.end  # after A's starts, never among them
            got = _claim_paced(b, schema, pace_b, 10)
            assert len(got) == 10
            assert not {r.id for r in got} & {r.id for r in taken}
    # Every start 1.05 ms after the one before it, A's ten then B's ten.
    starts = [
        r[0]
        for r in conn.execute(
            f"SELECT started_at FROM {schema}.tasks WHERE state = 'in_progress' ORDER BY 1"
        )
    ]
    assert len(starts) == 20
    gaps = [(later - earlier).total_seconds() for earlier, later in itertools.pairwise(starts)]
    assert min(gaps) >= 0.00105 - 1e-6, gaps


def test_starts_taken_ahead_and_not_used_go_back_unless_others_were_taken_after(
    pg_dsn: str, schema: str, conn: psycopg.Connection
) -> None:
    """Starts taken for a claim that finds fewer rows go back to the pace: the next claim's
    first start is right after the last row taken, not after the unused starts. When another
    worker took starts after them meanwhile, they stay taken (never a start too many)."""
    conn.execute(f"SELECT {schema}.set_queue_limit('paced', rate => 100, rate_seconds => 1)")
    conn.execute(f"INSERT INTO {schema}.tasks (task, queue) VALUES ('t', 'paced'), ('t', 'paced')")
    gap = timedelta(seconds=1.05 / 100)
    with (
        psycopg.connect(pg_dsn, autocommit=True) as a,
        psycopg.connect(pg_dsn, autocommit=True) as b,
    ):
        pace = store.pace_ahead(a, schema, "paced", 30)
        assert pace is not None and pace.n == 30 and pace.m is not None
        assert _pace(conn, schema, "paced") == pace.m + 30 * gap
        assert len(_claim_paced(a, schema, pace, 30)) == 2
        assert _pace(conn, schema, "paced") == pace.m + 2 * gap  # 28 starts given back

        conn.execute(f"INSERT INTO {schema}.tasks (task, queue) VALUES ('t', 'paced')")
        first = store.pace_ahead(a, schema, "paced", 30)
        second = store.pace_ahead(b, schema, "paced", 5)  # another worker, right after
        assert first is not None and second is not None and second.end is not None
        assert len(_claim_paced(a, schema, first, 30)) == 1
        assert _pace(conn, schema, "paced") == second.end  # not given back: B's came after


def test_only_a_queue_with_a_rate_alone_is_paced_ahead(
    schema: str, conn: psycopg.Connection
) -> None:
    """Queues with other limits too (a concurrency, per-key limits) are paced by the claim
    itself; a paused queue is given no starts; a queue without a rate is not paced at all."""
    conn.execute(f"SELECT {schema}.set_queue_limit('both', concurrency => 2, rate => 10)")
    conn.execute(f"SELECT {schema}.set_queue_limit('keyed', rate => 10, key_rate => 1)")
    conn.execute(f"SELECT {schema}.set_queue_limit('conc', concurrency => 2)")
    conn.execute(f"SELECT {schema}.set_queue_limit('held', rate => 10)")
    conn.execute(f"INSERT INTO {schema}.paused_queues (queue) VALUES ('held')")
    for q in ("both", "keyed", "conc", "free"):
        assert store.pace_ahead(conn, schema, q, 10) is None, q
    held = store.pace_ahead(conn, schema, "held", 10)
    assert held is not None and held.n == 0
    untouched = conn.execute(
        f"SELECT tat = '-infinity' FROM {schema}.limit_rates WHERE queue = 'held'"
    ).fetchone()
    assert untouched == (True,)  # the paused queue's pace did not move
