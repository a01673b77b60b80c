"""``worker doctor``: a health check of the database for the queue, one line per finding.

Exit status: 0 when every check is ok, 1 when any finding is a warning or critical (so a cron
job or a deploy script can act on it), 2 for a usage error, a database that cannot be reached or
a schema that is missing.
"""

from __future__ import annotations

import argparse

from ..monitor.doctor.checkup import diagnose
from ..monitor.doctor.claim import MODES
from ..monitor.doctor.findings import CODES, Thresholds, ordered
from .args import DAY, int_in, seconds_in
from .common import connect, print_json, require
from .text import LINE_LIMIT, safe

_LABEL = {"ok": "ok", "warning": "WARNING", "critical": "CRITICAL"}
SHARE = int_in(1, 100)
COUNT = int_in(1, 2**62)


def thresholds(args: argparse.Namespace) -> Thresholds:
    return Thresholds(
        xmin_warning_seconds=args.xmin_warning,
        xmin_critical_seconds=max(args.xmin_critical, args.xmin_warning),
        dead_tuples_warning=args.dead_tuples,
        dead_tuples_critical=max(args.dead_tuples_critical, args.dead_tuples),
        slot_wal_bytes=args.slot_wal_mb * 1024 * 1024,
        index_min_bytes=args.index_mb * 1024 * 1024,
        claim_base_buffers=args.claim_buffers,
        claim_buffers_per_row=args.claim_buffers_per_row,
        connections_warning=args.connections_warning / 100,
        connections_critical=max(args.connections_critical, args.connections_warning) / 100,
        long_task_seconds=args.long_task,
        lease_grace_seconds=args.lease_grace,
    )


def cmd_doctor(args: argparse.Namespace) -> int:
    with connect(args) as conn:
        require(conn, args.schema)
        report = diagnose(
            conn,
            args.schema,
            thresholds(args),
            probe=args.probe,
            probe_rows=args.probe_rows,
            statement_ms=int(args.statement_timeout * 1000),
        )
    code = 0 if report.status == "ok" else 1
    if args.json:
        print_json(report.as_dict())
        return code
    findings = ordered(report.findings)
    width = max((len(f.code) for f in findings), default=0)
    for f in findings:
        line = f"{_LABEL[f.severity]:<8}  {f.code:<{width}}  {f.summary}"
        if f.severity != "ok":
            line += f" -> {f.action}"
        print(safe(line, LINE_LIMIT))
    counts = {s: sum(1 for f in findings if f.severity == s) for s in _LABEL}
    print(
        f"\n{len(findings)} finding(s) in schema {safe(args.schema)}: {counts['critical']} "
        f"critical, {counts['warning']} warning, {counts['ok']} ok ({report.duration:.2f}s)"
    )
    return code


def doctor_arguments(p: argparse.ArgumentParser) -> None:
    p.description = (
        "Check what holds vacuum back (old transactions, prepared transactions, "
        "replication slots), dead rows and autovacuum, the claim's cost, connection headroom, "
        "long-running tasks, and queues or tasks no live worker takes. One line per finding; "
        "exit 0 when all are ok, 1 when any is a warning or critical, 2 for usage errors. "
        "Codes: " + ", ".join(CODES) + "."
    )
    p.add_argument(
        "--probe",
        choices=MODES,
        default="claim",
        help="how to measure the claim: EXPLAIN ANALYZE of the real claim in a transaction "
        "that is rolled back (claim, default), a read-only scan of the same index range "
        "(read-only), or not at all (off)",
    )
    p.add_argument(
        "--probe-rows",
        metavar="N",
        type=int_in(1, 1000),
        default=10,
        help="rows per probed claim (10)",
    )
    p.add_argument(
        "--xmin-warning",
        metavar="SECONDS",
        type=seconds_in(0, 365 * DAY),
        default=300.0,
        help="seconds a transaction, snapshot or prepared transaction may hold the xmin "
        "horizon (or sit idle in a transaction) before it is a warning (300)",
    )
    p.add_argument(
        "--xmin-critical",
        metavar="SECONDS",
        type=seconds_in(0, 365 * DAY),
        default=3600.0,
        help="... and critical (3600)",
    )
    p.add_argument(
        "--dead-tuples",
        metavar="N",
        type=COUNT,
        default=100_000,
        help="dead row versions in one queue table that make a warning (100000)",
    )
    p.add_argument(
        "--dead-tuples-critical",
        metavar="N",
        type=COUNT,
        default=1_000_000,
        help="... critical (1000000)",
    )
    p.add_argument(
        "--claim-buffers",
        metavar="N",
        type=int_in(0, 10**9),
        default=20,
        help="buffers a claim's scan may read whatever it claims (20); beyond the budget it is a "
        "warning, beyond ten times critical",
    )
    p.add_argument(
        "--claim-buffers-per-row",
        metavar="N",
        type=int_in(0, 10**6),
        default=4,
        help="... plus this many per row it claims (4)",
    )
    p.add_argument(
        "--connections-warning",
        metavar="PERCENT",
        type=SHARE,
        default=80,
        help="percent of the connections non-superusers may open in use for a warning (80)",
    )
    p.add_argument(
        "--connections-critical",
        metavar="PERCENT",
        type=SHARE,
        default=95,
        help="... critical (95)",
    )
    p.add_argument(
        "--long-task",
        metavar="SECONDS",
        type=seconds_in(1, 365 * DAY),
        default=3600.0,
        help="seconds a task may be in progress before it is reported (3600)",
    )
    p.add_argument(
        "--lease-grace",
        metavar="SECONDS",
        type=seconds_in(0, DAY),
        default=60.0,
        help="seconds past its lease a running task may wait for rescue (60)",
    )
    p.add_argument(
        "--slot-wal-mb",
        metavar="MB",
        type=int_in(0, 2**40),
        default=1024,
        help="MB of WAL an inactive replication slot may retain (1024)",
    )
    p.add_argument(
        "--index-mb",
        metavar="MB",
        type=int_in(0, 2**40),
        default=64,
        help="MB of indexes on one table below which they are never reported as oversized (64); "
        "above it, indexes four times what their row versions need are",
    )
    p.add_argument(
        "--statement-timeout",
        metavar="SECONDS",
        type=seconds_in(0.1, 3600),
        default=10.0,
        help="seconds any one statement of the checks may take (10)",
    )
    p.set_defaults(func=cmd_doctor)
