"""The phases of `worker bench` that run the real `worker run`: the drain, and the light-load
phases where idle workers wait for tasks arriving one per transaction at a steady rate.

The light-load phases read enqueue-to-claim latency from the database clock on both ends, and,
when the server runs on this machine, the CPU time its processes serving the worker's claim
connections spent meanwhile (from /proc): the database's cost of serving the load, per task.
"""

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
from typing import Any

import psycopg

from ..db.connect import BENCH, connect
from ..db.migrate import migrate
from ..db.sql import queries
from ..tasks.enqueue import enqueue
from ..tasks.limits import MAX_CONCURRENCY, MAX_PER_SECOND, Limits, clear_limits, set_limits

# The statements of this room lie beside its modules (the core never loads them).
SQL_DIR = Path(__file__).resolve().parent

BENCH_SCHEMA = "worker_bench"
_SCHEMA = {"schema": BENCH_SCHEMA}  # the bound schema name, for statements that read the catalog
TASK = "bench.noop"
DEFAULT_QUEUE = "default"
# The light-load phases need the finished rows to measure them, whatever --keep-done says.
_KEEP_MEASURED = 3600.0
_START_TIMEOUT = 60.0


@dataclass(frozen=True, slots=True)
class Drain:
    per_s: float
    max_rss_kb: int


@dataclass(frozen=True, slots=True)
class Served:
    """One light-load run: how long tasks waited, and what the server spent on the claims."""

    tasks: int
    p50_ms: float
    p99_ms: float
    max_ms: float
    db_cpu_ms_per_task: float | None  # None: the server is not on this machine

    def report(self) -> dict[str, float | int | None]:
        return {
            "tasks": self.tasks,
            "p50_ms": round(self.p50_ms, 2),
            "p99_ms": round(self.p99_ms, 2),
            "max_ms": round(self.max_ms, 2),
            "db_cpu_ms_per_task": None
            if self.db_cpu_ms_per_task is None
            else round(self.db_cpu_ms_per_task, 3),
        }


def reset(conn: psycopg.Connection) -> None:
    conn.execute(f"DROP SCHEMA IF EXISTS {BENCH_SCHEMA} CASCADE")
    migrate(conn, BENCH_SCHEMA)


def truncate(
    conn: psycopg.Connection, *, finished: int = 0, delayed: int = 0, history: bool = False
) -> None:
    """An empty table, then ``finished`` old done rows and ``delayed`` rows due tomorrow in the
    default queue, vacuumed and analysed, as autovacuum would leave a table in a steady state.
    With ``history`` (the worker's --keep-history) the finished rows go to the history instead,
    once: the task table is emptied for each phase, the history is not."""
    q = queries(BENCH_SCHEMA, SQL_DIR)
    conn.execute(f"TRUNCATE {BENCH_SCHEMA}.tasks")
    if finished and history:
        if not conn.execute(q["bench_history_rows"]).fetchone()[0]:
            conn.execute(q["bench_fill_history"], {"n": finished, **_SCHEMA})
            conn.execute(f"VACUUM ANALYZE {BENCH_SCHEMA}.task_history")
    elif finished:
        conn.execute(q["bench_fill_finished"], {"n": finished})
    if delayed:
        conn.execute(q["bench_fill_delayed"], {"n": delayed, "queue": DEFAULT_QUEUE})
    conn.execute(f"VACUUM ANALYZE {BENCH_SCHEMA}.tasks")


def worker_command(
    args: argparse.Namespace,
    *extra: str,
    keep_done: float | None = None,
) -> list[str]:
    """The real `worker run` over the bench schema, with the benchmark's settings. The DSN goes
    in the environment (WORKER_DSN, see worker_env), never on the command line: `ps` shows that."""
    cmd = [
        sys.executable,
        "-m",
        "worker",
        "run",
        "worker.dev.bench_tasks",
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
        *(["--keep-history"] if getattr(args, "keep_history", False) else []),
        *extra,
    ]
    if args.metrics:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            cmd += ["--metrics-port", str(s.getsockname()[1])]
    return cmd


def worker_env(dsn: str) -> dict[str, str]:
    return {**os.environ, "WORKER_DSN": dsn}


