"""The phases of `worker bench` that run the real `worker run`: the drain, and the latency phase
where idle workers wait for tasks arriving one per transaction at a steady rate, read from the
database clock on both ends."""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import psycopg

from .._enqueue import enqueue
from .._migrate import migrate
from .._sql import queries

BENCH_SCHEMA = "worker_bench"
TASK = "bench.noop"
# The latency phase measures the finished rows: it keeps them, whatever --keep-done says.
_KEEP_MEASURED = 3600.0
_START_TIMEOUT = 60.0


@dataclass(frozen=True, slots=True)
class Drain:
    per_s: float
    max_rss_kb: int


@dataclass(frozen=True, slots=True)
class Served:
    """One run of idle workers under a steady load: how long tasks waited."""

    tasks: int
    p50_ms: float
    p99_ms: float
    max_ms: float

    def report(self) -> dict[str, float | int]:
        return {
            "tasks": self.tasks,
            "p50_ms": round(self.p50_ms, 2),
            "p99_ms": round(self.p99_ms, 2),
            "max_ms": round(self.max_ms, 2),
        }


def reset(conn: psycopg.Connection) -> None:
    conn.execute(f"DROP SCHEMA IF EXISTS {BENCH_SCHEMA} CASCADE")
    migrate(conn, BENCH_SCHEMA)


def truncate(conn: psycopg.Connection, *, finished: int = 0) -> None:
    """An empty table, then ``finished`` old done rows, vacuumed and analysed, as autovacuum would
    leave a table in a steady state."""
    q = queries(BENCH_SCHEMA)
    conn.execute(f"TRUNCATE {BENCH_SCHEMA}.tasks")
    if finished:
        conn.execute(q["bench_fill_finished"], {"n": finished})
    conn.execute(f"VACUUM ANALYZE {BENCH_SCHEMA}.tasks")


def worker_command(
    dsn: str,
    args: argparse.Namespace,
    *extra: str,
    keep_done: float | None = None,
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


def drain(dsn: str, args: argparse.Namespace, n: int) -> Drain:
    """Run the real `worker run --burst` and time first claim to last acknowledgement."""
    with tempfile.NamedTemporaryFile("r", suffix=".jsonl", delete=False) as fh:
        report = fh.name
    cmd = worker_command(dsn, args, "--burst", "--report", report)
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
    return Drain(n / (last - first), rss)


def serve(
    conn: psycopg.Connection, dsn: str, args: argparse.Namespace, *, n: int, rate: float
) -> Served:
    """Idle workers, tasks arriving one per transaction at ``rate``: how long each waits.

    This is what LISTEN/NOTIFY is for; with polling alone the wait would be about half the poll
    interval. The drain phases say nothing about it, since their workers never wait.
    """
    q = queries(BENCH_SCHEMA)
    cmd = worker_command(dsn, args, keep_done=_KEEP_MEASURED)
    proc = subprocess.Popen(cmd, env={**os.environ, "WORKER_DSN": dsn})
    try:
        deadline = time.monotonic() + _START_TIMEOUT
        while conn.execute(q["bench_workers_alive"]).fetchone()[0] < args.processes:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("the benchmark's workers did not start")
            time.sleep(0.1)
        time.sleep(1.0)  # let every process reach its LISTEN
        start = time.perf_counter()
        for i in range(n):
            pause = start + i / rate - time.perf_counter()
            if pause > 0:
                time.sleep(pause)
            enqueue(conn, TASK, {"i": i}, schema=BENCH_SCHEMA)
        deadline = time.monotonic() + _START_TIMEOUT
        while conn.execute(q["bench_done"]).fetchone()[0] < n:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("the benchmark's workers did not finish the latency phase")
            time.sleep(0.05)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    n_done, p50, p99, worst = conn.execute(q["bench_latency"]).fetchone()
    return Served(n_done, float(p50), float(p99), float(worst))


def latency(conn: psycopg.Connection, dsn: str, args: argparse.Namespace) -> Served:
    """Idle workers, tasks at --latency-rate (1000/s), from an empty table."""
    truncate(conn)
    return serve(conn, dsn, args, n=args.latency_tasks, rate=args.latency_rate)
