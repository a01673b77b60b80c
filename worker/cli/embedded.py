"""``worker dsn`` and ``worker embedded``: the DSN commands use, and the embedded PostgreSQL that
serves when none is configured."""

from __future__ import annotations

import argparse
import sys

import psycopg

from ..db.dsn import redact
from ..dev.embedded import EmbeddedError, EmbeddedPostgres, default_data_dir
from ..dev.embedded.attached import attached_workers
from . import exits
from .common import CliError, resolve_dsn
from .text import safe


def dsn_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--show-password",
        action="store_true",
        help="print the password too (by default it is replaced by ***)",
    )
    p.set_defaults(func=cmd_dsn)


def embedded_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("action", choices=["start", "stop", "status"])
    p.set_defaults(func=cmd_embedded)


def cmd_dsn(args: argparse.Namespace) -> int:
    dsn = resolve_dsn(args.dsn, quiet=True)
    print(dsn if args.show_password else redact(dsn))
    return 0


def cmd_embedded(args: argparse.Namespace) -> int:
    """start, stop or status. A failure is one line and exit 2, as for the embedded server that
    a command without a DSN cannot start: there is no PostgreSQL to run (the ``embedded`` extra
    is not installed), or the server would not start or stop (the cause from its log)."""
    try:
        return _embedded(args)
    except EmbeddedError as exc:
        raise CliError(str(exc), exits.USAGE) from None


def _embedded(args: argparse.Namespace) -> int:
    data_dir = default_data_dir()
    server = EmbeddedPostgres(data_dir)
    if args.action == "stop":
        if not server.is_running():
            # Stopping a stopped server is done already: say so, not "stopped".
            print(f"the embedded PostgreSQL in {data_dir} is not running")
            return 0
        _warn_attached_workers(server.dsn)
        server.stop()
        print(f"stopped the embedded PostgreSQL in {data_dir}")
    elif args.action == "start":
        print(server.start())
    else:
        running = server.is_running()
        print(f"{'running' if running else 'stopped'}: {data_dir}")
        return exits.OK if running else exits.NO  # as `systemctl status`: non-zero when stopped
    return exits.OK


def _warn_attached_workers(dsn: str) -> None:
    """One line on stderr when worker processes are connected: stopping the server leaves them
    retrying their connection (their tasks come back once it runs again and leases lapse)."""
    try:
        rows = attached_workers(dsn)
    except psycopg.Error:
        return  # stopping is still the right thing to do; pg_ctl says what it finds
    if rows:
        total = sum(n for _, n in rows)
        where = ", ".join(f"{n} on database {safe(db)}" for db, n in rows)
        print(
            f"worker: warning: {total} worker process(es) are attached ({where}); they will "
            "retry their connections until the server runs again: stop them first "
            "(Ctrl-C or SIGTERM) to end them cleanly",
            file=sys.stderr,
        )
