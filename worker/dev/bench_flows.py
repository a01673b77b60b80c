"""`worker bench`'s workflow phases: a fan-out with a join, drained by the same fleet as the plain
drain and reported as a ratio of a plain drain of as many tasks measured just before it, with the
join's start after its last input's acknowledgement; and a chain, each step after the one before.

Both read the database clock: a step's started_at is its claiming transaction's time, its
finished_at its acknowledging transaction's, so the join's start and a chain's hops are what the
database saw, whatever the machine's load does to the processes' clocks.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import time
from dataclasses import dataclass
from typing import Any

import psycopg

from ..db.sql import queries
from ..tasks.enqueue import enqueue_many
from ..tasks.flows import enqueue_workflow
from ..tasks.workflow import Workflow, chain, group, step
from .bench_ceiling import ceiling
from .bench_phases import BENCH_SCHEMA, SQL_DIR, TASK, drain, worker_command, worker_env

_TIMEOUT = 300.0


@dataclass(frozen=True, slots=True)
class FanOut:
    plain_per_s: float  # the plain drain of as many tasks, just before
    per_s: float  # the fan-out's steps (and its join) per second
    join_start_ms: float


def add_arguments(p: argparse.ArgumentParser, whole: Any) -> None:
    p.add_argument(
        "--fanout",
        type=whole(0, 1_000_000),
        default=10_000,
        help="workflow phase: steps of the fan-out before its join, drained after a plain drain "
        "of as many tasks (default 10000; 0 skips the fan-out)",
    )
    p.add_argument(
        "--fanout-runs",
        type=whole(1, 100),
        default=3,
        help="fan-out runs, each after its own plain drain (default 3)",
    )
    p.add_argument(
        "--chain",
        type=whole(0, 100_000),
        default=1000,
        help="workflow phase: steps of the chain (default 1000; 0 skips the chain)",
    )
    p.add_argument(
        "--chain-processes",
        type=whole(1, 64),
        default=2,
        help="worker processes that run the chain (default 2)",
    )


def _truncate(conn: psycopg.Connection) -> None:
    conn.execute(
        f"TRUNCATE {BENCH_SCHEMA}.tasks, {BENCH_SCHEMA}.task_deps, {BENCH_SCHEMA}.workflows"
    )
    conn.execute(f"VACUUM ANALYZE {BENCH_SCHEMA}.tasks")


def fan_out(conn: psycopg.Connection, dsn: str, args: argparse.Namespace) -> FanOut:
    """A plain drain of --fanout tasks, then a fan-out of --fanout steps and a join, drained by
    the same `worker run --burst`."""
    n = args.fanout
    _truncate(conn)
    enqueue_many(conn, TASK, ({"i": i} for i in range(n)), schema=BENCH_SCHEMA)
    plain = drain(dsn, args, n)
    _truncate(conn)
    flow: Workflow = group([step(TASK, {"i": i}) for i in range(n)], then=step(TASK), name="fan")
    ids = enqueue_workflow(conn, flow, schema=BENCH_SCHEMA)
    steps = drain(dsn, args, n + 1)
    q = queries(BENCH_SCHEMA, SQL_DIR)
    state, start_ms = conn.execute(q["bench_flow_join"], {"id": ids[flow.steps[-1]]}).fetchone()
    if state != "done":
        raise RuntimeError(f"the fan-out's join ended {state}")
    return FanOut(plain.per_s, steps.per_s, float(start_ms))


def chained(conn: psycopg.Connection, dsn: str, args: argparse.Namespace) -> dict[str, Any]:
    """A chain of --chain steps run by --chain-processes workers already waiting: steps/s from
    the first step's claim to the last step's acknowledgement, and each hop's time."""
    q = queries(BENCH_SCHEMA, SQL_DIR)
    _truncate(conn)
    # The chain's own ceiling: bare SQL on one connection, one row per transaction, each
    # transaction acknowledging the row before and claiming the next, as a chain's hop does.
    # A hop waits for its commit, so this is what the server's commit latency allows.
    enqueue_many(conn, TASK, ({"i": i} for i in range(args.chain)), schema=BENCH_SCHEMA)
    bare = ceiling(dsn, BENCH_SCHEMA, batch=1, connections=1, delete=False)
    _truncate(conn)
    fleet = argparse.Namespace(**{**vars(args), "processes": args.chain_processes})
    proc = subprocess.Popen(worker_command(fleet), env=worker_env(dsn))
    try:
        deadline = time.monotonic() + 60
        while conn.execute(q["bench_workers_alive"]).fetchone()[0] < fleet.processes:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("the benchmark's workers did not start")
            time.sleep(0.1)
        time.sleep(1.0)  # let every process reach its LISTEN
        flow = chain(*(step(TASK, {"i": i}) for i in range(args.chain)), name="chain")
        wf = enqueue_workflow(conn, flow, schema=BENCH_SCHEMA).id
        deadline = time.monotonic() + _TIMEOUT
        while True:
            done, seconds = conn.execute(q["bench_flow_span"], {"id": wf}).fetchone()
            if done >= args.chain:
                break
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the chain ran {done} of {args.chain} steps")
            time.sleep(0.05)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    p50, p99, worst = conn.execute(q["bench_flow_hops"], {"id": wf}).fetchone()
    rate = args.chain / float(seconds)
    return {
        "steps": args.chain,
        "processes": args.chain_processes,
        "steps_per_s": round(rate),
        "hop_p50_ms": round(float(p50), 2),
        "hop_p99_ms": round(float(p99), 2),
        "hop_max_ms": round(float(worst), 2),
        "ceiling_hops_per_s": round(bare.per_s),
        "ceiling_ratio": round(rate / bare.per_s, 3),
        "target": "chain >= 500 steps/s",
        "target_met": rate >= 500,
    }


