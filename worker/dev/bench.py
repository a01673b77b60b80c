"""`worker bench`: enqueue and drain no-op tasks, next to the bare-SQL ceiling of the same run.

Absolute numbers depend on the machine and on whatever else it is doing, so every figure is
reported with the ceiling measured minutes apart on the same database, and as a ratio to it.
Each phase starts from an empty, freshly truncated table so earlier phases' dead rows do not
slow later ones.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psycopg

from .._enqueue import enqueue, enqueue_many
from .._migrate import migrate
from .._sql import queries
from .bench_ceiling import ceiling

BENCH_SCHEMA = "worker_bench"
TASK = "bench.noop"
_KEEP_MEASURED = 3600.0

# The worker flags take what `worker run` accepts (worker/cli/main.py): a bad value fails here,
# at once, not in the middle of a run.
MAX_PROCESSES = max(64, 4 * (os.cpu_count() or 1))
MAX_ROWS = 100_000_000


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
        "--finished",
        type=rows,
        default=0,
        help="finished rows to put in the table before each drain (large-table test)",
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
        "--metrics",
        action="store_true",
        help="run the worker with --metrics-port (on a free local port), to measure what "
        "counting costs",
    )
    p.add_argument(
        "--hold-xact",
        action="store_true",
        help="keep another session's transaction open during the drains, as a "
        "forgotten psql session would: vacuum then cannot remove dead rows",
    )


def _reset(conn: psycopg.Connection) -> None:
    conn.execute(f"DROP SCHEMA IF EXISTS {BENCH_SCHEMA} CASCADE")
    migrate(conn, BENCH_SCHEMA)


def _truncate(conn: psycopg.Connection, finished: int) -> None:
    conn.execute(f"TRUNCATE {BENCH_SCHEMA}.tasks")
    if finished:
        conn.execute(queries(BENCH_SCHEMA)["bench_fill_finished"], {"n": finished})
    conn.execute(f"VACUUM ANALYZE {BENCH_SCHEMA}.tasks")


def _enqueue(conn: psycopg.Connection, n: int) -> float:
    start = time.perf_counter()
    enqueue_many(conn, TASK, ({"i": i} for i in range(n)), schema=BENCH_SCHEMA)
    return n / (time.perf_counter() - start)


def _worker_command(
    dsn: str, args: argparse.Namespace, *extra: str, keep_done: float | None = None
) -> list[str]:
    """The real `worker run` over the bench schema, with the benchmark's settings."""
    cmd = [
        sys.executable,
        "-m",
        "worker",
        "run",
        "worker.dev.bench_tasks",
        "--dsn",
        dsn,
        "--schema",
        BENCH_SCHEMA,
        "--processes",
        str(args.processes),
        "--concurrency",
        str(args.concurrency),
        "--batch-size",
        str(args.batch_size),
        "--keep-done",
        str(args.keep_done if keep_done is None else keep_done),
        "--log-level",
        "WARNING",
        *extra,
    ]
    if args.metrics:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            cmd += ["--metrics-port", str(s.getsockname()[1])]
    return cmd


def _drain(dsn: str, args: argparse.Namespace, n: int) -> tuple[float, int]:
    """Run the real `worker run --burst` and time first claim to last acknowledgement."""
    with tempfile.NamedTemporaryFile("r", suffix=".jsonl", delete=False) as fh:
        report = fh.name
    cmd = _worker_command(dsn, args, "--burst", "--report", report)
    try:
        subprocess.run(cmd, check=True, env={**os.environ, "WORKER_DSN": dsn})
        lines = [json.loads(x) for x in Path(report).read_text().splitlines() if x.strip()]
    finally:
        os.unlink(report)
    done = sum(r["done"] for r in lines)
    if done < n:
        raise RuntimeError(f"worker drained {done} of {n} tasks")
    first = min(r["first_claim"] for r in lines if r["first_claim"])
    last = max(r["last_ack"] for r in lines if r["last_ack"])
    rss = max(r["max_rss_kb"] for r in lines)
    return n / (last - first), rss


def _latency(conn: psycopg.Connection, dsn: str, args: argparse.Namespace) -> dict[str, float]:
    """Idle workers, tasks arriving one per transaction at a steady rate: how long each waits.

    This is what LISTEN/NOTIFY is for; with polling alone the wait would be about half the poll
    interval. The drain phases say nothing about it, since their workers never wait.
    """
    q = queries(BENCH_SCHEMA)
    _truncate(conn, 0)
    env = {**os.environ, "WORKER_DSN": dsn}
    # The phase measures the finished rows: keep them, whatever --keep-done says.
    proc = subprocess.Popen(_worker_command(dsn, args, keep_done=_KEEP_MEASURED), env=env)
    try:
        deadline = time.monotonic() + 60
        while conn.execute(q["bench_workers_alive"]).fetchone()[0] < args.processes:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("the benchmark's workers did not start")
            time.sleep(0.1)
        time.sleep(1.0)  # let every process reach its LISTEN
        n, rate = args.latency_tasks, args.latency_rate
        start = time.perf_counter()
        for i in range(n):
            pause = start + i / rate - time.perf_counter()
            if pause > 0:
                time.sleep(pause)
            enqueue(conn, TASK, {"i": i}, schema=BENCH_SCHEMA)
        while conn.execute(q["bench_done"]).fetchone()[0] < n:
            if proc.poll() is not None or time.monotonic() > deadline + n / rate + 60:
                raise RuntimeError("the benchmark's workers did not finish the latency phase")
            time.sleep(0.05)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    row = conn.execute(q["bench_latency"]).fetchone()
    n_done, p50, p99, worst = row
    return {"tasks": n_done, "p50_ms": float(p50), "p99_ms": float(p99), "max_ms": float(worst)}


