"""`worker bench` runs end to end and reports what it measured. No figure is checked against a
speed: the benchmark is how speed is measured, and this machine is shared and noisy. One run in a
tiny configuration serves the tests of its report; each phase starts workers, which takes
seconds, so the latency phase runs only in the --keep-done 0 run."""

from __future__ import annotations

import json
from typing import Any

import psycopg
import pytest
from conftest import run_cli

import worker
from worker.cli.main import main
from worker.db.sql import queries
from worker.dev import bench_soak
from worker.dev.bench_phases import reset, truncate

TINY = (
    "--tasks",
    "1000",
    "--processes",
    "2",
    "--concurrency",
    "20",
    "--latency-rate",
    "0",
    "--light-tasks",
    "20",
    "--light-rate",
    "40",
    "--delayed-rows",
    "2000",
    "--served-queues",
    "5",
    "--fanout",
    "300",
    "--fanout-runs",
    "2",
    "--chain",
    "40",
)


@pytest.fixture(scope="module")
def report(pg_dsn: str) -> dict[str, Any]:
    r = run_cli("bench", "--dsn", pg_dsn, *TINY, "--json", timeout=240)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout)


def _sane(run: dict[str, Any], tasks: int) -> None:
    assert run["tasks"] == tasks  # every task of the run ran and was measured
    assert 0 <= run["p50_ms"] <= run["p99_ms"] <= run["max_ms"]
    cpu = run["db_cpu_ms_per_task"]
    assert cpu is None or cpu > 0  # None only when the server is not on this machine


def test_the_drain_is_reported_as_a_ratio_to_the_ceiling(report: dict[str, Any]) -> None:
    assert report["tasks"] == 1000 and report["processes"] == 2
    assert report["ceiling_connections"] == 2
    for key in ("enqueue_per_s", "drain_per_s", "ceiling"):
        assert report[key] > 0, key
    assert report["drain_ratio"] == round(report["drain_per_s"] / report["ceiling"], 3)
    assert report["drain_ratio"] > 0 and report["enqueue_ratio"] > 0
    assert report["ceiling_client_cpu"] > 0  # cores the client used: near 1, Python-bound
    assert len(report["all"]["drain_ratio"]) == report["rounds"] == 1
    assert report["drain_target_met"] == (report["drain_per_s"] / report["ceiling"] >= 0.8)


def test_the_wal_of_the_drain_is_reported_against_the_ceilings(report: dict[str, Any]) -> None:
    """Each phase writes WAL for each task it finishes (a claim and an acknowledgement at least:
    more than 100 bytes), and the drain's is compared with the ceiling's."""
    w = report["wal_per_task"]
    assert w["ceiling_bytes"] > 100 and w["drain_bytes"] > 100, w
    assert abs(w["ratio"] - w["drain_bytes"] / w["ceiling_bytes"]) < 0.02, w  # bytes rounded
    assert w["target_met"] == (w["drain_bytes"] <= 1.5 * w["ceiling_bytes"]), w


def test_light_delayed_compares_a_backlog_of_delayed_rows_with_an_empty_table(
    report: dict[str, Any],
) -> None:
    d = report["light_delayed"]
    assert d["rate_per_s"] == 40 and d["delayed_rows"] == 2000
    _sane(d["base"], 20)
    _sane(d["backlog"], 20)
    assert d["p50_ratio"] > 0 and d["p99_ratio"] > 0
    met = d["backlog"]["p99_ms"] <= 2 * d["base"]["p99_ms"] + 5
    assert d["target_met"] is met


def test_many_queues_compares_one_busy_queue_among_many_with_it_alone(
    report: dict[str, Any],
) -> None:
    m = report["many_queues"]
    assert m["rate_per_s"] == 40 and m["served_queues"] == 5
    _sane(m["one"], 20)
    _sane(m["many"], 20)
    assert m["p50_ratio"] > 0 and m["p99_ratio"] > 0
    if m["cost_ratio"] is None:
        assert m["target_met"] is None
    else:
        assert m["cost_ratio"] > 0 and m["target_met"] is (m["cost_ratio"] <= 1.5)