def drain(dsn: str, args: argparse.Namespace, n: int) -> Drain:
    """Run the real `worker run --burst` and time first claim to last acknowledgement."""
    with tempfile.NamedTemporaryFile("r", suffix=".jsonl", delete=False) as fh:
        report = fh.name
    cmd = worker_command(args, "--burst", "--report", report)
    try:
        subprocess.run(cmd, check=True, env=worker_env(dsn))
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


def limited_drain(conn: psycopg.Connection, dsn: str, args: argparse.Namespace, kind: str) -> Drain:
    """The drain with the queue under a limit that never binds (schema/0014): a concurrency
    limit of ten times the fleet's slots (at most the largest limit there is), or a rate limit of
    a million starts per second (the largest rate there is). It measures what a limited claim
    costs (its lock, its counts, the start log) next to the plain claim."""
    slots = min(10 * args.processes * args.concurrency, MAX_CONCURRENCY)
    limits = (
        Limits(concurrency=slots) if kind == "concurrency" else Limits(rate=(MAX_PER_SECOND, 1.0))
    )
    set_limits(conn, BENCH_SCHEMA, DEFAULT_QUEUE, limits, by="bench")
    try:
        return drain(dsn, args, args.tasks)
    finally:
        clear_limits(conn, BENCH_SCHEMA, DEFAULT_QUEUE)


def serve(
    conn: psycopg.Connection,
    dsn: str,
    args: argparse.Namespace,
    *,
    n: int,
    rate: float,
    queue: str = DEFAULT_QUEUE,
    served: list[str] | None = None,
) -> Served:
    """Idle workers serving ``served`` (default: the task module's queues), tasks arriving in
    ``queue`` one per transaction at ``rate``: how long each waits, and what the claims cost.

    This is what LISTEN/NOTIFY is for; with polling alone the wait would be about half the poll
    interval. The drain phases say nothing about it, since their workers never wait. Rows already
    in the table (delayed ones, say) stay: they are what a phase measures against.
    """
    q = queries(BENCH_SCHEMA, SQL_DIR)
    extra = ["--queues", ",".join(served)] if served else []
    cmd = worker_command(args, *extra, keep_done=_KEEP_MEASURED)
    proc = subprocess.Popen(cmd, env=worker_env(dsn))
    try:
        deadline = time.monotonic() + _START_TIMEOUT
        while conn.execute(q["bench_workers_alive"]).fetchone()[0] < args.processes:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("the benchmark's workers did not start")
            time.sleep(0.1)
        time.sleep(1.0)  # let every process reach its LISTEN
        mine = {"queue": queue, "after": conn.execute(q["bench_last_id"], _SCHEMA).fetchone()[0]}
        cpu_before = _claim_cpu(conn)
        start = time.perf_counter()
        for i in range(n):
            pause = start + i / rate - time.perf_counter()
            if pause > 0:
                time.sleep(pause)
            enqueue(conn, TASK, {"i": i}, queue=queue, schema=BENCH_SCHEMA)
        deadline = time.monotonic() + _START_TIMEOUT
        while conn.execute(q["bench_done"], mine).fetchone()[0] < n:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("the benchmark's workers did not finish the phase's tasks")
            time.sleep(0.05)
        cpu_after = _claim_cpu(conn)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    n_done, p50, p99, worst = conn.execute(q["bench_latency"], mine).fetchone()
    cpu_ms = None
    if cpu_before is not None and cpu_after is not None:
        spent = sum(t - cpu_before.get(pid, 0) for pid, t in cpu_after.items())
        cpu_ms = spent / 1e6 / n_done if n_done else None
    return Served(n_done, float(p50), float(p99), float(worst), cpu_ms)


