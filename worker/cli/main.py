"""The ``worker`` command's parser and entry point. Every failure a user can cause ends in one
line on stderr and a non-zero exit, never a traceback: exit 2 for configuration (flags, DSN,
schema, module), 1 otherwise."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from importlib import metadata

import psycopg

from ..dev.bench import add_arguments as add_bench_arguments
from ..errors import ConfigError
from . import bulk, cron, doctor, exits, limits, locks, pause, wait
from .bulk import TASK_ID
from .commands import (
    cmd_bench,
    cmd_demo,
    cmd_dsn,
    cmd_embedded,
    cmd_enqueue,
    cmd_migrate,
    cmd_status,
)
from .common import (
    DAY,
    CliError,
    Parser,
    UsageError,
    database_error,
    int_in,
    rate_in,
    schema_name,
    scrub,
    seconds,
    seconds_in,
    setup_logging,
)
from .run import cmd_run
from .text import LINE_LIMIT, safe

# Flag ranges: the schema's for task fields, and what one machine can sensibly run.
MAX_PROCESSES = max(64, 4 * (os.cpu_count() or 1))
PRIORITY = int_in(-1_000_000, 1_000_000)
ATTEMPTS = int_in(1, 1_000_000)


def build_parser() -> argparse.ArgumentParser:
    common = Parser(add_help=False)
    common.add_argument(
        "--dsn",
        help="PostgreSQL URL or conninfo (default: $WORKER_DSN, "
        "$DATABASE_URL, else the embedded server)",
    )
    common.add_argument(
        "--schema",
        type=schema_name,
        default=os.environ.get("WORKER_SCHEMA", "worker"),
        help="schema holding the queue tables (default: $WORKER_SCHEMA, else worker; "
        "`worker demo`: worker_demo)",
    )
    common.add_argument(
        "--log-level",
        default=os.environ.get("WORKER_LOG_LEVEL", "INFO"),
        choices=["DEBUG", "INFO", "WARNING", "ERROR"],
    )
    common.add_argument("--json", action="store_true", help="machine-readable output")

    parser = Parser(
        prog="worker",
        description="A PostgreSQL work queue.",
        epilog=exits.EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"worker {_version()}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("migrate", parents=[common], help="create or upgrade the queue schema")
    p.add_argument(
        "--module",
        help="also record the queue of each task MODULE registers, as its workers will when they "
        "start: tasks enqueued before any worker has started then land in the right queue",
    )
    p.set_defaults(func=cmd_migrate)

    p = sub.add_parser("run", parents=[common], help="run workers for the tasks of MODULE")
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

    p = sub.add_parser("enqueue", parents=[common], help="enqueue one task")
    p.add_argument("name", help="task name")
    p.add_argument(
        "--quiet",
        action="store_true",
        help="no warning for a task that no worker has declared (a typo, or a task whose workers "
        "have not started yet)",
    )
    p.add_argument(
        "--payload",
        default="{}",
        help="JSON payload (default {}); @FILE reads it from FILE, - from stdin",
    )
    p.add_argument("--queue", default=None)
    p.add_argument(
        "--priority", type=PRIORITY, default=0, help="higher runs first (-1000000 to 1000000)"
    )
    p.add_argument("--delay", type=seconds, default=None, help="run after this many seconds")
    p.add_argument("--run-at", default=None, help="ISO timestamp with time zone")
    p.add_argument("--max-attempts", type=ATTEMPTS, default=None)
    p.add_argument("--dedupe-key", default=None)
    p.set_defaults(func=cmd_enqueue)

    p = sub.add_parser(
        "status", parents=[common], help="queues, workers and recent failures; or one task (--id)"
    )
    p.add_argument(
        "--id", type=TASK_ID, default=None, help="show this task, with its error history"
    )
    p.add_argument(
        "--workflow",
        type=TASK_ID,
        default=None,
        help="show this workflow: its steps, their states, times and errors",
    )
    p.add_argument(
        "--failed", type=int_in(0, 1000), default=10, help="how many recent failures to list"
    )
    p.set_defaults(func=cmd_status)

    bulk.add_cli(sub, common)

    p = sub.add_parser(
        "dsn",
        parents=[common],
        help="print the DSN (starting the embedded server when no DSN is configured)",
    )
    p.add_argument(
        "--show-password",
        action="store_true",
        help="print the password too (by default it is replaced by ***)",
    )
    p.set_defaults(func=cmd_dsn)

    p = sub.add_parser(
        "embedded", parents=[common], help="start, stop or inspect the embedded PostgreSQL"
    )
    p.add_argument("action", choices=["start", "stop", "status"])
    p.set_defaults(func=cmd_embedded)

    p = sub.add_parser(
        "bench", parents=[common], help="measure enqueue and drain against the bare-SQL ceiling"
    )
    add_bench_arguments(p)
    p.set_defaults(func=cmd_bench)

    p = sub.add_parser(
        "demo",
        parents=[common],
        help="a worker pool, a steady producer, a cron job and the console, until Ctrl-C",
    )
    p.add_argument(
        "--tasks",
        type=int_in(1, 1_000_000),
        default=None,
        help="enqueue this many tasks at once and exit when they have settled",
    )
    p.add_argument("--processes", type=int_in(1, MAX_PROCESSES), default=2)
    p.add_argument(
        "--rate",
        type=rate_in(0.1, 10_000),
        default=20.0,
        help="tasks enqueued per second until Ctrl-C (default 20)",
    )
    p.add_argument(
        "--port",
        type=int_in(1, 65535),
        default=None,
        help="the console's port (default 9187, or a free one when it is taken)",
    )
    p.set_defaults(func=cmd_demo)

    cron.add_cli(sub, common)
    locks.add_cli(sub, common)
    pause.add_cli(sub, common)
    limits.add_cli(sub, common)
    doctor.add_cli(sub, common)
    wait.add_cli(sub, common)
    return parser


def _version() -> str:
    """The installed distribution's version (worker-pg), as its metadata says."""
    try:
        return metadata.version("worker-pg")
    except metadata.PackageNotFoundError:  # run from a source tree that was never installed
        return "(not installed)"


