"""The ``worker`` command's parser and entry point. Every failure a user can cause ends in one
line on stderr and a non-zero exit, never a traceback: exit 2 for configuration (flags, DSN,
schema, module), 1 otherwise.

Each command's flags and code live in its own module, loaded only when that command runs (or
shows its help): ``worker status`` starts without loading the engine, the console or the
benchmarks."""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence
from importlib import metadata
from typing import Any

import psycopg

from ..errors import ConfigError
from . import exits
from .args import Parser, UsageError, common_flags
from .common import CliError, database_error, scrub, setup_logging
from .text import LINE_LIMIT, safe

# Each command: the module (in this package) whose function adds its flags and sets its
# ``func``, that function, and the line ``worker --help`` shows.
COMMANDS: dict[str, tuple[str, str, str]] = {
    "migrate": ("migrate", "migrate_arguments", "create or upgrade the queue schema"),
    "run": ("run_flags", "run_arguments", "run workers for the tasks of MODULE"),
    "enqueue": ("enqueue", "enqueue_arguments", "enqueue one task"),
    "status": (
        "status",
        "status_arguments",
        "queues, workers and recent failures; or one task (--id)",
    ),
    "retry": (
        "bulk",
        "retry_arguments",
        "requeue a failed task, every failure (--failed), or the tasks a filter matches",
    ),
    "cancel": ("bulk", "cancel_arguments", "cancel a task, or the tasks a filter matches"),
    "delete": (
        "bulk",
        "delete_arguments",
        "delete the tasks a filter matches (never running ones)",
    ),
    "dsn": (
        "embedded",
        "dsn_arguments",
        "print the DSN (starting the embedded server when no DSN is configured)",
    ),
    "embedded": (
        "embedded",
        "embedded_arguments",
        "start, stop or inspect the embedded PostgreSQL",
    ),
    "bench": (
        "devtools",
        "bench_arguments",
        "measure enqueue and drain against the bare-SQL ceiling",
    ),
    "demo": (
        "devtools",
        "demo_arguments",
        "a worker pool, a steady producer, a cron job and the console, until Ctrl-C",
    ),
    "cron": (
        "cron",
        "cron_arguments",
        "list cron schedules (from MODULE and the database) with last and next runs",
    ),
    "locks": (
        "locks",
        "locks_arguments",
        "list lock rows and advisory locks with their holders",
    ),
    "pause": ("pause", "pause_arguments", "pause a queue fleet-wide (running tasks finish)"),
    "resume": ("pause", "resume_arguments", "resume a paused queue"),
    "limits": (
        "limits",
        "limits_arguments",
        "fleet-wide concurrency and rate limits per queue and per key",
    ),
    "doctor": (
        "doctor",
        "doctor_arguments",
        "check the database's health for the queue (exit 1 on any warning)",
    ),
    "wait": (
        "wait",
        "wait_arguments",
        "wait for a task to finish and print its result (exit 0 done, 1 failed or cancelled, "
        "3 timeout)",
    ),
}


class _Version(argparse.Action):
    """--version, reading the installed version only when asked."""

    def __init__(self, option_strings: list[str], dest: str, **kwargs: Any) -> None:
        super().__init__(option_strings, dest, nargs=0, help="show the version and exit")

    def __call__(self, parser: argparse.ArgumentParser, *args: Any, **kwargs: Any) -> None:
        print(f"worker {_version()}")
        parser.exit()


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The whole parser; with ``only``, every command is listed but only that one's flags are
    added (and its module loaded)."""
    common = common_flags()
    parser = Parser(
        prog="worker",
        description="A PostgreSQL work queue.",
        epilog=exits.EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action=_Version)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (module, function, help_line) in COMMANDS.items():
        p = sub.add_parser(name, parents=[common], help=help_line)
        if only is None or name == only:
            add_arguments = getattr(importlib.import_module(f".{module}", __package__), function)
            add_arguments(p)
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
    parser = build_parser(argv[0] if argv and argv[0] in COMMANDS else "")
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
