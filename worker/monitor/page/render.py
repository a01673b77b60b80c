"""The status page, rendered on the server as plain HTML (its sections are in ``sections``).

Every value from the database passes through ``html.escape`` (task names, errors and
payload-derived text are user data), and a strict Content-Security-Policy forbids scripts anyway.
Every value is cut too (``bounds.clip``), and every table shows a bounded number of rows (queues
page by page), so the page stays small whatever a producer wrote.
"""

from __future__ import annotations

from ...tasks.limits import QueueLimits, describe_rate
from ..bounds import clip
from ..readmodel import PageData
from .health import render_doctor_panel
from .markup import esc, when
from .sections import (
    banners,
    cards,
    cron_section,
    failed_table,
    locks_section,
    queue_table,
    routing,
    workers_heading,
    workers_table,
)

_STYLE = """
body{font:14px/1.45 system-ui,-apple-system,"Segoe UI",Roboto,sans-serif;margin:0;color:#1d2430;
background:#f5f6f8}
header{background:#1d2430;color:#fff;padding:14px 24px}
header h1{font-size:19px;margin:0 0 2px}
header .meta{color:#b8c0cc;font-size:12.5px}
header a{color:#dfe6ef}
main{padding:8px 24px 40px;max-width:1400px}
h2{font-size:16px;margin:26px 0 8px}
h3{font-size:14px;margin:14px 0 6px;color:#445}
table{border-collapse:collapse;background:#fff;box-shadow:0 1px 2px rgba(0,0,0,.08);
margin-bottom:6px;min-width:420px}
th,td{padding:5px 10px;border-bottom:1px solid #e3e6ea;text-align:left;vertical-align:top}
th{background:#eef0f3;font-weight:600;font-size:12.5px;white-space:nowrap}
td.n{text-align:right;font-variant-numeric:tabular-nums;white-space:nowrap}
td.empty{color:#889;font-style:italic}
table.generic td{white-space:nowrap}
tr:hover td{background:#fafbfc}
.cards{display:flex;gap:12px;flex-wrap:wrap;margin-top:16px}
.card{background:#fff;padding:10px 16px;box-shadow:0 1px 2px rgba(0,0,0,.08);min-width:130px}
.card b{display:block;font-size:22px}
.card span{color:#667;font-size:12px}
.warn{color:#a15c00}.bad{color:#b3261e}.ok{color:#1e7a3c}
.err{font-family:ui-monospace,Menlo,Consolas,monospace;font-size:12.5px;white-space:pre-wrap;
word-break:break-word;max-width:720px}
details summary{cursor:pointer}
.note{color:#667;font-size:12.5px;margin:4px 0}
.banner{background:#fdecea;color:#b3261e;padding:10px 14px;margin-top:16px;border:1px solid #f5c2bd}
code{font-family:ui-monospace,Menlo,Consolas,monospace;font-size:12.5px}
"""


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
        '<p class="note">Fleet-wide limits (<code>worker limits set QUEUE ...</code> changes '
        "them within a second).</p><table><thead><tr><th>queue</th><th>concurrency</th>"
        "<th>per key</th><th>rate</th><th>per key rate</th><th>running</th><th>waiting</th>"
        f"<th>set by</th></tr></thead><tbody>{rows}</tbody></table>"
    )


def render_page(
    page: PageData,
    *,
    schema: str,
    dsn: str,
    expected_version: int,
    ttl: float,
    queues_page: int = 1,
) -> str:
    """The whole status page as one HTML string; every dynamic value goes through ``_e``.
    ``queues_page`` (from 1) picks which ``QUEUES_PER_PAGE`` queues the queue table lists."""
    snap = page.snapshot
    parts: list[str] = []
    parts.append(
        "<header><h1>worker status</h1>"
        f'<div class="meta">schema <code>{esc(schema)}</code> · database <code>{esc(dsn)}</code>'
        f" · schema version {esc(page.version or '?')} (code expects {esc(expected_version)})"
        f" · data as of {esc(when(page.wall))}, refreshed at most every {esc(f'{ttl:g}')} s"
        ' · <a href="/console/">operator console</a></div></header><main>'
    )
    parts.append(banners(page))
    parts.append(cards(page))
    parts.append('<h2 id="routing">Work no live worker will do</h2>')
    parts.append(routing(snap))
    parts.append(render_doctor_panel(page.health))
    if snap.paused:
        parts.append('<h2 id="paused">Paused queues</h2>')
        parts.append(
            '<p class="note">Workers claim nothing from these until they are resumed '
            "(<code>worker resume QUEUE</code>); tasks already running finish.</p>"
            '<ul class="paused">'
            + "".join(f"<li data-paused>{esc(clip(name, 255))}</li>" for name in snap.paused)
            + "</ul>"
        )
    if snap.limits:
        parts.append('<h2 id="limits">Limited queues</h2>')
        parts.append(limits_table(snap.limits))
    parts.append('<h2 id="queues">Queues</h2>')
    parts.append(queue_table(page, queues_page))
    parts.append(workers_heading(page))
    parts.append(workers_table(page))
    parts.append('<h2 id="failed">Recent failed tasks</h2>')
    parts.append(failed_table(page))
    parts.append('<h2 id="cron">Cron</h2>')
    parts.append(cron_section(page, schema))
    parts.append('<h2 id="locks">Locks</h2>')
    parts.append(locks_section(page, schema))
    parts.append("</main>")
    return (
        '<!DOCTYPE html><html lang="en"><head><meta charset="utf-8">'
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        f"<title>worker status · {esc(schema)}</title><style>{_STYLE}</style></head><body>"
        + "".join(parts)
        + "</body></html>"
    )


__all__ = ["render_page"]
