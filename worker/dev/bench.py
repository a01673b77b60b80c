"""`worker bench`: enqueue and drain no-op tasks, next to the bare-SQL ceiling of the same run.

Absolute numbers depend on the machine and on whatever else it is doing, so every figure is
reported with the ceiling measured minutes apart on the same database, and as a ratio to it; the
light-load phases compare two runs of the same phase instead (an empty table against a large
one, one queue against many). Each phase starts from a freshly truncated table so earlier
phases' dead rows do not slow later ones. The ceiling is in bench_ceiling, the phases that run
the real worker in bench_phases; this module holds the flags, the order of the phases and the
report.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

import psycopg

from ..db.connect import BENCH, connect
from ..db.sql import queries
from ..tasks.enqueue import enqueue_many
from . import bench_flows, bench_soak
from .bench_ceiling import ceiling
from .bench_phases import (
    BENCH_SCHEMA,
    SQL_DIR,
    TASK,
    drain,
    latency,
    light_delayed,
    light_held,
    limited_drain,
    many_queues,
    reset,
    truncate,
)
from .bench_report import print_report

# The worker flags take what `worker run` accepts (worker/cli/main.py): a bad value fails here,
# at once, not in the middle of a run.
MAX_PROCESSES = max(64, 4 * (os.cpu_count() or 1))
MAX_ROWS = 100_000_000
# What the drain is held to: its rate against the bare-SQL ceiling of the same run, and the WAL it
# writes per task against the ceiling's.
DRAIN_TARGET = 0.8
WAL_TARGET = 1.5


def _int_in(low: int, high: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"expected {low} to {high}, got {value}")
        return value

    return parse


def _number_in(low: float, high: float) -> Callable[[str], float]:
    """A finite number from ``low`` to ``high`` (for a rate, 0 skips the phase)."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        if not (math.isfinite(value) and low <= value <= high):
            raise argparse.ArgumentTypeError(f"expected {low:g} to {high:,.0f}, got {text}")
        return value

    return parse


def add_arguments(p: argparse.ArgumentParser) -> None:
    tasks, rows, rate = _int_in(1, MAX_ROWS), _int_in(0, MAX_ROWS), _number_in(0, 1_000_000)
    p.add_argument("--tasks", type=tasks, default=100_000, help="tasks per phase (default 100000)")
    p.add_argument(
        "--batch-size", type=_int_in(1, 10_000), default=100, help="claim batch (default 100)"
    )
    p.add_argument(
        "--concurrency", type=_int_in(1, 1000), default=100, help="slots per process (default 100)"
    )
    p.add_argument(
        "--processes",
        type=_int_in(1, MAX_PROCESSES),
        default=1,
        help="worker processes, and the ceiling's connections (default 1)",
    )
    p.add_argument(
        "--rounds", type=_int_in(1, 1000), default=1, help="repeat and report the median"
    )
    p.add_argument(
        "--keep-done",
        type=_number_in(0, 10 * 365 * 86400.0),
        default=3600.0,
        help="worker's --keep-done (0 deletes rows on completion, in the ceiling too)",
    )
    p.add_argument(
        "--keep-history",
        action="store_true",
        help="worker's --keep-history (done tasks leave the task table for the history)",
    )
    p.add_argument(
        "--finished",
        type=rows,
        default=0,
        help="finished rows to put in the table before each drain (large-table test); with "
        "--keep-history, in the history, once for the whole run",
    )
    p.add_argument(
        "--latency-rate",
        type=rate,
        default=1000.0,
        help="latency phase: enqueue one task at a time at this rate to idle workers and report "
        "enqueue-to-claim percentiles (default 1000/s; 0 skips the phase)",
    )
    p.add_argument(
        "--latency-tasks",
        type=tasks,
        default=5000,
        help="tasks in the latency phase (default 5000)",
    )
    p.add_argument(
        "--light-rate",
        type=rate,
        default=20.0,
        help="light-load phases (light_delayed, many_queues): tasks per second, one per "
        "transaction (default 20; 0 skips both)",
    )
    p.add_argument(
        "--light-tasks", type=tasks, default=200, help="tasks per light-load run (default 200)"
    )
    p.add_argument(
        "--delayed-rows",
        type=tasks,
        default=500_000,
        help="light_delayed: tasks due tomorrow in the same queue (default 500000)",
    )
    p.add_argument(
        "--served-queues",
        type=_int_in(2, 10_000),
        default=200,
        help="many_queues: queues the worker serves, only the first of them busy (default 200)",
    )
    p.add_argument(
        "--held-seconds",
        type=_number_in(0, 86_400),
        default=0,
        help="light_held: seconds of light load while another session holds a transaction "
        "open, after a minute without (default 0: skip; 600 holds it for ten minutes)",
    )
    p.add_argument(
        "--held-rate",
        type=_number_in(1, 100_000),
        default=150.0,
        help="light_held: tasks per second, one per transaction (default 150)",
    )
    p.add_argument(
        "--metrics",
        action="store_true",
        help="run the worker with --metrics-port (on a free local port), to measure what "
        "counting costs",
    )
    p.add_argument(
        "--no-limit-phases",
        dest="limit_phases",
        action="store_false",
        help="skip the drains under a non-binding concurrency limit and a non-binding rate "
        "limit, reported as a ratio of the same round's unlimited drain",
    )
    p.add_argument(
        "--hold-xact",
        action="store_true",
        help="keep another session's transaction open during the drains, as a "
        "forgotten psql session would: vacuum then cannot remove dead rows",
    )
    bench_flows.add_arguments(p, whole=_int_in)
    bench_soak.add_arguments(p, whole=_int_in, number=_number_in)


