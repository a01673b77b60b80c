"""Cron: declaration errors, the ticker's catch-up and horizon rules, the `worker cron` command,
and a herd of worker processes enqueueing every slot of a per-second schedule exactly once."""

from __future__ import annotations

import json
import signal
import subprocess
import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import psycopg
import pytest
from conftest import run_cli, spawn_cli, wait_until

import worker
from worker import hooks as _hooks
from worker.coord import cron as _cron
from worker.coord import schedule as _schedule
from worker.errors import ConfigError


@pytest.fixture(autouse=True)
def clean_schedules() -> Iterator[None]:
    """Schedules declared by a test must not leak into the next one (the set is global)."""
    before = {s.key for s in _cron.schedules}
    yield
    for s in list(_cron.schedules):
        if s.key not in before:
            _cron.schedules.remove(s.key)


def _rows(conn: psycopg.Connection, schema: str) -> list[tuple[str, datetime, str]]:
    return conn.execute(
        f"SELECT cron_key, cron_at, state::text FROM {schema}.tasks ORDER BY cron_at"
    ).fetchall()


# -- declaring ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("expr", "tz", "message"),
    [
        ("61 * * * *", "UTC", "invalid cron expression '61 \\* \\* \\* \\*'"),
        ("every minute", "UTC", "invalid cron expression"),
        ("", "UTC", "it is empty"),
        ("0 0 31 2 *", "UTC", "invalid cron expression"),  # valid syntax, never fires
        ("* * * * *", "Mars/Olympus", "unknown time zone 'Mars/Olympus'"),
        ("* * * * *", "", "invalid time zone"),
    ],
)
def test_bad_expressions_and_zones_fail_at_declaration_in_one_line(
    expr: str, tz: str, message: str
) -> None:
    reg = worker.Registry()
    with pytest.raises(ConfigError, match=message) as info:

        @worker.cron(expr, name="bad", tz=tz, tasks=reg)
        def bad(payload: Any) -> None:
            pass

    assert "\n" not in str(info.value)
    assert len(reg) == 0 and _cron.schedules.get("bad") is None
    with pytest.raises(ConfigError, match=message):
        worker.schedule("bad", expr, tz=tz)


def test_other_bad_settings_are_one_line_errors() -> None:
    with pytest.raises(ConfigError, match="catch_up must be 'once' or 'skip'"):
        worker.schedule("x", "* * * * *", catch_up="always")
    with pytest.raises(ConfigError, match="invalid schedule name"):
        worker.schedule("", "* * * * *")
    with pytest.raises(ConfigError, match="not JSON-serialisable"):
        worker.schedule("x", "* * * * *", payload={"when": object()})
    with pytest.raises(ConfigError, match="unknown field\\(s\\) cron"):
        worker.load_schedules([{"name": "x", "cron": "* * * * *"}])
    with pytest.raises(ConfigError, match="missing field\\(s\\) expr"):
        worker.load_schedules([{"name": "x"}])
    worker.schedule("same", "0 * * * *")
    worker.schedule("same", "0 * * * *")  # the same declaration twice (module imported twice)
    with pytest.raises(ConfigError, match="declared twice with different settings"):
        worker.schedule("same", "5 * * * *")


def test_decorator_registers_the_task_and_the_schedule() -> None:
    reg = worker.Registry()

    @worker.cron(
        "*/5 * * * *",
        name="cleanup",
        queue="maintenance",
        payload={"days": 7},
        tz="Europe/Paris",
        tasks=reg,
        max_attempts=2,
    )
    def cleanup(payload: dict) -> None:
        pass

    definition = reg.get("cleanup")
    assert definition is cleanup and definition.queue == "maintenance"
    assert definition.max_attempts == 2
    s = _cron.schedules.get("cleanup")
    assert s is not None
    assert (s.task, s.queue, s.payload, s.tz, s.catch_up, s.max_attempts) == (
        "cleanup",
        "maintenance",
        {"days": 7},
        "Europe/Paris",
        "once",
        2,
    )

    # Stacked on @task: the task keeps its own name.
    @worker.cron("0 * * * *", name="hourly")
    @reg.task("stats.hourly", queue="stats")
    def hourly(payload: dict) -> None:
        pass

    s = _cron.schedules.get("hourly")
    assert s is not None and (s.task, s.queue) == ("stats.hourly", "stats")
    listed = worker.load_schedules(
        [{"name": "digest", "expr": "0 8 * * 1-5", "task": "email.digest", "tz": "UTC"}]
    )
    assert listed[0].task == "email.digest" and _cron.schedules.get("digest") is not None


