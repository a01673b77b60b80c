"""``worker migrate``: create or upgrade the queue schema, and record the queues of a module's
tasks ahead of their workers."""

from __future__ import annotations

import argparse

from ..db.migrate import migrate
from ..tasks import routes
from ..tasks.registry import registry
from .common import CliError, connect, import_tasks, print_json
from .text import safe


def migrate_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--module",
        help="also record the queue of each task MODULE registers, as its workers will when they "
        "start: tasks enqueued before any worker has started then land in the right queue",
    )
    p.set_defaults(func=cmd_migrate)


def cmd_migrate(args: argparse.Namespace) -> int:
    declared: dict[str, str] = {}
    if args.module:
        import_tasks(args.module)
        declared = routes.of(registry)
        if not declared:
            raise CliError(f"module {args.module!r} registers no task", 2)
    with connect(args) as conn:
        applied = migrate(conn, args.schema)
        routes.record(conn, args.schema, declared)
    if args.json:
        print_json({"applied": applied, "routes": declared})
        return 0
    if applied:
        print(f"applied {len(applied)} migration(s) to schema {args.schema}: {', '.join(applied)}")
    else:
        print(f"schema {args.schema} is up to date")
    if declared:
        where = ", ".join(f"{safe(t)} -> {safe(q)}" for t, q in sorted(declared.items())[:10])
        more = f" and {len(declared) - 10} more" if len(declared) > 10 else ""
        print(f"recorded the queues of {len(declared)} task(s): {where}{more}")
    return 0
