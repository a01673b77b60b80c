"""`worker bench` runs end to end and reports what it measured. No figure is checked against a
speed: the benchmark is how speed is measured, and this machine is shared and noisy."""

from __future__ import annotations

import json

import psycopg
import pytest
from conftest import run_cli


def test_bench_drains_measures_the_ceiling_and_the_latency(pg_dsn: str) -> None:
    r = run_cli(
        "bench",
        "--dsn",
        pg_dsn,
        "--tasks",
        "3000",
        "--processes",
        "2",
        "--concurrency",
        "20",
        "--latency-tasks",
        "300",
        "--latency-rate",
        "300",
        "--json",
        timeout=240,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    report = json.loads(r.stdout)
    assert report["tasks"] == 3000 and report["processes"] == 2
    assert report["ceiling_connections"] == 2
    for key in ("enqueue_per_s", "drain_per_s", "ceiling"):
        assert report[key] > 0, key
    assert report["drain_ratio"] == round(report["drain_per_s"] / report["ceiling"], 3)
    assert report["enqueue_ratio"] > 0
    assert report["ceiling_client_cpu"] > 0  # cores the client used: near 1, Python-bound
    lat = report["latency"]
    assert lat["tasks"] == 300  # every task of the phase ran and was measured
    assert 0 <= lat["p50_ms"] <= lat["p99_ms"] <= lat["max_ms"]
    # It cleans up after itself.
    with psycopg.connect(pg_dsn) as conn:
        left = conn.execute(
            "SELECT count(*) FROM pg_namespace WHERE nspname = 'worker_bench'"
        ).fetchone()[0]
    assert left == 0


@pytest.mark.parametrize(
    "flag",
    [
        ("--tasks", "0"),
        ("--processes", "0"),
        ("--batch-size", "-1"),
        ("--rounds", "x"),
        ("--latency-rate", "nan"),
        ("--latency-tasks", "-3"),
        ("--keep-done", "inf"),
    ],
)
def test_a_bad_flag_is_one_line_and_exit_2(flag: tuple[str, str]) -> None:
    r = run_cli("bench", "--dsn", "postgresql://nowhere.invalid/db", *flag)
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert r.stdout == "" and len(r.stderr.splitlines()) == 1, r.stderr
    assert flag[0] in r.stderr


def test_with_keep_done_0_it_still_measures_latency(pg_dsn: str) -> None:
    """The worker then deletes rows as it completes them (and the ceiling too); the latency phase
    reads the finished rows, so its workers keep them."""
    r = run_cli(
        "bench",
        "--dsn",
        pg_dsn,
        "--tasks",
        "500",
        "--concurrency",
        "10",
        "--keep-done",
        "0",
        "--latency-tasks",
        "30",
        "--latency-rate",
        "100",
        "--json",
        timeout=120,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    report = json.loads(r.stdout)
    assert report["ceiling"] > 0 and report["drain_per_s"] > 0
    assert report["latency"]["tasks"] == 30