def test_make_ticker_is_none_without_schedules(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_cron, "schedules", _schedule.ScheduleSet())
    assert _cron.make_ticker("worker") is None
    _cron.schedules.add(_schedule.make_schedule("s", "* * * * * *"))
    ticker = _cron.make_ticker("worker")
    assert ticker is not None and ticker.interval < 1.0  # a seconds field ticks faster
    _cron.schedules.clear()
    _cron.schedules.add(_schedule.make_schedule("m", "*/5 * * * *"))
    ticker = _cron.make_ticker("worker")
    assert ticker is not None and ticker.interval == 1.0


# -- the ticker -----------------------------------------------------------------------------------


def _daily_slot_hours_ago(hours: float) -> tuple[str, datetime]:
    """A daily expression whose latest slot was `hours` ago: far from any tick boundary."""
    slot = (datetime.now(UTC) - timedelta(hours=hours)).replace(second=0, microsecond=0)
    return f"{slot.minute} {slot.hour} * * *", slot


def _seed_last_slot(conn: psycopg.Connection, schema: str, key: str, when: datetime) -> None:
    conn.execute(
        f"INSERT INTO {schema}.cron_schedules (key, expr, task, last_slot)"
        " VALUES (%s, '* * * * *', 'x', %s)",
        (key, when),
    )


def test_missed_slot_runs_once_after_downtime_by_default(
    conn: psycopg.Connection, schema: str
) -> None:
    expr, slot = _daily_slot_hours_ago(3)
    _seed_last_slot(conn, schema, "daily", slot - timedelta(days=3))  # down for three days
    s = _schedule.make_schedule("daily", expr)
    assert s.catch_up == "once"
    ticker = _cron.Ticker(schema, [s])
    assert ticker.tick(conn) == 1
    assert ticker.tick(conn) == 0
    assert _rows(conn, schema) == [("daily", slot, "queued")]  # only the latest missed slot
    last = conn.execute(
        f"SELECT last_slot, next_slot FROM {schema}.cron_schedules WHERE key = 'daily'"
    ).fetchone()
    assert last == (slot, slot + timedelta(days=1))
    # Another process starting later finds the slot taken and enqueues nothing more.
    assert _cron.Ticker(schema, [s]).tick(conn) == 0
    assert len(_rows(conn, schema)) == 1


def test_missed_slots_are_skipped_when_asked(conn: psycopg.Connection, schema: str) -> None:
    expr, slot = _daily_slot_hours_ago(3)
    _seed_last_slot(conn, schema, "daily", slot - timedelta(days=3))
    ticker = _cron.Ticker(schema, [_schedule.make_schedule("daily", expr, catch_up="skip")])
    assert ticker.tick(conn) == 0
    assert ticker.tick(conn) == 0
    assert _rows(conn, schema) == []


def test_never_enqueues_a_slot_older_than_the_retention_horizon(
    conn: psycopg.Connection, schema: str
) -> None:
    """A slot older than the retention of finished cron rows may have been run and purged
    already: enqueueing it again would run it twice, so the ticker never offers it."""
    expr, slot = _daily_slot_hours_ago(3)
    _seed_last_slot(conn, schema, "daily", slot - timedelta(days=3))
    ticker = _cron.Ticker(schema, [_schedule.make_schedule("daily", expr)], horizon_seconds=3600)
    assert ticker.tick(conn) == 0
    assert _rows(conn, schema) == []
    # Even a clock-skewed process that offers an old slot directly gets nothing inserted.
    late = _cron.Ticker(
        schema,
        [_schedule.make_schedule("daily", expr)],
        horizon_seconds=3600,
        clock=lambda: slot + timedelta(seconds=1),
    )
    late._registered = True
    late._states[0].cursor = slot - timedelta(seconds=1)
    late._states[0].next_due = slot
    assert late.tick(conn) == 0
    assert _rows(conn, schema) == []