def run(dsn: str, args: argparse.Namespace) -> dict[str, Any]:
    results: dict[str, list[float]] = {
        "enqueue": [],
        "drain": [],
        "ceiling": [],
        "ceiling_client_cpu": [],
        "rss_kb": [],
    }
    with psycopg.connect(dsn, autocommit=True) as conn, psycopg.connect(dsn) as holder:
        _reset(conn)
        for _ in range(args.rounds):
            _truncate(conn, args.finished)
            results["enqueue"].append(_enqueue(conn, args.tasks))
            if args.hold_xact:
                holder.execute("SELECT txid_current()")  # opens a transaction and keeps it
            top = ceiling(
                dsn,
                BENCH_SCHEMA,
                batch=args.batch_size,
                connections=args.processes,
                delete=args.keep_done <= 0,
            )
            holder.rollback()
            if top.tasks < args.tasks:
                raise RuntimeError(f"the ceiling drained {top.tasks} of {args.tasks} tasks")
            results["ceiling"].append(top.per_s)
            results["ceiling_client_cpu"].append(top.client_cpu)
            _truncate(conn, args.finished)
            _enqueue(conn, args.tasks)
            if args.hold_xact:
                holder.execute("SELECT txid_current()")
            rate, rss = _drain(dsn, args, args.tasks)
            holder.rollback()
            results["drain"].append(rate)
            results["rss_kb"].append(rss)
        latency = _latency(conn, dsn, args) if args.latency_rate > 0 else None
        server = conn.execute("SHOW server_version").fetchone()
        fsync = conn.execute("SHOW fsync").fetchone()
        sync = conn.execute("SHOW synchronous_commit").fetchone()
        conn.execute(f"DROP SCHEMA IF EXISTS {BENCH_SCHEMA} CASCADE")
    med = {k: statistics.median(v) for k, v in results.items()}
    return {
        "tasks": args.tasks,
        "batch_size": args.batch_size,
        "concurrency": args.concurrency,
        "processes": args.processes,
        "finished_rows": args.finished,
        "held_transaction": args.hold_xact,
        "metrics": args.metrics,
        "rounds": args.rounds,
        "enqueue_per_s": round(med["enqueue"]),
        "drain_per_s": round(med["drain"]),
        "ceiling": round(med["ceiling"]),
        "ceiling_connections": args.processes,
        "ceiling_client_cpu": round(med["ceiling_client_cpu"], 2),
        "drain_ratio": round(med["drain"] / med["ceiling"], 3),
        "enqueue_ratio": round(med["enqueue"] / med["ceiling"], 3),
        "worker_max_rss_mb": round(med["rss_kb"] / 1024, 1),
        "latency": latency
        and {
            "rate_per_s": args.latency_rate,
            **{k: round(v, 2) for k, v in latency.items()},
        },
        "server": server[0] if server else "?",
        "fsync": fsync[0] if fsync else "?",
        "synchronous_commit": sync[0] if sync else "?",
        "cpus": os.cpu_count(),
        "all": {
            k: [round(x, 2) if k == "ceiling_client_cpu" else round(x) for x in v]
            for k, v in results.items()
        },
    }


def main(args: argparse.Namespace, dsn: str) -> int:
    """``worker bench``; the CLI resolves the DSN (flag, environment or embedded server)."""
    r = run(dsn, args)
    if args.json:
        print(json.dumps(r, indent=2))
        return 0
    print(
        f"worker bench: {r['tasks']} no-op tasks, batch {r['batch_size']}, "
        f"{r['processes']} process(es) x {r['concurrency']} slots, {r['cpus']} CPUs, "
        f"PostgreSQL {r['server']} (fsync={r['fsync']}, synchronous_commit="
        f"{r['synchronous_commit']})"
    )
    if r["finished_rows"] or r["held_transaction"]:
        held = ", another session holding a transaction open" if r["held_transaction"] else ""
        print(f"  with {r['finished_rows']:,} finished rows in the table{held}")
    if r["metrics"]:
        print("  with metrics on (counting, and the journal under a supervisor)")
    conns = f"{r['ceiling_connections']} connection(s)"
    print(f"  ceiling (bare SQL)      {r['ceiling']:>9,} tasks/s   {conns}, ack+claim per commit")
    for label, rate, ratio in (
        ("enqueue_many (COPY)", r["enqueue_per_s"], r["enqueue_ratio"]),
        ("drain (worker)", r["drain_per_s"], r["drain_ratio"]),
    ):
        print(f"  {label:<22}  {rate:>9,} tasks/s   {ratio:.0%} of the ceiling")
    print(f"  worker peak RSS         {r['worker_max_rss_mb']:>9} MB per process")
    if r["latency"]:
        lat = r["latency"]
        print(
            f"  latency, enqueue to claim ({lat['rate_per_s']:,.0f} tasks/s, one per commit): "
            f"p50 {lat['p50_ms']:.1f} ms, p99 {lat['p99_ms']:.1f} ms, max {lat['max_ms']:.1f} ms"
        )
    return 0