def check(args: argparse.Namespace) -> None:
    """The flags that depend on each other, before any server is started."""
    bench_soak.check(args)


def _enqueue(conn: psycopg.Connection, n: int) -> float:
    start = time.perf_counter()
    enqueue_many(conn, TASK, ({"i": i} for i in range(n)), schema=BENCH_SCHEMA)
    return n / (time.perf_counter() - start)


def run(dsn: str, args: argparse.Namespace) -> dict[str, Any]:
    results: dict[str, list[float]] = {
        "enqueue": [],
        "drain": [],
        "ceiling": [],
        "ceiling_client_cpu": [],
        "rss_kb": [],
        "drain_concurrency_limit": [],
        "drain_rate_limit": [],
        "ceiling_wal": [],
        "drain_wal": [],
    }
    with connect(dsn, BENCH) as conn, connect(dsn, BENCH, autocommit=False) as holder:
        reset(conn)
        for _ in range(args.rounds):
            truncate(conn, finished=args.finished, history=args.keep_history)
            results["enqueue"].append(_enqueue(conn, args.tasks))
            if args.hold_xact:
                holder.execute("SELECT txid_current()")  # opens a transaction and keeps it
            wal = _wal(conn)
            top = ceiling(
                dsn,
                BENCH_SCHEMA,
                batch=args.batch_size,
                connections=args.processes,
                delete=args.keep_done <= 0,
            )
            results["ceiling_wal"].append((_wal(conn) - wal) / args.tasks)
            holder.rollback()
            if top.tasks < args.tasks:
                raise RuntimeError(f"the ceiling drained {top.tasks} of {args.tasks} tasks")
            results["ceiling"].append(top.per_s)
            results["ceiling_client_cpu"].append(top.client_cpu)
            truncate(conn, finished=args.finished, history=args.keep_history)
            _enqueue(conn, args.tasks)
            if args.hold_xact:
                holder.execute("SELECT txid_current()")
            wal = _wal(conn)
            drained = drain(dsn, args, args.tasks)
            results["drain_wal"].append((_wal(conn) - wal) / args.tasks)
            holder.rollback()
            results["drain"].append(drained.per_s)
            results["rss_kb"].append(drained.max_rss_kb)
            if args.limit_phases:
                for kind in ("concurrency", "rate"):
                    truncate(conn, finished=args.finished, history=args.keep_history)
                    _enqueue(conn, args.tasks)
                    limited = limited_drain(conn, dsn, args, kind)
                    results[f"drain_{kind}_limit"].append(limited.per_s)
        lat = latency(conn, dsn, args) if args.latency_rate > 0 else None
        delayed = light_delayed(conn, dsn, args) if args.light_rate > 0 else None
        queues = many_queues(conn, dsn, args) if args.light_rate > 0 else None
        held_phase = light_held(conn, dsn, args) if args.held_seconds > 0 else None
        flows = bench_flows.run(conn, dsn, args)
        server = conn.execute("SHOW server_version").fetchone()
        fsync = conn.execute("SHOW fsync").fetchone()
        sync = conn.execute("SHOW synchronous_commit").fetchone()
        conn.execute(f"DROP SCHEMA IF EXISTS {BENCH_SCHEMA} CASCADE")
    med = {k: statistics.median(v) for k, v in results.items() if v}
    return {
        "tasks": args.tasks,
        "batch_size": args.batch_size,
        "concurrency": args.concurrency,
        "processes": args.processes,
        "finished_rows": args.finished,
        "keep_history": args.keep_history,
        "held_transaction": args.hold_xact,
        "metrics": args.metrics,
        "rounds": args.rounds,
        "enqueue_per_s": round(med["enqueue"]),
        "drain_per_s": round(med["drain"]),
        "ceiling": round(med["ceiling"]),
        "ceiling_connections": args.processes,
        "ceiling_client_cpu": round(med["ceiling_client_cpu"], 2),
        # From the figures as reported, so that drain_per_s / ceiling gives it back.
        "drain_ratio": round(round(med["drain"]) / round(med["ceiling"]), 3),
        "drain_target": f"drain >= {DRAIN_TARGET} x the ceiling",
        "drain_target_met": med["drain"] / med["ceiling"] >= DRAIN_TARGET,
        # WAL written per task by each phase, from its start to its last commit (the worker's
        # start, its registration and its stop included: what a drain costs).
        "wal_per_task": {
            "ceiling_bytes": round(med["ceiling_wal"]),
            "drain_bytes": round(med["drain_wal"]),
            "ratio": round(med["drain_wal"] / med["ceiling_wal"], 2),
            "target": f"drain <= {WAL_TARGET} x the ceiling's",
            "target_met": med["drain_wal"] <= WAL_TARGET * med["ceiling_wal"],
        },
        "enqueue_ratio": round(med["enqueue"] / med["ceiling"], 3),
        "worker_max_rss_mb": round(med["rss_kb"] / 1024, 1),
        "limits": _limit_report(results) if args.limit_phases else None,
        "latency": lat and {"rate_per_s": args.latency_rate, **lat.report()},
        "light_delayed": delayed,
        "many_queues": queues,
        "light_held": held_phase,
        "workflows": flows,
        "server": server[0] if server else "?",
        "fsync": fsync[0] if fsync else "?",
        "synchronous_commit": sync[0] if sync else "?",
        "cpus": os.cpu_count(),
        "all": {
            **{
                k: [round(x, 2) if k == "ceiling_client_cpu" else round(x) for x in v]
                for k, v in results.items()
            },
            # Each round's drain next to the ceiling measured just before it: the noise to judge
            # the medians' ratio by.
            "drain_ratio": [
                round(d / c, 3) for d, c in zip(results["drain"], results["ceiling"], strict=True)
            ],
        },
    }


