"""`worker wait ID`: block until a task finishes and print its result (see worker/tasks/wait.py).

Exit codes: 0 done (the result's JSON on stdout, ``null`` when the task stores none), 1 failed,
cancelled or no such task (one line on stderr), 2 usage or configuration, 3 timeout.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from ..errors import TaskCancelled, TaskFailed, TaskNotFound, WaitTimeout
from ..tasks import wait as _wait
from .args import TASK_ID, seconds_in
from .common import CliError, connect_dsn, require, resolve_dsn, starts

EXIT_FAILED = 1
EXIT_TIMEOUT = 3


def _print(data: Any) -> None:
    # ensure_ascii: no control or bidi character of a result reaches the terminal raw.
    print(json.dumps(data, ensure_ascii=True))


def cmd_wait(args: argparse.Namespace) -> int:
    dsn = resolve_dsn(args.dsn, quiet=args.json, start=starts(args))
    with connect_dsn(dsn) as conn:
        require(conn, args.schema)
    try:
        # Given the DSN, the wait makes a connection that prepares no statement (a long
        # wait reads the row again and again), which PgBouncer's transaction mode needs.
        result = _wait.wait(
            dsn,
            args.id,
            timeout=args.timeout,
            schema=args.schema,
            poll_interval=args.poll_interval,
            listen=not args.no_listen,
        )
    except (TaskFailed, TaskCancelled, TaskNotFound) as exc:
        if not args.json:
            raise CliError(str(exc), EXIT_FAILED) from None
        state = {TaskFailed: "failed", TaskCancelled: "cancelled"}.get(type(exc), "missing")
        error = exc.error if isinstance(exc, TaskFailed) else str(exc)
        _print({"id": args.id, "state": state, "error": error})
        return EXIT_FAILED
    except WaitTimeout as exc:
        if not args.json:
            raise CliError(str(exc), EXIT_TIMEOUT) from None
        _print({"id": args.id, "state": "timeout", "error": str(exc)})
        return EXIT_TIMEOUT
    _print({"id": args.id, "state": "done", "result": result} if args.json else result)
    return 0


def wait_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("id", type=TASK_ID, help="the task's id")
    p.add_argument(
        "--timeout",
        type=seconds_in(0, 10 * 365 * 86400.0),
        default=None,
        help="give up after this many seconds (exit 3; default: wait as long as it takes)",
    )
    p.add_argument(
        "--poll-interval",
        type=seconds_in(0.01, 3600),
        default=1.0,
        help="seconds between reads when no notification comes (default 1)",
    )
    p.add_argument(
        "--no-listen",
        action="store_true",
        help="poll only (behind PgBouncer in transaction mode, where LISTEN hears nothing)",
    )
    p.set_defaults(func=cmd_wait)