def _claim_cpu(conn: psycopg.Connection) -> dict[int, int] | None:
    """CPU time so far (ns) of the server processes behind the worker's claim connections, or
    None when it cannot be read (the server on another machine, or in another pid namespace)."""
    q = queries(BENCH_SCHEMA, SQL_DIR)
    if not conn.execute(q["bench_server_is_local"]).fetchone()[0]:
        return None
    used: dict[int, int] = {}
    for (pid,) in conn.execute(q["bench_claim_backends"]).fetchall():
        try:
            if not Path(f"/proc/{pid}/comm").read_text().startswith("postgres"):
                return None
            # The first field: nanoseconds on a CPU (/proc/PID/stat counts 10 ms ticks).
            used[pid] = int(Path(f"/proc/{pid}/schedstat").read_text().split()[0])
        except (OSError, ValueError, IndexError):
            return None
    return used or None


def latency(conn: psycopg.Connection, dsn: str, args: argparse.Namespace) -> Served:
    """Idle workers, tasks at --latency-rate (1000/s): the wake-up path under a brisk load."""
    truncate(conn)
    return serve(conn, dsn, args, n=args.latency_tasks, rate=args.latency_rate)


def light_delayed(conn: psycopg.Connection, dsn: str, args: argparse.Namespace) -> dict[str, Any]:
    """A light load (--light-rate) on an empty table, then on a table holding --delayed-rows tasks
    due tomorrow in the same queue: delayed tasks must not slow the claims of due ones."""
    truncate(conn)
    base = serve(conn, dsn, args, n=args.light_tasks, rate=args.light_rate)
    truncate(conn, delayed=args.delayed_rows)
    backlog = serve(conn, dsn, args, n=args.light_tasks, rate=args.light_rate)
    return {
        "rate_per_s": args.light_rate,
        "delayed_rows": args.delayed_rows,
        "base": base.report(),
        "backlog": backlog.report(),
        **_ratios(backlog, base),
        "target": "p99 backlog <= 2 x p99 base + 5 ms",
        "target_met": backlog.p99_ms <= 2 * base.p99_ms + 5,
    }


def many_queues(conn: psycopg.Connection, dsn: str, args: argparse.Namespace) -> dict[str, Any]:
    """A light load on q0, served alone, then among --served-queues queues (q0 to qN-1, the
    others empty): idle queues must cost the database next to nothing."""
    names = [f"q{i}" for i in range(args.served_queues)]
    truncate(conn)
    one = serve(
        conn, dsn, args, n=args.light_tasks, rate=args.light_rate, queue="q0", served=["q0"]
    )
    truncate(conn)
    many = serve(
        conn, dsn, args, n=args.light_tasks, rate=args.light_rate, queue="q0", served=names
    )
    cost = _ratio(many.db_cpu_ms_per_task, one.db_cpu_ms_per_task)
    return {
        "rate_per_s": args.light_rate,
        "served_queues": args.served_queues,
        "one": one.report(),
        "many": many.report(),
        **_ratios(many, one),
        "cost_ratio": cost,
        "target": f"db CPU per task with {args.served_queues} queues <= 1.5 x one queue",
        "target_met": None if cost is None else cost <= 1.5,
    }


def light_held(conn: psycopg.Connection, dsn: str, args: argparse.Namespace) -> dict[str, Any]:
    """A light load (--held-rate) for a minute, then for --held-seconds while another session
    holds a transaction open (vacuum can then remove nothing, and every claimed row leaves a
    dead entry in the claim index): the dead entries must not slow the claims of new rows."""
    rate = args.held_rate
    truncate(conn)
    base = serve(conn, dsn, args, n=max(int(rate * 60), 1), rate=rate)
    truncate(conn)
    with connect(dsn, BENCH, autocommit=False) as holder:
        holder.execute("SELECT txid_current()")  # opens a transaction and keeps it
        held = serve(conn, dsn, args, n=max(int(rate * args.held_seconds), 1), rate=rate)
        holder.rollback()
    return {
        "rate_per_s": rate,
        "held_seconds": args.held_seconds,
        "base": base.report(),
        "held": held.report(),
        **_ratios(held, base),
        "target": "p99 held <= 2 x p99 base",
        "target_met": held.p99_ms <= 2 * base.p99_ms,
    }


def _ratios(measured: Served, base: Served) -> dict[str, float | None]:
    return {
        "p50_ratio": _ratio(measured.p50_ms, base.p50_ms),
        "p99_ratio": _ratio(measured.p99_ms, base.p99_ms),
    }


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or not b else round(a / b, 2)
