"""`worker bench --soak MINUTES`: the queue as a deployment runs it, for a long time.

First the drain is measured as in the other phases (unless --soak-rate gives the rate), then the
real `worker run` serves a steady producer at a share of it (--soak-share, default half) for
MINUTES, with the worker's retention (--keep-done, the worker's default unless given) and the
server's autovacuum as it is configured. Nothing is vacuumed or truncated by the benchmark once
the soak has begun. Each minute it reads:

- enqueue to claim, p50 and p99, from the database clock on both ends (as the light-load phases
  do), over every n-th task enqueued in that minute (at most SAMPLE of them, by primary key);
- the task table's heap and index sizes, the history's size (with --keep-history, the done
  tasks that left the task table), the task table's dead row versions (pg_stat_user_tables), the
  vacuums of the minute: autovacuum's and the others' (the worker's own VACUUM) from the
  statistics' counts, and how long each ran from pg_stat_progress_vacuum sampled every half
  second (so a run shorter than that is counted but may show no duration);
- the WAL written per task (pg_current_wal_lsn), and, when the server runs on this machine, the
  CPU time of all its processes per task, from /proc: the postmaster's children alive now, and
  those that ended since (the postmaster's own count of its reaped children), autovacuum and the
  checkpointer included.

The verdicts compare the last five minutes with the first five (fewer when the soak is short):
p99 <= 1.5 x, and the table's size (heap, indexes and TOAST) at the end <= 2 x its size after
the first five. With --soak-hold, another session holds a transaction open (with an xid) for
that many minutes in the middle of the soak, and the verdict compares p99 during the hold with
the minutes before it: <= 2 x.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

import psycopg

from ..db.connect import BENCH, connect
from ..db.sql import queries
from ..errors import ConfigError
from ..tasks.enqueue import enqueue_many
from .bench_phases import BENCH_SCHEMA, SQL_DIR, TASK, drain, reset, truncate
from .bench_soak_probes import (
    PROGRESS_SECONDS,
    Producer,
    ServerCpu,
    Vacuums,
    per_task,
    read_waits,
    start_worker,
    stop_worker,
    summary,
    table_stats,
)
from .bench_soak_report import blocks, held_verdict, print_minute, print_summary, verdict

BACKLOG_CAP = 100_000


def add_arguments(p: argparse.ArgumentParser, *, whole: Any, number: Any) -> None:
    p.add_argument(
        "--soak",
        type=whole(0, 7 * 24 * 60),
        default=0,
        metavar="MINUTES",
        help="run only the soak: the real worker serving a steady producer for MINUTES, with "
        "the worker's retention and the server's autovacuum; a report per minute and a "
        "verdict comparing the last five minutes with the first five (default 0: no soak)",
    )
    rate = p.add_mutually_exclusive_group()
    rate.add_argument(
        "--soak-rate",
        type=number(0.1, 1_000_000),
        default=None,
        help="soak: tasks per second (default: --soak-share of the drain measured first)",
    )
    rate.add_argument(
        "--soak-share",
        type=number(0.01, 10),
        default=0.5,
        help="soak: the producer's rate as a share of the drain measured first (default 0.5)",
    )
    p.add_argument(
        "--soak-hold",
        type=whole(0, 7 * 24 * 60),
        default=0,
        metavar="MINUTES",
        help="soak: another session holds a transaction open for MINUTES in the middle of "
        "the soak; verdict: p99 during the hold <= 2 x the minutes before it (default 0)",
    )
    p.add_argument(
        "--soak-minute-seconds",
        type=number(1, 3600),
        default=60.0,
        help="soak: the length of a reported 'minute', for trying the soak out quickly "
        "(default 60)",
    )


def check(args: argparse.Namespace) -> None:
    """The soak's flags together (each alone is checked by the parser)."""
    if args.soak_hold and not args.soak:
        raise ConfigError("--soak-hold needs --soak MINUTES")
    if args.soak and args.soak - args.soak_hold < 2 and args.soak_hold:
        raise ConfigError(
            f"--soak-hold {args.soak_hold} must leave at least two minutes of --soak "
            f"{args.soak} without it: the verdict compares the hold with the minutes before it"
        )
    if args.soak and args.keep_done < 2 * args.soak_minute_seconds:
        raise ConfigError(
            "--soak reads each minute's finished tasks at the end of the minute: --keep-done "
            f"must be at least two minutes ({2 * args.soak_minute_seconds:g} s)"
        )


