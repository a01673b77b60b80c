"""``worker retry ID`` (or ``--failed``) and ``worker cancel ID``: one task by its id (filters are
bulk.py's)."""

from __future__ import annotations

import argparse

from ..ops import actions as _actions
from ..ops import bulk as _bulk
from .common import CliError, connect, print_json, require


def cmd_retry(args: argparse.Namespace) -> int:
    if args.id is None and not args.failed:
        raise CliError("give a task id or --failed", 2)
    with connect(args) as conn:
        require(conn, args.schema)
        if args.failed:
            done = _bulk.retry_failed(conn, args.schema, args.queue)
            if args.json:
                print_json(done.as_dict())
                return 0
            print(f"requeued {done.requeued} failed task(s)")
            if done.skipped:
                ids = ", ".join(f"#{i}" for i in done.skipped_ids)
                more = ", ..." if done.skipped > len(done.skipped_ids) else ""
                print(
                    f"skipped {done.skipped} whose dedupe key a scheduled, queued or running task "
                    f"holds ({ids}{more}): they stay failed; retry them once that task is done"
                )
            return 0
        one = _actions.retry(conn, args.schema, [args.id])
        if one.skipped:
            raise CliError(
                f"task {args.id} was not requeued: its dedupe key is held by a scheduled, queued "
                "or running task"
            )
        if not one.changed:
            raise CliError(f"task {args.id} is not failed or cancelled (or does not exist)")
        print(f"requeued task {args.id}")
    return 0


def cmd_cancel(args: argparse.Namespace) -> int:
    """One line saying what happened; exit 1 when nothing could be cancelled."""
    with connect(args) as conn:
        require(conn, args.schema)
        done = _actions.cancel_one(conn, args.schema, args.id, by=args.actor)
    if args.json:
        print_json(done.as_dict())
        return 0 if done.outcome in ("cancelled", "requested") else 1
    if done.outcome == "cancelled":
        print(f"cancelled task {args.id} (it had not started)")
    elif done.outcome == "requested":
        print(f"cancel requested for task {args.id}: it is running, its worker will stop it")
    elif done.outcome == "finished":
        raise CliError(f"task {args.id} was not cancelled: it is {done.state} already")
    else:
        raise CliError(f"task {args.id} was not cancelled: there is no such task")
    return 0
