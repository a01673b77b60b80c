"""The flags of ``worker run`` (the command itself is run.py)."""

from __future__ import annotations

import argparse
import os

from .args import DAY, MAX_PROCESSES, int_in, seconds, seconds_in
from .run import cmd_run


def run_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("module", help="module (dotted name or .py path) whose import registers tasks")
    p.add_argument(
        "--queues",
        help="comma-separated queues (default: the registered tasks' queues and 'default')",
    )
    p.add_argument(
        "--concurrency",
        type=int_in(1, 1000),
        default=100,
        help="task slots per process; runner threads start as work needs them (default 100)",
    )
    p.add_argument(
        "--batch-size",
        type=int_in(1, 10_000),
        default=100,
        help="most tasks claimed per statement (default 100)",
    )
    p.add_argument(
        "--processes",
        type=int_in(1, MAX_PROCESSES),
        default=None,
        help="worker processes (default: number of CPUs)",
    )
    p.add_argument(
        "--grace",
        type=seconds_in(0, DAY),
        default=30.0,
        help="seconds to finish in-flight tasks on SIGTERM (default 30)",
    )
    p.add_argument(
        "--lease",
        type=seconds_in(0.5, DAY),
        default=30.0,
        help="seconds a claim stays valid without a heartbeat (default 30)",
    )
    p.add_argument(
        "--poll-interval",
        type=seconds_in(0.01, 3600),
        default=1.0,
        help="seconds between polls when no NOTIFY arrives (default 1)",
    )
    p.add_argument("--no-listen", action="store_true", help="poll only, no LISTEN/NOTIFY")
    p.add_argument(
        "--pgbouncer",
        action="store_true",
        help="--dsn goes through PgBouncer in transaction mode: no prepared "
        "statements, and LISTEN only through --listen-dsn",
    )
    p.add_argument(
        "--listen-dsn",
        default=os.environ.get("WORKER_LISTEN_DSN"),
        help="direct (not pooled) DSN for LISTEN when --dsn goes through PgBouncer",
    )
    p.add_argument(
        "--keep-done",
        type=seconds,
        default=3600.0,
        help="seconds to keep done rows (0: delete on completion; default 3600)",
    )
    p.add_argument(
        "--keep-history",
        action="store_true",
        help="a plain task that ends done leaves the task table at its acknowledgement, for a "
        "history emptied a slice at a time (read finished tasks from worker.task_rows)",
    )
    p.add_argument(
        "--otel",
        action="store_true",
        help="trace every run with OpenTelemetry (needs the otel extra; also WORKER_OTEL=1)",
    )
    p.add_argument(
        "--store-results",
        action="store_true",
        help="store every handler's return value with its row (a handler's own store_result "
        "wins); needs --keep-done above 0",
    )
    p.add_argument(
        "--max-result-size",
        type=int_in(1, 256 * 1024 * 1024),
        default=64 * 1024,
        metavar="BYTES",
        help="largest result stored, as JSON; a larger one fails its task (default 65536)",
    )
    p.add_argument(
        "--keep-failed",
        type=seconds,
        default=7 * 86400.0,
        help="seconds to keep failed rows (default 7 days)",
    )
    p.add_argument(
        "--metrics-port",
        type=int_in(1, 65535),
        default=None,
        help="serve /metrics, /healthz, /readyz, the status page (/) and the operator console "
        "(/console/) on this port",
    )
    p.add_argument("--metrics-host", default="127.0.0.1", help="bind address (default 127.0.0.1)")
    p.add_argument(
        "--console-token-file",
        default=None,
        metavar="PATH",
        help="a file holding the token that turns on the console's actions (or set "
        "$WORKER_CONSOLE_TOKEN); without one the console is read-only",
    )
    p.add_argument(
        "--console-host",
        action="append",
        default=None,
        metavar="NAME",
        help="a host name (NAME or NAME:PORT) the status page and the console answer besides the "
        "server's own addresses; repeatable, or comma-separated (default: $WORKER_CONSOLE_HOSTS)",
    )
    p.add_argument(
        "--burst", action="store_true", help="exit once no task is due and none is running"
    )
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    # Seconds without a liveness touch before the supervisor kills a child as stuck (default
    # max(60, 2 x lease)); hidden, for tests and unusual deployments.
    p.add_argument(
        "--start-timeout",
        type=seconds_in(1, DAY),
        default=300.0,
        help="seconds a worker process may take to import MODULE and reach its loop before the "
        "supervisor replaces it (default 300)",
    )
    p.add_argument("--stuck-after", type=seconds_in(1, DAY), default=None, help=argparse.SUPPRESS)
    p.add_argument("--report", default=None, help=argparse.SUPPRESS)
    p.set_defaults(func=cmd_run)
