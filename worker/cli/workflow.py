"""`worker status --workflow ID`: one workflow, its counts by state and its steps."""

from __future__ import annotations

import argparse

from ..ops import workflows as _workflows
from .common import CliError, connect, print_json, require, table
from .text import safe


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}s"


def cmd_workflow(args: argparse.Namespace) -> int:
    with connect(args) as conn:
        require(conn, args.schema)
        wf = _workflows.workflow_status(conn, args.schema, args.workflow)
    if wf is None:
        raise CliError(f"workflow {args.workflow} does not exist")
    if args.json:
        print_json(wf.as_dict())
        return 0
    name = f" {safe(wf.name)!r}" if wf.name else ""
    state = "finished" if wf.finished else "running"
    counts = ", ".join(f"{n:,} {s}" for s, n in sorted(wf.counts.items()))
    print(f"workflow #{wf.id}{name}: {state}, {wf.total:,} steps ({counts or 'none'})")
    rows = [
        [
            str(s.id),
            safe(s.task, 60),
            s.state + (f" ({s.pending} left)" if s.state == "waiting" and s.pending else ""),
            str(s.attempts),
            ",".join(map(str, s.depends_on[:5])) + (" ..." if len(s.depends_on) > 5 else "") or "-",
            _seconds(s.seconds),
            safe((s.last_error or "").splitlines()[0], 80) if s.last_error else "",
        ]
        for s in wf.steps
    ]
    table(["step", "task", "state", "attempts", "after", "took", "error"], rows)
    if wf.total > len(wf.steps):
        print(f"(the first {len(wf.steps):,} steps of {wf.total:,})")
    return 0


__all__ = ["cmd_workflow"]