def _fail(message: str, code: int, as_json: bool = False) -> int:
    """The one line of an error: no password, no control character, bounded."""
    return exits.fail(f"worker: {safe(scrub(message), LINE_LIMIT)}", code, as_json=as_json)


def main(argv: Sequence[str] | None = None) -> int:
    from_command_line = argv is None
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["run"] and any(
        a == "--console-token" or a.startswith("--console-token=") for a in argv
    ):
        # Refused before the parser, whose message would repeat the token.
        return _fail(
            "error: --console-token is not accepted: a command line is visible to every user of "
            "the machine (ps); put the token in $WORKER_CONSOLE_TOKEN or in a file given with "
            "--console-token-file",
            2,
        )
    as_json = "--json" in argv
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except UsageError as exc:
        return exits.fail(exc.line, exits.USAGE, as_json=as_json)
    args.argv = argv
    setup_logging(args.log_level)
    args.from_command_line = from_command_line
    try:
        return int(args.func(args) or 0)
    except CliError as exc:
        return _fail(f"error: {exc}", exc.code, as_json)
    except ConfigError as exc:
        return _fail(f"error: {exc}", exits.USAGE, as_json)
    except psycopg.Error as exc:
        message, code = database_error(exc)
        return _fail(message, code, as_json)
    except KeyboardInterrupt:
        return exits.INTERRUPTED
    except BrokenPipeError:
        return exits.quiet_closed_pipe()


def entry() -> int:
    """The console script: main(), ending quietly when the reader of stdout has gone away (even
    at the interpreter's last flush)."""
    code = main()
    try:
        sys.stdout.flush()
    except BrokenPipeError:
        return exits.quiet_closed_pipe()
    return code


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
