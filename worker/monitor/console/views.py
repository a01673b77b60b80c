"""The console's pages as HTML: the frame every page shares, the overview (the status page's
too: ``page.overview``), queues, cron, locks and sign-in (the job pages are in ``console_jobs``).

Every value from the database goes through ``esc`` (cut, then escaped); the pages carry no inline
script or style (the Content-Security-Policy allows only the console's own files). Sections that
change are marked ``data-live``: the console's script swaps them in place every few seconds, and
without JavaScript they are refreshed by reloading the page.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ...coord.pause import PausedQueue
from ..page.layout import document, help_box, nav, panel
from ..page.markup import esc
from ..page.overview import (
    CRON_HELP,
    LOCKS_HELP,
    PAUSED_HELP,
    Overview,
    Places,
    jobs_link,
    overview_body,
    paused_table,
    task_link,
)
from ..page.sections import (
    QUEUES_HELP,
    banners,
    cron_section,
    locks_section,
    queue_names,
    queue_table,
)
from ..readmodel import PageData
from .auth import Session


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
    meta = (
        f"schema <code>{esc(frame.schema)}</code> · database <code>{esc(frame.dsn)}</code> · "
        f'<span id="live-status">reload to refresh</span> · {who} · '
        '<a href="/">status page</a>'
    )
    return document(
        title=f"{title} · worker console · {frame.schema}",
        heading="worker console",
        nav_html=nav(here),
        meta=meta,
        body=notes + body,
        head=(
            '<link rel="stylesheet" href="/console/static/console.css">'
            '<script src="/console/static/console.js" defer></script>'
        ),
        attrs=f' data-refresh="{refresh}"',
    )


# -- overview --------------------------------------------------------------------------------------


def overview(frame: Frame, o: Overview, *, expected_version: int, ttl: float) -> str:
    """The overview, as on the status page, with a Resume button by each paused queue for a
    signed-in operator."""
    resume = None
    if frame.can_act:

        def resume(queue: str) -> str:
            return frame.button("/console/queues/resume", "Resume", queue=queue)

    places = Places(_pager_href(), jobs_link, task_link, resume)
    body = overview_body(o, places, schema=frame.schema, expected_version=expected_version, ttl=ttl)
    return layout(frame, "overview", "Overview", body)


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

    table_html = banners(page) + queue_table(
        page,
        queues_page,
        link=jobs_link,
        extra_head=("paused",),
        extra=control,
        names=names,
        pager_href="/console/queues?queues_page={n}#queues",
    )
    body = [panel("queues", "Queues", table_html, help=f"{QUEUES_HELP} {PAUSED_HELP}")]
    if frame.can_act:
        body.append(
            '<form class="filter" method="post" action="/console/queues/pause">'
            f"{frame.csrf_field()}"
            '<label>pause a queue by name<input name="queue" maxlength="255" required></label>'
            '<button type="submit">Pause</button></form>'
        )
    resume = None
    if frame.can_act:

        def resume(queue: str) -> str:
            return frame.button("/console/queues/resume", "Resume", queue=queue)

    body.append(panel("paused", "Paused queues", paused_table(paused, resume), help=PAUSED_HELP))
    return layout(frame, "queues", "Queues", "".join(body))


def cron(frame: Frame, page: PageData) -> str:
    body = panel("cron", "Cron", banners(page) + cron_section(page, frame.schema), help=CRON_HELP)
    return layout(frame, "cron", "Cron", body)


def locks(frame: Frame, page: PageData) -> str:
    body = panel(
        "locks", "Locks", banners(page) + locks_section(page, frame.schema), help=LOCKS_HELP
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
    )
    body = (
        '<div class="panel-head"><h2>Sign in</h2>'
        + help_box(
            "The token is the one the operator configured for this console "
            "(<code>WORKER_CONSOLE_TOKEN</code> or <code>--console-token-file</code>). A session "
            "lasts 8 hours, or until the worker restarts."
        )
        + "</div>"
        + body.removeprefix("<h2>Sign in</h2>")
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