# -- the soak --------------------------------------------------------------------------------------


def _minute_row(
    m: int,
    tasks: int,
    held: bool,
    waits: tuple[list[float], int],
    backlog: int,
    before: dict[str, int],
    after: dict[str, int],
    cpu_s: float | None,
    vac: Vacuums,
    window: tuple[float, float],
) -> dict[str, Any]:
    mb = 1024 * 1024
    return {
        "minute": m + 1,
        "tasks": tasks,
        "held": held,
        **summary(waits[0]),
        "unclaimed": waits[1],
        "backlog": backlog,
        "heap_mb": round(after["heap_bytes"] / mb, 1),
        "index_mb": round(after["index_bytes"] / mb, 1),
        "total_mb": round(after["total_bytes"] / mb, 1),
        "total_bytes": after["total_bytes"],
        "history_mb": round(after["history_bytes"] / mb, 1),
        "history_bytes": after["history_bytes"],
        "dead_rows": after["dead_rows"],
        "live_rows": after["live_rows"],
        "autovacuum_runs": after["autovacuums"] - before["autovacuums"],
        "autovacuum_seconds": round(vac.busy(*window, auto=True), 1),
        "vacuum_runs": after["vacuums"] - before["vacuums"],
        "vacuum_seconds": round(vac.busy(*window, auto=False), 1),
        "autoanalyze_runs": after["autoanalyzes"] - before["autoanalyzes"],
        "wal_bytes_per_task": per_task(after["wal_bytes"] - before["wal_bytes"], tasks, digits=0),
        "db_cpu_ms_per_task": per_task(cpu_s, tasks, 1000.0),
    }


