"""The overview: one set of panels, shown by the console at /console/ and by the status page at /,
the same figures in both; only the console adds actions (a Resume button beside a paused queue
for a signed-in operator).

Each panel shows its data first; what it means is behind its "?" (``layout.panel``).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlencode

from ...coord.pause import PausedQueue
from ...engine import rollup
from ...tasks.limits import QueueLimits, describe_rate
from ..bounds import clip
from ..readmodel import PageData
from .charts import depth_chart, throughput_chart, wait_charts
from .health import render_doctor_panel
from .layout import panel
from .markup import esc, num, stamp, table, when
from .sections import (
    QUEUES_HELP,
    WORKERS_HELP,
    banners,
    cards,
    cron_section,
    failed_table,
    locks_section,
    queue_table,
    routing,
    workers_count,
    workers_table,
)
from .trends import WAIT_QUEUES, Throughput, Trends

ROUTING_HELP = (
    "Queues with due tasks that no live worker serves, and tasks that no live worker has a "
    "handler for: nothing will run them until such a worker starts. A worker is live while its "
    "heartbeat is recent."
)
DEPTH_HELP = (
    "Once a minute, a few seconds after it ends, one of the workers (whichever comes first) "
    "records how many tasks are due and waiting to start (queued) and how many run (in "
    "progress), for the fleet and per queue, in <code>stats_minutes</code> and "
    "<code>queue_minutes</code>. Every server that shows this chart reads the same rows. A gap "
    f"means no worker was running then. The queued count stops at {rollup.TOTAL_CAP:,} (≥)."
)
WAIT_HELP = (
    "For each queue, of the tasks that finished in each minute (done, or failed for good), how "
    "long their last attempt waited from the moment it was due to its start (from "
    "<code>run_at</code> to <code>started_at</code>): the median (p50) and the 99th percentile "
    "(p99). Recorded by the workers with the queue depth, from at most "
    f"{rollup.WAIT_SAMPLE:,} tasks of each outcome a minute. The {WAIT_QUEUES} queues with the "
    "most tasks measured in the last hour are shown. With <code>--keep-done 0</code> done rows "
    "are deleted as they finish and are not measured."
)
PAUSED_HELP = (
    "A paused queue is recorded in the database for the whole fleet: workers start no new task "
    "from it until it is resumed (<code>worker resume QUEUE</code>, or the console's Queues "
    "page); tasks already running finish."
)
LIMITS_HELP = (
    "Fleet-wide limits of the queues that have them (<code>worker limits set QUEUE ...</code> "
    "changes them within a second), with the tasks of each queue that run and wait now (counts "
    "stop at 10,000) and who set them."
)
FAILED_HELP = (
    "The newest tasks that failed for good (their last attempt failed, or they ran out of "
    "attempts), kept for <code>--keep-failed</code>. Each id opens the task in the console, "
    "where it can be retried."
)
CRON_HELP = (
    "The schedules of <code>cron_schedules</code>, with the state of each one's latest run (read "
    "from the task table) and its next slot, then the latest run of each cron key."
)
LOCKS_HELP = (
    "The rows of <code>locks</code> (<code>@exclusive</code> jobs, mutexes, time-outs) and the "
    "advisory locks held in this database by any session, named when they are the worker's own."
)
AUDIT_HELP = (
    "The newest operator actions, from the console, the command line or SQL: who (the name "
    "given at sign-in), from which address, what, on what, and how many rows it changed. Each "
    "is recorded in the transaction of the action itself."
)


def jobs_link(queue: str = "", state: str = "", **more: str) -> str:
    """The console's job browser, filtered."""
    fields = {"queue": queue, "state": state, **more}
    return "/console/jobs?" + urlencode({k: v for k, v in fields.items() if v})


def task_link(task_id: int) -> str:
    """A task's page in the console."""
    return f"/console/jobs/{int(task_id)}"


@dataclass
class Overview:
    """Everything the overview shows, read once for a page."""

    page: PageData
    throughput: Throughput
    trends: Trends
    paused: list[PausedQueue]
    audit: list[tuple[Any, ...]]
    queues_page: int = 1