def _wal(conn: psycopg.Connection) -> int:
    return int(conn.execute(queries(BENCH_SCHEMA, SQL_DIR)["bench_wal_position"]).fetchone()[0])


def _limit_report(results: dict[str, list[float]]) -> dict[str, Any]:
    """The drains under non-binding limits, each as a ratio of the same round's unlimited drain
    (the median of the rounds' ratios; each round's are in "all")."""
    report: dict[str, Any] = {"target": "each drain >= 0.8 x the unlimited drain"}
    for kind in ("concurrency", "rate"):
        ratios = [
            d / u for d, u in zip(results[f"drain_{kind}_limit"], results["drain"], strict=True)
        ]
        report[kind] = {
            "drain_per_s": round(statistics.median(results[f"drain_{kind}_limit"])),
            "ratio": round(statistics.median(ratios), 3),
            "all_ratios": [round(r, 3) for r in ratios],
        }
    report["target_met"] = all(report[k]["ratio"] >= 0.8 for k in ("concurrency", "rate"))
    return report


def main(args: argparse.Namespace, dsn: str) -> int:
    """``worker bench``; the CLI resolves the DSN (flag, environment or embedded server)."""
    if args.soak:
        return bench_soak.main(args, dsn)
    r = run(dsn, args)
    if args.json:
        print(json.dumps(r, indent=2))
        return 0
    print_report(r)
    return 0