def soak(conn: psycopg.Connection, dsn: str, args: argparse.Namespace) -> dict[str, Any]:
    q = queries(BENCH_SCHEMA, SQL_DIR)
    minute = args.soak_minute_seconds
    reset(conn)
    drained = None
    if args.soak_rate is None:
        truncate(conn)
        enqueue_many(conn, TASK, ({"i": i} for i in range(args.tasks)), schema=BENCH_SCHEMA)
        drained = drain(dsn, args, args.tasks).per_s
    rate = args.soak_rate if drained is None else args.soak_share * drained
    truncate(conn)  # empty, vacuumed and analysed; from here on only autovacuum and the worker
    cur = conn.execute(q["soak_settings"], {"schema": BENCH_SCHEMA})
    settings = dict(zip([d.name for d in cur.description or []], cur.fetchone(), strict=True))
    hold_from = (args.soak - args.soak_hold) // 2 if args.soak_hold else None
    cpu = ServerCpu(conn)
    vac = Vacuums()
    rows: list[dict[str, Any]] = []
    waits: list[list[float]] = []
    lo = int(conn.execute(q["soak_first_id"], {"schema": BENCH_SCHEMA}).fetchone()[0])
    proc = start_worker(conn, dsn, args)
    producer = Producer(dsn, rate, lo)
    holder: psycopg.Connection | None = None
    try:
        before, cpu_before, sent_before = table_stats(conn, q), cpu.seconds(), 0
        t0 = time.monotonic()
        producer.start()
        for m in range(args.soak):
            held = hold_from is not None and hold_from <= m < hold_from + args.soak_hold
            if held and holder is None:
                holder = connect(dsn, BENCH, autocommit=False)
                holder.execute("SELECT txid_current()")  # an open transaction with an xid
            elif not held and holder is not None:
                holder.close()  # rolls it back
                holder = None
            start, end = t0 + m * minute, t0 + (m + 1) * minute
            while time.monotonic() < end:
                if producer.error is not None:
                    raise producer.error
                if proc.poll() is not None:
                    raise RuntimeError(f"the benchmark's worker exited ({proc.returncode})")
                vac.sample(conn, q)
                time.sleep(min(PROGRESS_SECONDS, max(end - time.monotonic(), 0.0)))
            hi, sent = producer.mark()
            after, cpu_after = table_stats(conn, q), cpu.seconds()
            got = read_waits(conn, q, lo, hi)
            backlog = conn.execute(
                q["soak_backlog"], {"after": max(hi - BACKLOG_CAP, 0)}
            ).fetchone()[0]
            spent = None if cpu_before is None or cpu_after is None else cpu_after - cpu_before
            rows.append(
                _minute_row(
                    m,
                    sent - sent_before,
                    held,
                    got,
                    backlog,
                    before,
                    after,
                    spent,
                    vac,
                    (start, end),
                )
            )
            waits.append(got[0])
            lo, before, cpu_before, sent_before = hi, after, cpu_after, sent
            print_minute(rows[-1], header=m == 0, out=sys.stderr if args.json else sys.stdout)
    finally:
        producer.stop()
        if holder is not None:
            holder.close()
        stop_worker(proc)
    return {
        "minutes_run": args.soak,
        "minute_seconds": minute,
        "rate_per_s": round(rate, 1),
        "share": None if drained is None else args.soak_share,
        "drain_per_s": None if drained is None else round(drained),
        "processes": args.processes,
        "concurrency": args.concurrency,
        "keep_done": args.keep_done,
        "keep_history": args.keep_history,
        "settings": settings,
        "minutes": rows,
        "blocks": blocks(rows, waits),
        "autovacuums": vac.durations(t0, minute, auto=True),
        "other_vacuums": vac.durations(t0, minute, auto=False),
        "verdict": verdict(rows, waits),
        "hold": None if hold_from is None else held_verdict(rows, waits, hold_from, args.soak_hold),
    }


def run(dsn: str, args: argparse.Namespace) -> dict[str, Any]:
    """The soak alone, on a fresh bench schema, dropped afterwards."""
    with connect(dsn, BENCH) as conn:
        try:
            result = soak(conn, dsn, args)
            server = conn.execute("SHOW server_version").fetchone()
            fsync = conn.execute("SHOW fsync").fetchone()
            sync = conn.execute("SHOW synchronous_commit").fetchone()
        finally:
            conn.execute(f"DROP SCHEMA IF EXISTS {BENCH_SCHEMA} CASCADE")
    return {
        "soak": result,
        "server": server[0] if server else "?",
        "fsync": fsync[0] if fsync else "?",
        "synchronous_commit": sync[0] if sync else "?",
        "cpus": os.cpu_count(),
    }


def main(args: argparse.Namespace, dsn: str) -> int:
    if not args.json:
        rate = (
            f"{args.soak_rate:g} tasks/s"
            if args.soak_rate is not None
            else f"{args.soak_share:g} x the drain measured first"
        )
        print(
            f"worker bench --soak: {args.soak} minute(s) of {args.soak_minute_seconds:g} s, "
            f"producer at {rate}, {args.processes} process(es) x {args.concurrency} slots, "
            f"--keep-done {args.keep_done:g}",
            flush=True,
        )
    r = run(dsn, args)
    if args.json:
        print(json.dumps(r, indent=2))
        return 0
    s = r["soak"]
    drained = f" ({s['share']:g} x a drain of {s['drain_per_s']:,}/s)" if s["share"] else ""
    print(
        f"  producer {s['rate_per_s']:,.1f} tasks/s{drained}; PostgreSQL {r['server']} "
        f"(fsync={r['fsync']}, synchronous_commit={r['synchronous_commit']}, autovacuum="
        f"{s['settings']['autovacuum']}), {r['cpus']} CPUs"
    )
    print_summary(s)
    return 0
