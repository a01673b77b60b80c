"""``worker pause QUEUE`` and ``worker resume QUEUE``: fleet-wide, through the database (see
worker/coord/pause.py). A pause holds from the moment it commits and survives worker restarts; tasks
already running finish."""

from __future__ import annotations

import argparse
import getpass
import socket
from typing import Any

from ..coord import pause as _pause
from .common import CliError, connect, print_json, require
from .text import safe


def _queue(text: str) -> str:
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
        changed = _pause.pause(conn, args.schema, args.queue, by)
    if args.json:
        print_json({"queue": args.queue, "paused": True, "changed": changed})
    elif changed:
        print(f"paused queue {safe(args.queue)}: workers claim nothing from it until resumed")
    else:
        print(f"queue {safe(args.queue)} was paused already")
    return 0


def cmd_resume(args: argparse.Namespace) -> int:
    with connect(args) as conn:
        require(conn, args.schema)
        changed = _pause.resume(conn, args.schema, args.queue)
    if args.json:
        print_json({"queue": args.queue, "paused": False, "changed": changed})
    elif changed:
        print(f"resumed queue {safe(args.queue)}")
    else:
        raise CliError(f"queue {safe(args.queue)} is not paused")
    return 0


def add_cli(sub: Any, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser(
        "pause", parents=[common], help="pause a queue fleet-wide (running tasks finish)"
    )
    p.add_argument("queue", type=_queue)
    p.add_argument("--by", default=None, help="who pauses, for the record (default: OS user@host)")
    p.set_defaults(func=cmd_pause)
    p = sub.add_parser("resume", parents=[common], help="resume a paused queue")
    p.add_argument("queue", type=_queue)
    p.set_defaults(func=cmd_resume)