def test_the_workflow_phases_report_a_fan_out_against_a_plain_drain_and_a_chain(
    report: dict[str, Any],
) -> None:
    f = report["workflows"]["fanout"]
    assert f["steps"] == 300 and f["runs"] == 2 == len(f["all_ratios"]) == len(f["join_start_ms"])
    assert f["plain_per_s"] > 0 and f["steps_per_s"] > 0 and f["ratio"] > 0
    # From the database clock, transaction times: a claim whose transaction began just before
    # the last input's acknowledgement committed reads a little below 0, never by seconds.
    assert all(-1000 < ms < 60_000 for ms in f["join_start_ms"])
    assert f["join_start_p99_ms"] == max(f["join_start_ms"])
    assert f["target_met"] is (f["ratio"] >= 0.7 and f["join_start_p99_ms"] <= 50)
    c = report["workflows"]["chain"]
    assert c["steps"] == 40 and c["processes"] == 2 and c["steps_per_s"] > 0
    assert 0 <= c["hop_p50_ms"] <= c["hop_p99_ms"] <= c["hop_max_ms"]
    assert c["ceiling_hops_per_s"] > 0
    assert c["ceiling_ratio"] == pytest.approx(c["steps_per_s"] / c["ceiling_hops_per_s"], rel=0.01)
    assert c["target_met"] is (c["steps_per_s"] >= 500)


def test_it_cleans_up_after_itself(report: dict[str, Any], pg_dsn: str) -> None:
    with psycopg.connect(pg_dsn) as conn:
        left = conn.execute(
            "SELECT count(*) FROM pg_namespace WHERE nspname = 'worker_bench'"
        ).fetchone()[0]
    assert left == 0


