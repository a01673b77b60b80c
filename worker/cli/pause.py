"""``worker pause QUEUE`` and ``worker resume QUEUE``: fleet-wide, through the database (see
worker/coord/pause.py). A pause holds from the moment it commits and survives worker restarts; tasks
already running finish. Both are recorded in the record of operator actions. Pausing a queue that
nothing has named yet (a typo?) pauses it all the same, with a warning on stderr."""

from __future__ import annotations

import argparse
import getpass
import socket
import sys

import psycopg

from ..coord import pause as _pause
from ..ops.audit import default_actor, record_action
from .common import CliError, connect, print_json, require
from .text import LINE_LIMIT, safe


def queue_name(text: str) -> str:
    """A flag type: a queue name (1 to MAX_QUEUE_CHARS characters)."""
    if not text or len(text) > _pause.MAX_QUEUE_CHARS:
        raise argparse.ArgumentTypeError(
            f"a queue name is 1 to {_pause.MAX_QUEUE_CHARS} characters"
        )
    return text


def _operator() -> str:
    """Who paused: the OS user and host, as an audit trail needs, never a credential."""
    try:
        user = getpass.getuser()
    except (KeyError, OSError):
        user = "unknown"
    return f"{user}@{socket.gethostname()}"


def cmd_pause(args: argparse.Namespace) -> int:
    by = args.by if args.by is not None else _operator()
    with connect(args) as conn:
        require(conn, args.schema)
        warned: list[str] = []  # a queue nothing has named yet: paused, with a warning
        with conn.transaction():
            changed = _pause.pause(conn, args.schema, args.queue, by, warn=warned)
            _record(conn, args, "pause", by, changed)
    for warning in warned:
        print(f"worker: warning: {safe(warning, LINE_LIMIT)}", file=sys.stderr)
    if args.json:
        print_json({"queue": args.queue, "paused": True, "changed": changed, "known": not warned})
    elif changed:
        print(f"paused queue {safe(args.queue)}: workers claim nothing from it until resumed")
    else:
        print(f"queue {safe(args.queue)} was paused already")
    return 0


def cmd_resume(args: argparse.Namespace) -> int:
    with connect(args) as conn:
        require(conn, args.schema)
        with conn.transaction():
            changed = _pause.resume(conn, args.schema, args.queue)
            if changed:
                _record(conn, args, "resume", default_actor(), changed)
    if args.json:
        print_json({"queue": args.queue, "paused": False, "changed": changed})
    elif changed:
        print(f"resumed queue {safe(args.queue)}")
    else:
        raise CliError(f"queue {safe(args.queue)} is not paused")
    return 0


def _record(
    conn: psycopg.Connection, args: argparse.Namespace, action: str, by: str, changed: bool
) -> None:
    """The pause or resume in the record of operator actions, as the console records its own
    (which is also how a later pause knows the queue was named before)."""
    record_action(
        conn,
        args.schema,
        actor=by or default_actor(),
        action=action,
        filter={"queue": args.queue},
        counts={"changed": int(changed)},
        source="cli",
    )


def pause_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("queue", type=queue_name)
    p.add_argument("--by", default=None, help="who pauses, for the record (default: OS user@host)")
    p.set_defaults(func=cmd_pause)


def resume_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("queue", type=queue_name)
    p.set_defaults(func=cmd_resume)
