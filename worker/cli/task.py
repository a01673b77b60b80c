"""`worker status --id ID`: one task in detail, with the errors of its last attempts."""

from __future__ import annotations

import argparse
import json
from datetime import datetime
from typing import Any

from ..ops import status as _admin
from .common import CliError, connect, print_json, require
from .text import LINE_LIMIT, safe

PAYLOAD_CHARS = 500
ERROR_LINES = 20  # lines of the last error shown (a traceback's tail is what matters)


def _when(value: datetime | None) -> str:
    return "-" if value is None else value.strftime("%Y-%m-%d %H:%M:%S %Z").strip()


def _at(entry: dict[str, Any]) -> str:
    """An error entry's time, as the database wrote it (ISO), shown to the second."""
    text = str(entry.get("at") or "")
    try:
        return _when(datetime.fromisoformat(text))
    except ValueError:
        return safe(text, 40)


def cmd_task(args: argparse.Namespace) -> int:
    with connect(args) as conn:
        require(conn, args.schema)
        task = _admin.get_task(conn, args.schema, args.id)
    if task is None:
        raise CliError(f"task {args.id} does not exist")
    if args.json:
        print_json(task)
        return 0
    print(f"task #{task['id']} {safe(task['task'])} [{safe(task['queue'])}]")
    limit = "the handler's" if task["max_attempts"] is None else str(task["max_attempts"])
    rows = [
        ("state", f"{task['state']} (attempt {task['attempts']} of {limit})"),
        ("priority", str(task["priority"])),
        ("created", _when(task["created_at"])),
        ("run at", _when(task["run_at"])),
        ("started", _when(task["started_at"])),
        ("finished", _when(task["finished_at"])),
        ("lease until", _when(task["lease_expires_at"])),
        ("worker", str(task["worker_id"] or "-")),
        ("dedupe key", safe(task["dedupe_key"]) if task["dedupe_key"] is not None else "-"),
        ("payload", safe(json.dumps(task["payload"]), PAYLOAD_CHARS)),
    ]
    for name, value in rows:
        print(f"  {name:<12} {value}")
    if task["last_error"]:
        lines = task["last_error"].splitlines()
        cut = len(lines) > ERROR_LINES
        print("  last error" + (f" (its last {ERROR_LINES} lines)" if cut else ""))
        for line in lines[-ERROR_LINES:]:
            print(f"    {safe(line, LINE_LIMIT)}")
    errors = task["errors"] or []
    if errors:
        print(f"error history (the last {len(errors)} attempt(s), oldest first)")
        for e in errors:
            first = (str(e.get("error") or "").splitlines() or [""])[0]
            worker = str(e.get("worker_id") or "-")[:8]
            counted = "" if e.get("counted", True) else " (not counted)"
            print(
                f"  attempt {e.get('attempt')}{counted}  {_at(e)}  worker {safe(worker)}: "
                f"{safe(first, 200)}"
            )
    return 0