@pytest.mark.parametrize(
    "keep", [("--keep-done", "0"), ("--keep-history", "--finished", "3000")], ids=["0", "history"]
)
def test_the_latency_phase_even_with_keep_done_0(pg_dsn: str, keep: tuple[str, ...]) -> None:
    """With --keep-done 0 the worker deletes rows as it completes them (and the ceiling too); the
    latency phase reads the finished rows, so its workers keep them. With --keep-history the
    history still holds the drain's tasks and the old finished rows when the phase starts: it
    reads only its own."""
    r = run_cli(
        "bench",
        "--dsn",
        pg_dsn,
        "--tasks",
        "500",
        "--concurrency",
        "10",
        *keep,
        "--latency-tasks",
        "100",
        "--latency-rate",
        "200",
        "--light-rate",
        "0",
        "--fanout",
        "0",
        "--chain",
        "0",
        "--json",
        timeout=120,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    report = json.loads(r.stdout)
    assert report["ceiling"] > 0 and report["drain_per_s"] > 0
    lat = report["latency"]
    assert lat["rate_per_s"] == 200
    _sane(lat, 100)
    assert report["light_delayed"] is None and report["many_queues"] is None  # --light-rate 0
    assert report["workflows"] is None  # --fanout 0 --chain 0


@pytest.mark.parametrize(
    "flag",
    [
        ("--tasks", "0"),
        ("--processes", "0"),
        ("--batch-size", "-1"),
        ("--rounds", "x"),
        ("--keep-done", "inf"),
        ("--latency-rate", "nan"),
        ("--light-rate", "-5"),
        ("--light-tasks", "0"),
        ("--delayed-rows", "0"),
        ("--served-queues", "1"),
        ("--fanout", "-1"),
        ("--fanout-runs", "0"),
        ("--chain-processes", "0"),
    ],
)
def test_a_bad_flag_is_one_line_and_exit_2(
    flag: tuple[str, str], capsys: pytest.CaptureFixture[str]
) -> None:
    code = main(["bench", "--dsn", "postgresql://nowhere.invalid/db", *flag])
    out, err = capsys.readouterr()
    assert code == 2
    assert out == "" and len(err.splitlines()) == 1, err
    assert flag[0] in err


def test_a_bad_flag_through_the_command() -> None:
    r = run_cli("bench", "--dsn", "postgresql://nowhere.invalid/db", "--light-rate", "-1")
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert r.stdout == "" and len(r.stderr.splitlines()) == 1, r.stderr


def test_the_limited_drains_are_reported_as_ratios_of_the_unlimited_drain(
    report: dict[str, Any],
) -> None:
    """The drains under a non-binding concurrency limit and rate limit (schema/0014)."""
    lim = report["limits"]
    for kind in ("concurrency", "rate"):
        d = lim[kind]
        assert d["drain_per_s"] > 0
        assert len(d["all_ratios"]) == report["rounds"]
        # (the rates are rounded to whole tasks per second, the ratio is not)
        assert d["ratio"] == pytest.approx(d["drain_per_s"] / report["drain_per_s"], abs=0.002)
        assert d["all_ratios"] == [d["ratio"]]
    met = lim["concurrency"]["ratio"] >= 0.8 and lim["rate"]["ratio"] >= 0.8
    assert lim["target_met"] is met


# -- the soak -------------------------------------------------------------------------------------

SOAK = (
    "--soak",
    "3",
    "--soak-minute-seconds",
    "5",
    "--soak-hold",
    "1",
    "--soak-share",
    "0.02",
    "--tasks",
    "1000",
    "--concurrency",
    "20",
)
MINUTE_FIELDS = {
    "minute",
    "tasks",
    "held",
    "sampled",
    "unclaimed",
    "p50_ms",
    "p99_ms",
    "max_ms",
    "backlog",
    "heap_mb",
    "index_mb",
    "history_mb",
    "history_bytes",
    "total_mb",
    "total_bytes",
    "dead_rows",
    "live_rows",
    "autovacuum_runs",
    "autovacuum_seconds",
    "vacuum_runs",
    "vacuum_seconds",
    "autoanalyze_runs",
    "wal_bytes_per_task",
    "db_cpu_ms_per_task",
}


def _latency_sane(r: dict[str, Any]) -> None:
    assert r["sampled"] > 0
    assert 0 <= r["p50_ms"] <= r["p99_ms"] <= r["max_ms"]


def test_a_short_soak_reports_each_minute_and_its_verdicts(pg_dsn: str) -> None:
    """Three 'minutes' of five seconds at 2% of the drain measured first, the middle one under a
    held transaction: every figure of every minute is there and plausible, and each verdict
    follows from the figures it compares (no figure is checked against a speed)."""
    r = run_cli("bench", "--dsn", pg_dsn, *SOAK, "--json", timeout=240)
    assert r.returncode == 0, r.stderr[-3000:]
    s = json.loads(r.stdout)["soak"]
    assert s["minutes_run"] == 3 and s["minute_seconds"] == 5
    assert s["drain_per_s"] > 0 and s["share"] == 0.02
    assert s["rate_per_s"] == pytest.approx(0.02 * s["drain_per_s"], rel=0.01, abs=0.1)
    assert s["keep_done"] == 3600  # the worker's default retention
    assert s["keep_history"] is False
    assert s["settings"]["autovacuum"] in ("on", "off")
    assert "autovacuum_vacuum_threshold" in s["settings"]["table_options"]
    minutes = s["minutes"]
    assert [m["minute"] for m in minutes] == [1, 2, 3]
    assert [m["held"] for m in minutes] == [False, True, False]
    for m in minutes:
        assert set(m) == MINUTE_FIELDS, m
        assert m["tasks"] > 0
        # At this rate every task of the minute is read (by id); the last ones may still wait
        # for their claim when the minute ends (counted as waiting until then).
        assert m["sampled"] == m["tasks"]
        assert 0 <= m["unclaimed"] <= m["sampled"] and m["backlog"] >= 0
        _latency_sane(m)
        assert m["total_bytes"] > 0 and m["heap_mb"] >= 0 and m["index_mb"] > 0
        assert m["dead_rows"] >= 0 and m["live_rows"] >= 0
        for key in ("autovacuum_runs", "vacuum_runs", "autoanalyze_runs"):
            assert m[key] >= 0
        assert m["autovacuum_seconds"] >= 0 and m["vacuum_seconds"] >= 0
        # A task's row is written several times (insert, claim, finish): hundreds of bytes.
        assert 100 < m["wal_bytes_per_task"] < 1_000_000
        cpu = m["db_cpu_ms_per_task"]
        assert cpu is None or cpu > 0  # None only when the server is not on this machine
    # Without --keep-history nothing reaches the history (its empty partitions' indexes).
    assert len({m["history_mb"] for m in minutes}) == 1 and minutes[0]["history_mb"] < 1
    # Nothing is purged within the hour kept: the table only grows.
    sizes = [m["total_bytes"] for m in minutes]
    assert sizes == sorted(sizes)
    (block,) = s["blocks"]
    assert block["minutes"] == "1-3" and block["tasks"] == sum(m["tasks"] for m in minutes)
    _latency_sane(block)

    v = s["verdict"]
    assert v["window_minutes"] == 1  # a three-minute soak compares its first and last minute
    assert v["first"]["p99_ms"] == minutes[0]["p99_ms"]
    assert v["last"]["p99_ms"] == minutes[-1]["p99_ms"]
    assert v["p99_ratio"] == round(v["last"]["p99_ms"] / v["first"]["p99_ms"], 2)
    assert v["p99_met"] is (v["p99_ratio"] <= 1.5)
    assert v["size_ratio"] == round(sizes[-1] / sizes[0], 2)
    assert v["size_met"] is (v["size_ratio"] <= 2)

    h = s["hold"]
    assert (h["minutes"], h["from_minute"], h["to_minute"]) == (1, 2, 2)
    assert h["held"]["p99_ms"] == minutes[1]["p99_ms"]
    assert h["before"]["p99_ms"] == minutes[0]["p99_ms"]
    assert h["p99_ratio"] == round(h["held"]["p99_ms"] / h["before"]["p99_ms"], 2)
    assert h["target_met"] is (h["p99_ratio"] <= 2)

    # With --json the minutes go to stderr as they end: a header and one line each.
    lines = [x for x in r.stderr.splitlines() if x.startswith("  ")]
    assert "p99 ms" in lines[0] and len(lines) == 4, r.stderr
    assert lines[2].endswith("held")
    with psycopg.connect(pg_dsn) as conn:
        left = conn.execute(
            "SELECT count(*) FROM pg_namespace WHERE nspname = 'worker_bench'"
        ).fetchone()[0]
    assert left == 0


def test_a_soak_with_the_history_keeps_done_tasks_out_of_the_task_table(pg_dsn: str) -> None:
    """With --keep-history the worker moves each done task to the history as it acknowledges
    it: every minute's tasks are still read (through task_rows), the history grows with them,
    and the task table keeps only what is live (a few rows), however many tasks ran."""
    flags = ("--soak", "2", "--soak-minute-seconds", "4", "--soak-share", "0.02")
    r = run_cli(
        "bench", "--dsn", pg_dsn, *flags, "--tasks", "1000", "--concurrency", "20",
        "--keep-history", "--json", timeout=240,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    s = json.loads(r.stdout)["soak"]
    assert s["keep_history"] is True
    minutes = s["minutes"]
    assert len(minutes) == 2
    for m in minutes:
        assert m["tasks"] > 0 and m["sampled"] == m["tasks"]
        _latency_sane(m)
    # In bytes: a slow machine's minute may add less than the 0.1 MB the table rounds to.
    assert minutes[0]["history_bytes"] < minutes[1]["history_bytes"], minutes
    ran = sum(m["tasks"] for m in minutes)
    assert minutes[-1]["live_rows"] < ran / 2, (minutes[-1]["live_rows"], ran)


def test_finished_rows_go_to_the_history_once_with_keep_history(pg_dsn: str) -> None:
    """`--finished N --keep-history`: the N old rows are where that worker keeps them, in the
    history, written once for the run (every phase empties the task table, never the history);
    without --keep-history they are in the task table, written again for each phase."""
    count = (
        "SELECT (SELECT count(*) FROM worker_bench.tasks WHERE task = 'bench.old'),"
        " (SELECT count(*) FROM worker_bench.task_history"
        "   WHERE task = 'bench.old' AND state = 'done')"
    )
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        reset(conn)
        try:
            truncate(conn, finished=1500, history=True)
            assert conn.execute(count).fetchone() == (0, 1500)
            truncate(conn, finished=1500, history=True)  # the next phase
            assert conn.execute(count).fetchone() == (0, 1500)
            truncate(conn, finished=700)
            truncate(conn, finished=700)
            assert conn.execute(count).fetchone() == (700, 1500)
            # Readers by id find them, as any task finished into the history.
            n = conn.execute(
                "SELECT count(*) FROM worker_bench.task_rows WHERE task = 'bench.old'"
            ).fetchone()[0]
            assert n == 2200
        finally:
            conn.execute("DROP SCHEMA IF EXISTS worker_bench CASCADE")


@pytest.mark.parametrize(
    "flags",
    [
        ("--soak-hold", "5"),  # without --soak
        ("--soak", "3", "--soak-hold", "2"),  # no two minutes before the hold
        ("--soak", "3", "--keep-done", "60"),  # the minutes' rows gone before they are read
        ("--soak", "3", "--soak-rate", "10", "--soak-share", "0.5"),
        ("--soak", "3", "--soak-share", "0"),
        ("--soak", "-1"),
        ("--soak", "3", "--soak-minute-seconds", "0.5"),
    ],
)
def test_bad_soak_flags_are_one_line_and_exit_2(flags: tuple[str, ...]) -> None:
    r = run_cli("bench", "--dsn", "postgresql://nowhere.invalid/db", *flags)
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert r.stdout == "" and len(r.stderr.splitlines()) == 1, r.stderr


def test_the_soaks_backlog_count_is_the_number_of_tasks_waiting(
    conn: psycopg.Connection, schema: str
) -> None:
    """The soak counts its backlog among the newest ids (the worker claims oldest first), up to
    a cap: the count is the number of queued tasks, and the cap once more than the cap wait."""
    q = queries(schema, bench_soak.SQL_DIR)
    worker.enqueue_many(conn, "t", ({"n": i} for i in range(50)), schema=schema)
    ids = [r[0] for r in conn.execute(f"SELECT id FROM {schema}.tasks ORDER BY id").fetchall()]
    conn.execute(
        f"UPDATE {schema}.tasks SET state = 'in_progress', attempts = 1, started_at = now(),"
        " lease_expires_at = now() + interval '1 minute' WHERE id <= %s",
        (ids[29],),
    )
    hi = ids[-1]
    for cap, waiting in ((100, 20), (20, 20), (12, 12)):
        (n,) = conn.execute(q["soak_backlog"], {"after": max(hi - cap, 0)}).fetchone()
        assert n == waiting, (cap, n)
