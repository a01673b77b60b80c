"""``worker cron``: the schedules declared in a module and kept in the database, with their
last and next runs."""

from __future__ import annotations

import argparse
from datetime import UTC, datetime

from ..coord.cron import Schedule, cron_rows, schedules
from .common import connect, import_tasks, print_json, require, table


def _fmt_time(value: datetime | None) -> str:
    if value is None:
        return "-"
    return value.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S") + "Z"


def cmd_cron(args: argparse.Namespace) -> int:
    declared: list[Schedule] = []
    if args.module:
        import_tasks(args.module)
        declared = list(schedules)
    with connect(args) as conn:
        require(conn, args.schema)
        rows = cron_rows(conn, args.schema, declared)
    if args.json:
        print_json({"schedules": rows})
        return 0
    if not rows:
        where = f"module {args.module!r} or " if args.module else ""
        print(f"no cron schedules in {where}schema {args.schema}")
        return 0
    table(
        ["schedule", "expr", "tz", "task", "queue", "catch-up", "last run", "state", "next run"],
        [
            [
                r["key"],
                r["expr"],
                r["tz"],
                r["task"],
                r["queue"],
                r["catch_up"],
                _fmt_time(r["last_run_slot"] or r["last_slot"]),
                r["last_run_state"] or "-",
                _fmt_time(r["next_slot"]),
            ]
            for r in rows
        ],
    )
    return 0


def cron_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "module",
        nargs="?",
        help="module (dotted name or .py path) declaring schedules; default: the database's list",
    )
    p.set_defaults(func=cmd_cron)