def test_a_purged_slot_is_not_enqueued_again_by_a_late_process(
    conn: psycopg.Connection, schema: str
) -> None:
    """Once a slot ran and its row was purged, a process that arrives late for it (stalled, or
    with a retention longer than the purge's) finds it at or before the recorded last slot."""
    ticker = _cron.Ticker(schema, [_schedule.make_schedule("fast", "* * * * * *")])
    wait_until(lambda: ticker.tick(conn), timeout=5)
    (slot,) = [r[1] for r in _rows(conn, schema)][-1:]
    conn.execute(f"DELETE FROM {schema}.tasks")  # the purge did its job
    late = _cron.Ticker(
        schema,
        [_schedule.make_schedule("fast", "* * * * * *")],
        clock=lambda: slot + timedelta(milliseconds=500),
    )
    late._registered = True
    late._states[0].cursor = slot - timedelta(seconds=1)
    late._states[0].next_due = slot
    assert late.tick(conn) == 0
    assert _rows(conn, schema) == []


def test_a_new_schedule_does_not_run_its_past_slots(conn: psycopg.Connection, schema: str) -> None:
    expr, _ = _daily_slot_hours_ago(3)
    ticker = _cron.Ticker(schema, [_schedule.make_schedule("fresh", expr)])
    assert ticker.tick(conn) == 0
    assert _rows(conn, schema) == []


def test_processes_with_skewed_clocks_enqueue_on_time_by_the_database_clock(
    conn: psycopg.Connection, schema: str
) -> None:
    """One process runs five minutes ahead, another five minutes behind: slots are still due by
    the database clock, so none is enqueued early, none is missed, none is enqueued twice."""
    ahead = _cron.Ticker(
        schema,
        [_schedule.make_schedule("fast", "* * * * * *", catch_up="skip")],
        clock=lambda: datetime.now(UTC) + timedelta(minutes=5),
    )
    behind = _cron.Ticker(
        schema,
        [_schedule.make_schedule("fast", "* * * * * *", catch_up="skip")],
        clock=lambda: datetime.now(UTC) - timedelta(minutes=5),
    )
    deadline = time.monotonic() + 3.5
    while time.monotonic() < deadline:
        ahead.tick(conn)
        behind.tick(conn)
        time.sleep(0.1)
    rows = conn.execute(
        f"SELECT cron_at, created_at FROM {schema}.tasks ORDER BY cron_at"
    ).fetchall()
    assert len(rows) >= 3
    assert all(cron_at <= created_at for cron_at, created_at in rows)  # never early
    assert all(created_at - cron_at < timedelta(seconds=1) for cron_at, created_at in rows)
    slots = [r[0] for r in rows]
    assert slots == [slots[0] + timedelta(seconds=i) for i in range(len(slots))]


def test_per_second_ticker_enqueues_each_slot_and_emits_events(
    conn: psycopg.Connection, schema: str
) -> None:
    seen: list[dict[str, Any]] = []

    def listener(event: str, **fields: Any) -> None:
        if event == "cron_enqueued":
            seen.append(fields)

    _hooks.subscribe(listener)
    try:
        tickers = [
            _cron.Ticker(schema, [_schedule.make_schedule("fast", "* * * * * *", payload={"n": 1})])
            for _ in range(3)
        ]
        won = 0
        deadline = time.monotonic() + 3.5
        while time.monotonic() < deadline:
            for t in tickers:
                won += t.tick(conn)
            time.sleep(0.1)
    finally:
        _hooks._listeners.remove(listener)
    rows = _rows(conn, schema)
    slots = [r[1] for r in rows]
    assert won == len(rows) >= 3
    assert slots == [slots[0] + timedelta(seconds=i) for i in range(len(slots))]
    assert sum(e["count"] for e in seen) == won
    assert {e["schedule"] for e in seen} == {"fast"}
    payload, run_at, cron_at = conn.execute(
        f"SELECT payload, run_at, cron_at FROM {schema}.tasks LIMIT 1"
    ).fetchone()
    assert payload == {"n": 1} and run_at == cron_at


def test_tick_survives_a_statement_error(conn: psycopg.Connection, schema: str) -> None:
    """Anything but a lost connection is logged and the worker's loop goes on."""
    ticker = _cron.Ticker(schema, [_schedule.make_schedule("fast", "* * * * * *")])
    conn.execute(f"ALTER TABLE {schema}.cron_schedules RENAME TO cron_schedules_gone")
    assert ticker.tick(conn) == 0


# -- `worker cron` --------------------------------------------------------------------------------