@dataclass
class Places:
    """Where the overview's links go, and the actions it may offer."""

    pager_href: str  # the queue table's pages, with {n}
    jobs: Callable[[str, str], str]  # the job browser for (queue, state)
    task: Callable[[int], str]  # a task's page
    resume: Callable[[str], str] | None = None  # a queue's Resume button (signed in)


def throughput_section(tp: Throughput) -> str:
    if tp.error:
        return f'<div class="banner">throughput unavailable: {esc(tp.error)}</div>'
    capped = any(m.done >= tp.cap or m.failed >= tp.cap for m in tp.minutes)
    mark = "≥" if capped else ""
    done = sum(m.done for m in tp.minutes)
    failed = sum(m.failed for m in tp.minutes)
    last = tp.minutes[-2] if len(tp.minutes) >= 2 else None  # the last full minute
    parts = [
        f'<p class="summary" id="throughput-summary">Last hour: <b data-value="done-hour">{mark}'
        f'{num(done)}</b> done, <b data-value="failed-hour" class="{"bad" if failed else ""}">'
        f"{mark}{num(failed)}</b> failed for good"
    ]
    if last is not None:
        parts.append(
            f"; last full minute ({esc(when(last.at)[11:16])} UTC): {num(last.done)} done, "
            f"{num(last.failed)} failed"
        )
    parts.append(".</p>")
    parts.append(throughput_chart(tp))
    if tp.pending:
        parts.append(
            f'<p class="note">{tp.pending} older minute(s) not counted yet: they are added over '
            "the next refreshes, a few at a time.</p>"
        )
    rows = [
        f'<tr><td>{esc(when(m.at)[11:16])}</td><td class="n">{num(m.done)}</td>'
        f'<td class="n">{num(m.failed)}</td></tr>'
        for m in reversed(tp.minutes)
    ]
    parts.append(
        '<details class="data"><summary>per minute</summary>'
        + table(["minute (UTC)", "done", "failed"], rows, empty="nothing counted yet")
        + "</details>"
    )
    return "".join(parts)


def throughput_help(tp: Throughput) -> str:
    return (
        "Tasks finished per minute over the last hour: done, and failed for good (retries are "
        "not counted). Counted by the database from the finished rows the workers keep "
        "(<code>--keep-done</code>, <code>--keep-failed</code>), so every server shows the same "
        f"numbers; each minute is counted up to {tp.cap:,} (≥ past it). With "
        "<code>--keep-done 0</code> done rows are deleted at once and are not counted here."
    )


def depth_section(trends: Trends) -> str:
    if trends.error:
        return f'<div class="banner">queue depth unavailable: {esc(trends.error)}</div>'
    latest = trends.depth[-1] if trends.depth else None
    if latest is None:
        summary = (
            '<p class="summary">No minute recorded in the last hour: the workers record one a '
            "minute while any of them runs.</p>"
        )
    else:
        summary = (
            f'<p class="summary">Latest sample, {stamp(latest.at)}: <b data-value="depth-queued">'
            f"{'≥' if latest.queued_capped else ''}{num(latest.queued)}</b> queued, "
            f'<b data-value="depth-in-progress">{num(latest.in_progress)}</b> in progress.</p>'
        )
    return summary + depth_chart(trends)


def wait_section(trends: Trends) -> str:
    if trends.error:
        return f'<div class="banner">wait times unavailable: {esc(trends.error)}</div>'
    return wait_charts(trends)


def limits_table(limits: list[QueueLimits]) -> str:
    """Each limited queue: its limits, and how many run and wait now (counts stop at 10,000)."""

    def cell(value: object) -> str:
        return f"<td>{esc('-' if value is None else str(value))}</td>"

    rows = "".join(
        f'<tr data-limited="{esc(clip(q.queue, 255))}"><td>{esc(clip(q.queue, 255))}</td>'
        + cell(q.limits.concurrency)
        + cell(q.limits.key_concurrency)
        + cell(describe_rate(q.limits.rate))
        + cell(describe_rate(q.limits.key_rate))
        + f'<td data-col="running">{q.running}</td><td data-col="waiting">{q.waiting}</td>'
        + cell("code" if q.source == "code" else clip(q.updated_by, 200))
        + "</tr>"
        for q in limits
    )
    return (
        "<table><thead><tr><th>queue</th><th>concurrency</th>"
        "<th>per key</th><th>rate</th><th>per key rate</th><th>running</th><th>waiting</th>"
        f"<th>set by</th></tr></thead><tbody>{rows}</tbody></table>"
    )


