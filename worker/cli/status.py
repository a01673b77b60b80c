"""``worker status``: queues, workers and recent failures (one task with ``--id``: task.py; one
workflow with ``--workflow``: workflow.py)."""

from __future__ import annotations

import argparse

from ..coord import pause as _pause
from ..ops import status as _admin
from ..ops.status import STATES, status
from ..tasks import limits as _limits
from . import limits as limits_cli
from .args import TASK_ID, int_in
from .common import age, connect, print_json, require, table
from .task import cmd_task
from .text import LINE_LIMIT, quoted, safe
from .workflow import cmd_workflow


def status_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--id", type=TASK_ID, default=None, help="show this task, with its error history"
    )
    p.add_argument(
        "--workflow",
        type=TASK_ID,
        default=None,
        help="show this workflow: its steps, their states, times and errors",
    )
    p.add_argument(
        "--failed", type=int_in(0, 1000), default=10, help="how many recent failures to list"
    )
    p.set_defaults(func=cmd_status)


def _count(q: _admin.QueueStatus, state: str) -> str:
    """Exact; or, past the cap, ≈ the planner's estimate (when it is above the cap) or ≥ the
    lower bound."""
    n = q.counts.get(state, 0)
    if state not in q.capped:
        return f"{n:,}"
    guess = q.estimates.get(state)
    return f"≈{guess:,}" if guess is not None and guess > n else f"≥{n:,}"


def cmd_status(args: argparse.Namespace) -> int:
    if getattr(args, "id", None) is not None:
        return cmd_task(args)
    if getattr(args, "workflow", None) is not None:
        return cmd_workflow(args)
    with connect(args) as conn:
        require(conn, args.schema)
        st = status(conn, args.schema, failed_limit=args.failed)
        paused = {p.queue: p for p in _pause.paused(conn, args.schema)}
        limited = _limits.list_limits(conn, args.schema)
    if args.json:
        print_json(
            {
                **st.as_dict(),
                "paused": [
                    {"queue": p.queue, "paused_at": p.paused_at, "paused_by": p.paused_by}
                    for p in paused.values()
                ],
                "limits": [limits_cli.as_dict(q) for q in limited],
            }
        )
        return 0
    # Workflow steps waiting for their dependencies: a column only where there are some.
    shown = [s for s in STATES if s != "waiting" or any(_count(q, s) != "0" for q in st.queues)]
    head = ["queue", *(s.replace("_", " ") for s in shown), "oldest due", "live worker"]
    rows = [
        [
            q.queue + (" (paused)" if q.queue in paused else ""),
            *(_count(q, s) for s in shown),
            age(q.oldest_seconds),
            "yes" if q.served else "none",
        ]
        for q in st.queues
    ]
    table(head, rows or [["(no tasks)"] + [""] * (len(head) - 1)])
    if any(q.capped for q in st.queues):
        print(
            f"(counts stop at {st.cap:,}: ≈ is the planner's estimate beyond, ≥ the count where "
            "the estimate is lower)"
        )
    if st.truncated_after is not None:
        print(
            f"(too many queue names: the queues after {safe(quoted(st.truncated_after))} "
            "are not listed)"
        )
    if paused:
        print()
        print("paused queues (workers claim nothing from them; `worker resume QUEUE`)")
        for p in paused.values():
            when = p.paused_at.strftime("%Y-%m-%d %H:%M:%S")
            print(f"  {safe(quoted(p.queue))} since {when} by {safe(p.paused_by)}")
    if limited:
        print()
        print("limited queues (fleet-wide; `worker limits set QUEUE ...` changes them)")
        limits_cli.print_limits(limited)
    advice = st.routing.advice(quoted)
    if advice:
        print()
        print("work no live worker will do")
        for line in advice:
            print(f"  {safe(line, LINE_LIMIT)}")
    print()
    alive = st.routing.workers_alive
    print(f"workers ({len(st.workers)} registered, {alive} alive)")
    if st.workers:
        table(
            ["id", "host", "pid", "started", "heartbeat", "in flight", "queues"],
            [
                [
                    str(w["id"])[:8],
                    w["host"],
                    str(w["pid"]),
                    w["started_at"].strftime("%Y-%m-%d %H:%M:%S"),
                    age(w["heartbeat_age_seconds"]) + " ago",
                    str(w["in_flight"]),
                    ",".join(w["queues"]),
                ]
                for w in st.workers
            ],
        )
    if st.failed:
        print()
        print(f"recent failed tasks (newest first, up to {args.failed})")
        for f in st.failed:
            first = (f["last_error"] or "").splitlines()[0] if f["last_error"] else ""
            print(
                f"  #{f['id']} {safe(f['task'])} [{safe(f['queue'])}] after {f['attempts']} "
                f"attempt(s): {safe(first, 160)}"
            )
    return 0