def test_cron_cli_lists_module_and_database_schedules(
    pg_dsn: str, conn: psycopg.Connection, schema: str
) -> None:
    r = run_cli("cron", "cron_module", "--dsn", pg_dsn, "--schema", schema)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0].split()[:3] == ["schedule", "expr", "tz"]
    nightly = next(line for line in lines if line.startswith("nightly_report"))
    assert "30 2 * * *" in nightly and "Europe/Paris" in nightly and "once" in nightly
    # Nothing ran yet; the database knows nothing: the DB-only listing is empty.
    r = run_cli("cron", "--dsn", pg_dsn, "--schema", schema)
    assert r.returncode == 0 and "no cron schedules" in r.stdout
    # After a ticker ran, the database alone can list it with its last run.
    ticker = _cron.Ticker(schema, [_schedule.make_schedule("fast", "* * * * * *", task="record")])
    wait_until(lambda: ticker.tick(conn), timeout=5)
    r = run_cli("cron", "--dsn", pg_dsn, "--schema", schema, "--json")
    assert r.returncode == 0, r.stderr
    (row,) = json.loads(r.stdout)["schedules"]
    assert row["key"] == "fast" and row["source"] == "db" and row["last_run_state"] == "queued"
    assert row["last_run_slot"] is not None
    assert datetime.fromisoformat(row["next_slot"]) > datetime.fromisoformat(row["last_run_slot"])


def test_worker_run_with_a_bad_schedule_is_one_line(
    tmp_path: Path, pg_dsn: str, schema: str
) -> None:
    mod = tmp_path / "bad_cron.py"
    mod.write_text(
        "import worker\n\n"
        "@worker.cron('*/5 * * *', name='broken')\n"
        "def broken(payload):\n"
        "    pass\n"
    )
    r = run_cli("run", str(mod), "--processes", "1", "--dsn", pg_dsn, "--schema", schema)
    assert r.returncode == 2
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "invalid cron expression '*/5 * * *'" in r.stderr
    assert "Traceback" not in r.stderr


# -- a herd of processes ---------------------------------------------------------------------------


@pytest.mark.slow
def test_herd_of_worker_processes_enqueues_every_slot_exactly_once(
    pg_dsn: str, conn: psycopg.Connection, schema: str, tmp_path: Path
) -> None:
    """Eight `worker run` processes declare the same per-second schedule for about 25 seconds
    (25 slots of accelerated time): every slot in the window is enqueued once, none is missing,
    and every run executes once."""
    conn.execute(
        f"CREATE TABLE {schema}.executions (task_id bigint, attempt int, pid int,"
        " started timestamptz, finished timestamptz)"
    )
    env = {"WORKER_DSN": pg_dsn, "WORKER_SCHEMA": schema}
    args = [
        "run",
        "cron_module",
        "--processes",
        "1",
        "--concurrency",
        "2",
        "--dsn",
        pg_dsn,
        "--schema",
        schema,
        "--keep-done",
        "86400",
        "--log-level",
        "WARNING",
    ]
    logs = [open(tmp_path / f"w{i}.log", "w") for i in range(8)]  # noqa: SIM115
    procs = [spawn_cli(*args, env=env, stderr=f) for f in logs]
    try:
        wait_until(
            lambda: conn.execute(f"SELECT count(*) FROM {schema}.workers").fetchone()[0] == 8,
            timeout=30,
        )
        time.sleep(25)
    finally:
        for p in procs:
            p.send_signal(signal.SIGTERM)
        for p in procs:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
        for f in logs:
            f.close()
    assert [p.returncode for p in procs] == [0] * 8, [
        (tmp_path / f"w{i}.log").read_text()[-2000:] for i in range(8)
    ]
    slots = [
        r[0]
        for r in conn.execute(
            f"SELECT cron_at FROM {schema}.tasks WHERE cron_key = 'every_second' ORDER BY cron_at"
        )
    ]
    assert len(slots) >= 22, slots
    assert slots == [slots[0] + timedelta(seconds=i) for i in range(len(slots))], "gap or dup"
    # Every run that finished ran once; the last one or two may have been handed back on stop.
    done, runs, distinct = conn.execute(
        f"SELECT (SELECT count(*) FROM {schema}.tasks WHERE state = 'done'),"
        f" count(*), count(DISTINCT task_id) FROM {schema}.executions"
    ).fetchone()
    assert runs == distinct == done >= len(slots) - 2
    # The load was shared: more than one process ran the schedule's tasks.
    assert conn.execute(f"SELECT count(DISTINCT pid) FROM {schema}.executions").fetchone()[0] >= 2
    last = conn.execute(
        f"SELECT last_slot FROM {schema}.cron_schedules WHERE key = 'every_second'"
    ).fetchone()[0]
    assert last == slots[-1]
    for f in logs:
        text = Path(f.name).read_text()
        assert "ERROR" not in text and "Traceback" not in text, text[-2000:]