def paused_table(paused: list[PausedQueue], resume: Callable[[str], str] | None = None) -> str:
    rows = []
    for p in paused:
        action = f"<td>{resume(p.queue)}</td>" if resume is not None else ""
        rows.append(
            f'<tr data-paused="{esc(p.queue)}"><td>{esc(p.queue)}</td>'
            f"<td>{stamp(p.paused_at)}</td><td>{esc(p.paused_by)}</td>{action}</tr>"
        )
    head = ["queue", "paused at", "paused by"]
    if resume is not None:
        head.append("")
    return table(head, rows, empty="no queue is paused")


def audit_table(rows: list[tuple[Any, ...]]) -> str:
    body = [
        f"<tr><td>{stamp(at)}</td><td>{esc(actor)}</td><td>{esc(address)}</td>"
        f"<td>{esc(action)}</td><td><code>{esc(json.dumps(target, sort_keys=True), 300)}"
        "</code></td>"
        f'<td class="n">{num(affected)}'
        + (f' <span class="note">(interrupted by {esc(stopped)})</span>' if stopped else "")
        + "</td></tr>"
        for _id, at, actor, address, action, target, affected, stopped in rows
    ]
    return table(["when", "who", "from", "action", "on", "rows"], body, empty="no action yet")


def as_of(page: PageData, expected_version: int, ttl: float) -> str:
    return (
        f'<p class="as-of">Data as of {stamp(page.wall)}, read at most every {ttl:g} s · schema '
        f"version {esc(page.version or '?')} (this code expects {esc(expected_version)})</p>"
    )


def overview_body(
    o: Overview, places: Places, *, schema: str, expected_version: int, ttl: float
) -> str:
    """Every panel of the overview, in order, as the content of ``<main>``."""
    page, snap = o.page, o.page.snapshot
    extra = ((num(len(o.paused)), "paused queues"),)
    head = (
        '<section class="panel panel-cards" id="panel-cards">'
        f'<div id="live-cards" data-live>{banners(page)}{cards(page, extra)}'
        f"{as_of(page, expected_version, ttl)}</div></section>"
    )
    charts = (
        '<div class="charts">'
        + panel(
            "throughput",
            "Throughput",
            throughput_section(o.throughput),
            help=throughput_help(o.throughput),
        )
        + panel("depth", "Queue depth", depth_section(o.trends), help=DEPTH_HELP)
        + "</div>"
        + panel("waits", "Wait time per queue", wait_section(o.trends), help=WAIT_HELP)
    )
    queues = queue_table(page, o.queues_page, link=places.jobs, pager_href=places.pager_href)
    parts = [
        head,
        panel("routing", "Work no live worker will do", routing(snap), help=ROUTING_HELP),
        charts,
        panel("queues", "Queues", queues, help=QUEUES_HELP),
        panel("paused", "Paused queues", paused_table(o.paused, places.resume), help=PAUSED_HELP),
    ]
    if snap.limits:
        parts.append(panel("limits", "Limited queues", limits_table(snap.limits), help=LIMITS_HELP))
    parts += [
        panel(
            "workers", "Workers", workers_count(page) + workers_table(page), help=WORKERS_HELP
        ),
        panel("failed", "Recent failed tasks", failed_table(page, link=places.task),
              help=FAILED_HELP),
        render_doctor_panel(page.health),
        panel("cron", "Cron", cron_section(page, schema), help=CRON_HELP),
        panel("locks", "Locks", locks_section(page, schema), help=LOCKS_HELP),
        panel("audit", "Recent operator actions", audit_table(o.audit), help=AUDIT_HELP),
    ]  # fmt: skip
    return "".join(parts)


__all__ = [
    "Overview",
    "Places",
    "audit_table",
    "jobs_link",
    "limits_table",
    "overview_body",
    "paused_table",
    "task_link",
    "throughput_section",
]