def run(conn: psycopg.Connection, dsn: str, args: argparse.Namespace) -> dict[str, Any] | None:
    """The workflow phases, or None when both are skipped."""
    if not args.fanout and not args.chain:
        return None
    out: dict[str, Any] = {"fanout": None, "chain": None}
    if args.fanout:
        runs = [fan_out(conn, dsn, args) for _ in range(args.fanout_runs)]
        ratios = [r.per_s / r.plain_per_s for r in runs]
        joins = sorted(r.join_start_ms for r in runs)
        ratio = statistics.median(ratios)
        p99 = joins[min(len(joins) - 1, int(0.99 * len(joins)))]
        out["fanout"] = {
            "steps": args.fanout,
            "runs": len(runs),
            "plain_per_s": round(statistics.median(r.plain_per_s for r in runs)),
            "steps_per_s": round(statistics.median(r.per_s for r in runs)),
            "ratio": round(ratio, 3),
            "all_ratios": [round(x, 3) for x in ratios],
            "join_start_ms": [round(x, 2) for x in joins],
            "join_start_p99_ms": round(p99, 2),
            "target": "fan-out >= 0.7 x the plain drain, join start <= 50 ms p99",
            "target_met": ratio >= 0.7 and p99 <= 50,
        }
    if args.chain:
        out["chain"] = chained(conn, dsn, args)
    _truncate(conn)
    return out


def print_report(r: dict[str, Any], verdict: Any) -> None:
    f, c = r["fanout"], r["chain"]
    if f:
        print(
            f"  workflow fan-out of {f['steps']:,} + join  {f['steps_per_s']:>9,} steps/s   "
            f"{f['ratio']:.0%} of the plain drain of as many ({f['plain_per_s']:,}/s), "
            f"{f['runs']} runs"
        )
        joins = ", ".join(f"{x:.1f}" for x in f["join_start_ms"])
        print(f"    join start after its last input's acknowledgement: {joins} ms")
        print(f"    target {f['target']}: {verdict(f['target_met'])}")
    if c:
        print(
            f"  workflow chain of {c['steps']:,} steps  {c['steps_per_s']:>9,} steps/s   "
            f"{c['processes']} processes; hop p50 {c['hop_p50_ms']:.1f} ms, "
            f"p99 {c['hop_p99_ms']:.1f} ms, max {c['hop_max_ms']:.1f} ms"
        )
        print(
            f"    bare SQL, one row per transaction on one connection: "
            f"{c['ceiling_hops_per_s']:,} hops/s; the chain ran at {c['ceiling_ratio']:.0%} of it"
        )
        print(f"    target {c['target']}: {verdict(c['target_met'])}")
