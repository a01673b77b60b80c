"""The console's pages as HTML: the frame every page shares, the overview, queues, cron, locks
and sign-in (the job pages are in ``console_jobs``).

Every value from the database goes through ``esc`` (cut, then escaped); the pages carry no inline
script or style (the Content-Security-Policy allows only the console's own files). Sections that
change are marked ``data-live``: the console's script swaps them in place every few seconds, and
without JavaScript they are refreshed by reloading the page.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlencode

from ...coord.pause import PausedQueue
from ..page.markup import esc, num, table, when
from ..page.sections import (
    banners,
    cards,
    cron_section,
    failed_table,
    locks_section,
    queue_names,
    queue_table,
    routing,
    workers_heading,
    workers_table,
)
from ..readmodel import PageData
from .auth import Session
from .data import Throughput

NAV = (
    ("/console/", "overview", "Overview"),
    ("/console/jobs", "jobs", "Jobs"),
    ("/console/queues", "queues", "Queues"),
    ("/console/cron", "cron", "Cron"),
    ("/console/locks", "locks", "Locks"),
)


@dataclass
class Frame:
    """What every page shows around its content."""

    schema: str
    dsn: str  # already redacted
    refresh: float  # seconds between auto-refreshes
    actions_enabled: bool
    session: Session | None
    flash: Sequence[str] = ()

    @property
    def can_act(self) -> bool:
        return self.actions_enabled and self.session is not None

    def csrf_field(self) -> str:
        token = self.session.csrf if self.session else ""
        return f'<input type="hidden" name="csrf" value="{esc(token)}">'

    def button(self, url: str, label: str, *, danger: bool = False, **fields: Any) -> str:
        """A form that POSTs ``fields`` to ``url`` (both escaped) with the CSRF token."""
        hidden = "".join(
            f'<input type="hidden" name="{esc(k)}" value="{esc(v, 10_000)}">'
            for k, v in fields.items()
        )
        cls = ' class="danger"' if danger else ""
        return (
            f'<form class="inline" method="post" action="{esc(url, 10_000)}">'
            f'{self.csrf_field()}{hidden}<button type="submit"{cls}>{esc(label)}</button></form>'
        )


def layout(frame: Frame, here: str, title: str, body: str) -> str:
    here_cls = ' class="here"'
    nav = "".join(
        f'<a href="{href}"{here_cls if key == here else ""}>{label}</a>' for href, key, label in NAV
    )
    nav += '<a href="/">Status page</a>'
    if frame.session is not None:
        who = f"signed in as <b>{esc(frame.session.name)}</b> " + frame.button(
            "/console/logout", "sign out"
        )
    elif frame.actions_enabled:
        who = 'read-only until you <a href="/console/login">sign in</a>'
    else:
        who = "read-only"
    notes = "".join(f'<div class="flash" role="status">{esc(m, 2000)}</div>' for m in frame.flash)
    if not frame.actions_enabled and here != "login":
        notes += (
            '<div class="readonly">Read-only console: actions are off because no console token '
            "is configured (set <code>WORKER_CONSOLE_TOKEN</code> or "
            "<code>--console-token-file</code> for <code>worker run</code>).</div>"
        )
    refresh = f"{frame.refresh:g}" if frame.refresh > 0 else "0"
    return (
        '<!DOCTYPE html><html lang="en"><head><meta charset="utf-8">'
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        f"<title>{esc(title)} · worker console · {esc(frame.schema)}</title>"
        '<link rel="stylesheet" href="/console/static/console.css">'
        '<script src="/console/static/console.js" defer></script>'
        f'</head><body data-refresh="{refresh}">'
        f"<header><h1>worker console</h1><nav>{nav}</nav>"
        f'<div class="meta">schema <code>{esc(frame.schema)}</code> · database '
        f'<code>{esc(frame.dsn)}</code> · <span id="live-status">reload to refresh</span> · '
        f"{who}</div></header><main>{notes}{body}</main></body></html>"
    )


def jobs_link(queue: str = "", state: str = "", **more: str) -> str:
    fields = {"queue": queue, "state": state, **more}
    return "/console/jobs?" + urlencode({k: v for k, v in fields.items() if v})


def task_link(task_id: int) -> str:
    return f"/console/jobs/{int(task_id)}"


# -- overview --------------------------------------------------------------------------------------


def _chart(tp: Throughput) -> str:
    """Done (green) and failed (red, on top) tasks per minute as an inline SVG of 60 bars."""
    width, height, bar = 600, 120, 10
    top = max((m.done + m.failed for m in tp.minutes), default=0) or 1
    bars = []
    for m in tp.minutes:
        slot = round((m.at - tp.start).total_seconds() / 60) if tp.start else 0
        x = slot * bar
        done_h = round(m.done / top * (height - 10))
        failed_h = round(m.failed / top * (height - 10))
        label = esc(f"{when(m.at)[11:16]} UTC: {m.done:,} done, {m.failed:,} failed")
        bars.append(
            f"<g><title>{label}</title>"
            f'<rect class="done" x="{x}" y="{height - done_h}" width="{bar - 2}" '
            f'height="{done_h}"></rect>'
            f'<rect class="failed" x="{x}" y="{height - done_h - failed_h}" width="{bar - 2}" '
            f'height="{failed_h}"></rect></g>'
        )
    return (
        f'<svg class="chart" viewBox="0 0 {width} {height}" width="{width}" height="{height}" '
        f'role="img" aria-label="tasks finished per minute">'
        f'<line class="axis" x1="0" y1="{height - 0.5}" x2="{width}" y2="{height - 0.5}"></line>'
        + "".join(bars)
        + "</svg>"
    )


def throughput_section(tp: Throughput) -> str:
    if tp.error:
        return f'<div class="banner">throughput unavailable: {esc(tp.error)}</div>'
    capped = any(m.done >= tp.cap or m.failed >= tp.cap for m in tp.minutes)
    mark = "≥" if capped else ""
    done = sum(m.done for m in tp.minutes)
    failed = sum(m.failed for m in tp.minutes)
    last = tp.minutes[-2] if len(tp.minutes) >= 2 else None  # the last full minute
    parts = [
        f'<p id="throughput-summary">Last hour: <b data-value="done-hour">{mark}{num(done)}</b> '
        f'done, <b data-value="failed-hour" class="{"bad" if failed else ""}">{mark}'
        f"{num(failed)}</b> failed for good"
    ]
    if last is not None:
        parts.append(
            f"; last full minute ({esc(when(last.at)[11:16])} UTC): {num(last.done)} done, "
            f"{num(last.failed)} failed"
        )
    parts.append(".</p>")
    parts.append(_chart(tp))
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
        "<details><summary>per minute</summary>"
        + table(["minute (UTC)", "done", "failed"], rows, empty="nothing counted yet")
        + "</details>"
    )
    parts.append(
        '<p class="note">Counted by the database from the finished rows the workers keep '
        "(<code>--keep-done</code>, <code>--keep-failed</code>), so every machine shows the same "
        f"numbers; each minute is counted up to {tp.cap:,} (≥ past it). With "
        "<code>--keep-done 0</code> done rows are deleted at once and are not counted here. "
        "Failed means failed for good: retries are not counted.</p>"
    )
    return "".join(parts)


def paused_table(paused: list[PausedQueue], frame: Frame | None = None) -> str:
    rows = []
    for p in paused:
        action = ""
        if frame is not None and frame.can_act:
            action = (
                "<td>" + frame.button("/console/queues/resume", "Resume", queue=p.queue) + "</td>"
            )
        rows.append(
            f'<tr data-paused="{esc(p.queue)}"><td>{esc(p.queue)}</td>'
            f"<td>{esc(when(p.paused_at))}</td><td>{esc(p.paused_by)}</td>{action}</tr>"
        )
    head = ["queue", "paused at", "paused by"]
    if frame is not None and frame.can_act:
        head.append("")
    return table(head, rows, empty="no queue is paused")


def audit_table(rows: list[tuple[Any, ...]]) -> str:
    body = [
        f"<tr><td>{esc(when(at))}</td><td>{esc(actor)}</td><td>{esc(address)}</td>"
        f"<td>{esc(action)}</td><td><code>{esc(json.dumps(target, sort_keys=True), 300)}"
        "</code></td>"
        f'<td class="n">{num(affected)}'
        + (f' <span class="note">(interrupted by {esc(stopped)})</span>' if stopped else "")
        + "</td></tr>"
        for _id, at, actor, address, action, target, affected, stopped in rows
    ]
    return table(["when", "who", "from", "action", "on", "rows"], body, empty="no action yet")


def overview(
    frame: Frame,
    page: PageData,
    tp: Throughput,
    paused: list[PausedQueue],
    audit: list[tuple[Any, ...]],
    queues_page: int,
) -> str:
    extra = ((num(len(paused)), "paused queues"),)
    body = [
        f'<section id="live-cards" data-live>{banners(page)}{cards(page, extra)}</section>',
        '<h2 id="throughput">Throughput (tasks finished per minute, last hour)</h2>',
        f'<section id="live-throughput" data-live>{throughput_section(tp)}</section>',
        '<h2 id="queues">Queues</h2>',
        '<p class="note">Each count links to those tasks in the job browser.</p>',
        f'<section id="live-queues" data-live>'
        f"{queue_table(page, queues_page, link=jobs_link, pager_href=_pager_href())}</section>",
        '<h2 id="paused">Paused queues</h2>',
        f'<section id="live-paused" data-live>{paused_table(paused)}</section>',
        f'<section id="live-workers" data-live>{workers_heading(page)}{workers_table(page)}'
        "</section>",
        '<h2 id="routing">Work no live worker will do</h2>',
        f'<section id="live-routing" data-live>{routing(page.snapshot)}</section>',
        '<h2 id="failed">Recent failed tasks</h2>',
        f'<section id="live-failed" data-live>{failed_table(page, link=task_link)}</section>',
        '<h2 id="audit">Recent console actions</h2>',
        f'<section id="live-audit" data-live>{audit_table(audit)}</section>',
    ]
    return layout(frame, "overview", "Overview", "".join(body))


def _pager_href() -> str:
    return "/console/?queues_page={n}#queues"


# -- queues, cron, locks, sign-in ------------------------------------------------------------------


def queues(frame: Frame, page: PageData, paused: list[PausedQueue], queues_page: int) -> str:
    by_name = {p.queue: p for p in paused}
    names = sorted(set(queue_names(page)) | set(by_name))

    def control(name: str) -> str:
        p = by_name.get(name)
        state = f"paused by {esc(p.paused_by)}" if p else "running"
        if not frame.can_act:
            return f'<td data-col="paused">{state}</td>'
        if p:
            form = frame.button("/console/queues/resume", "Resume", queue=name)
        else:
            form = frame.button("/console/queues/pause", "Pause", queue=name)
        return f'<td data-col="paused">{state} {form}</td>'

    body = [
        '<h2 id="queues">Queues</h2>',
        f'<section id="live-queue-table" data-live>{banners(page)}'
        + queue_table(
            page,
            queues_page,
            link=jobs_link,
            extra_head=("paused",),
            extra=control,
            names=names,
            pager_href="/console/queues?queues_page={n}#queues",
        )
        + "</section>",
        '<p class="note">A paused queue is recorded in the database for the whole fleet: workers '
        "start no new task from it until it is resumed; tasks already running finish.</p>",
    ]
    if frame.can_act:
        body.append(
            '<form class="filter" method="post" action="/console/queues/pause">'
            f"{frame.csrf_field()}"
            '<label>pause a queue by name<input name="queue" maxlength="255" required></label>'
            '<button type="submit">Pause</button></form>'
        )
    body += [
        '<h2 id="paused">Paused queues</h2>',
        f'<section id="live-paused" data-live>{paused_table(paused, frame)}</section>',
    ]
    return layout(frame, "queues", "Queues", "".join(body))


def cron(frame: Frame, page: PageData) -> str:
    body = (
        f'<h2 id="cron">Cron</h2><section id="live-cron" data-live>{banners(page)}'
        f"{cron_section(page, frame.schema)}</section>"
    )
    return layout(frame, "cron", "Cron", body)


def locks(frame: Frame, page: PageData) -> str:
    body = (
        f'<h2 id="locks">Locks</h2><section id="live-locks" data-live>{banners(page)}'
        f"{locks_section(page, frame.schema)}</section>"
    )
    return layout(frame, "locks", "Locks", body)


def sign_in(frame: Frame, error: str = "") -> str:
    if not frame.actions_enabled:
        body = (
            "<h2>Sign in</h2><p>Actions are off: no console token is configured, so there is "
            "nothing to sign in to. The console is read-only.</p>"
        )
        return layout(frame, "login", "Sign in", body)
    problem = f'<div class="banner">{esc(error)}</div>' if error else ""
    body = (
        f"<h2>Sign in</h2>{problem}"
        '<form class="signin" method="post" action="/console/login" autocomplete="off">'
        '<label>Console token<input type="password" name="token" required '
        'autocomplete="current-password"></label>'
        '<label>Your name (recorded with each action)<input name="name" maxlength="64" '
        'placeholder="console"></label>'
        '<button type="submit">Sign in</button></form>'
        '<p class="note">The token is the one the operator configured for this console '
        "(<code>WORKER_CONSOLE_TOKEN</code> or <code>--console-token-file</code>). A session "
        "lasts 8 hours, or until the worker restarts.</p>"
    )
    return layout(frame, "login", "Sign in", body)


def message(frame: Frame, title: str, text: str) -> str:
    return layout(frame, "", title, f"<h2>{esc(title)}</h2><p>{esc(text, 2000)}</p>")


__all__ = [
    "Frame",
    "cron",
    "jobs_link",
    "layout",
    "locks",
    "message",
    "overview",
    "queues",
    "sign_in",
    "task_link",
]
