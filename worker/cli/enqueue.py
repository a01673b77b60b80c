"""``worker enqueue``: one task from the command line, its payload inline, from a file or from
stdin."""

from __future__ import annotations

import argparse
import json
import sys
from datetime import datetime

import psycopg

from ..errors import SchemaMissing
from ..tasks import routes
from ..tasks.enqueue import enqueue
from .args import ATTEMPTS, PRIORITY, seconds
from .common import CliError, connect, print_json, require
from .text import quoted

MAX_PAYLOAD = 64 * 1024 * 1024


def enqueue_arguments(p: argparse.ArgumentParser) -> None:
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


def _payload_text(spec: str) -> str:
    """--payload JSON, @FILE or - (stdin): large payloads need not fit on a command line."""
    if spec != "-" and not spec.startswith("@"):
        return spec
    where = "stdin" if spec == "-" else repr(spec[1:])
    try:
        if spec == "-":
            data = sys.stdin.buffer.read(MAX_PAYLOAD + 1)
        else:
            with open(spec[1:], "rb") as fh:
                data = fh.read(MAX_PAYLOAD + 1)
    except OSError as exc:
        raise CliError(f"--payload: cannot read {where}: {exc.strerror}", 2) from None
    if len(data) > MAX_PAYLOAD:
        raise CliError(f"--payload: {where} holds more than {MAX_PAYLOAD} bytes", 2)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise CliError(f"--payload: {where} is not UTF-8 (byte {exc.start})", 2) from None


def cmd_enqueue(args: argparse.Namespace) -> int:
    if not args.name:
        raise CliError("the task name must not be empty", 2)
    if args.queue == "":
        raise CliError("--queue must not be empty", 2)
    try:
        payload = json.loads(_payload_text(args.payload))
    except json.JSONDecodeError as exc:
        raise CliError(f"--payload is not valid JSON: {exc.msg} at position {exc.pos}", 2) from None
    except RecursionError:
        raise CliError("--payload is nested too deeply", 2) from None
    run_at = None
    if args.run_at:
        try:
            run_at = datetime.fromisoformat(args.run_at)
        except ValueError:
            raise CliError(f"--run-at is not an ISO timestamp: {args.run_at!r}", 2) from None
        if args.delay is not None:
            raise CliError("give --run-at or --delay, not both", 2)
        if run_at.tzinfo is None:
            raise CliError("--run-at needs a time zone, e.g. 2026-01-01T09:00:00+00:00", 2)
    with connect(args) as conn:
        # No version check first: it reads the migration table, which the producer role of
        # deploy/sql/roles.sql may not read. Enqueueing is one call of the SQL function; a
        # schema without it raises SchemaMissing, made precise below (which version it is at).
        try:
            task_id = enqueue(
                conn,
                args.name,
                payload,
                queue=args.queue,
                run_at=run_at,
                delay=args.delay,
                priority=args.priority,
                max_attempts=args.max_attempts,
                dedupe_key=args.dedupe_key,
                schema=args.schema,
            )
        except SchemaMissing:
            require(conn, args.schema)  # says which: no tables, or an old version
            raise
        if not args.quiet:
            _warn_unrouted(conn, args.schema, args.name)
    if args.json:
        print_json({"id": task_id})
    else:
        print(task_id)
    return 0


def _warn_unrouted(conn: psycopg.Connection, schema: str, task: str) -> None:
    """One line on stderr when no worker has ever declared ``task``: its row waits in the default
    queue until one does (a typo waits for ever). A role that may not read the routes skips it."""
    try:
        with conn.transaction():
            known = routes.routed(conn, schema, task)
    except psycopg.errors.InsufficientPrivilege:
        return
    if not known:
        print(
            f"worker: warning: no worker has declared task {quoted(task)}: it waits in the "
            "default queue until one does (a typo? `worker migrate --module MODULE` records "
            "your tasks' queues ahead of their workers; --quiet silences this)",
            file=sys.stderr,
        )
