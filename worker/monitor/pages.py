"""The status page, rendered on the server as plain HTML.

Every value from the database passes through ``html.escape`` (task names, errors and
payload-derived text are user data), and a strict Content-Security-Policy forbids scripts anyway.
Every value is cut too (``bounds.clip``), and every table shows a bounded number of rows (queues
page by page), so the page stays small whatever a producer wrote.
"""

from __future__ import annotations

import html
from dataclasses import replace

from .bounds import ERROR_CHARS, QUEUES_PER_PAGE, ROWS_SHOWN, QueueRow, clip
from .doctor_panel import render_doctor_panel
from .markup import (
    LOCK_FIRST,
    age,
    cron_table,
    esc,
    generic_rows,
    lock_key,
    more_note,
    num,
    our_advisory_class,
    table,
    when,
)
from .readmodel import ALIVE_SECONDS, PageData

CSP = (
    "default-src 'none'; style-src 'unsafe-inline'; img-src data:; base-uri 'none'; "
    "form-action 'none'; frame-ancestors 'none'"
)

_STYLE = """
body{font:14px/1.45 system-ui,-apple-system,"Segoe UI",Roboto,sans-serif;margin:0;color:#1d2430;
background:#f5f6f8}
header{background:#1d2430;color:#fff;padding:14px 24px}
header h1{font-size:19px;margin:0 0 2px}
header .meta{color:#b8c0cc;font-size:12.5px}
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


def _pager(first: int, shown: int, total: int, number: int, pages: int) -> str:
    """Where this page of queues is in the list, with links to the pages around it."""
    if pages <= 1:
        return ""
    links = [
        f'<a href="?queues_page={n}#queues" rel="{rel}">{label}</a>'
        for n, rel, label in ((number - 1, "prev", "← previous"), (number + 1, "next", "next →"))
        if 1 <= n <= pages
    ]
    return (
        f'<p class="note" id="queues-pager">queues {first + 1:,} to {first + shown:,} of {total:,}'
        f" (page {number:,} of {pages:,}; {total - shown:,} queues on other pages) · "
        + " · ".join(links)
        + "</p>"
    )


def _count(q: QueueRow, state: str, n: int) -> str:
    """A count as the page shows it: exact, ≈ the planner's estimate, or ≥ the cap."""
    if state in q.estimated:
        return "≈" + num(n)
    return ("≥" if state in q.capped_states else "") + num(n)


def _mark(rows: list[QueueRow], states: tuple[str, ...]) -> str:
    """≈ when a sum holds an estimate or a count that stopped at the cap."""
    return "≈" if any(set(states) & (q.capped_states | q.estimated) for q in rows) else ""


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
    rest = snap.rest or QueueRow("", 0, 0, 0, False, None)
    if snap.rest is not None and snap.rest.capped:
        rest = replace(rest, capped_states=frozenset({"queued", "scheduled"}))
    parts: list[str] = []
    parts.append(
        "<header><h1>worker status</h1>"
        f'<div class="meta">schema <code>{esc(schema)}</code> · database <code>{esc(dsn)}</code>'
        f" · schema version {esc(page.version or '?')} (code expects {esc(expected_version)})"
        f" · data as of {esc(when(page.wall))}, refreshed at most every {esc(f'{ttl:g}')} s"
        "</div></header><main>"
    )
    for err in dict.fromkeys(e for e in (snap.error, page.error) if e):
        parts.append(f'<div class="banner">database problem: {esc(err)}</div>')

    shown = [*snap.queues, rest]
    total_queued = sum(q.queued for q in shown)
    oldest = max((q.oldest_seconds or 0.0 for q in snap.queues), default=0.0)
    failed_total: float | None = sum(q.failed for q in snap.queues)
    failed_mark = ""
    if any("failed" in q.capped_states for q in snap.queues):
        failed_total, failed_mark = snap.estimates.get("failed"), "≈"
    cards = [
        (_mark(shown, ("queued",)) + num(total_queued), "queued (due)"),
        (_mark(shown, ("scheduled",)) + num(sum(q.delayed for q in shown)), "scheduled"),
        (num(sum(q.running for q in snap.queues)), "in progress"),
        (age(oldest) if oldest else "-", "oldest due task waited"),
        (num(snap.workers_alive), "workers alive"),
        (failed_mark + num(failed_total), "failed (kept)"),
    ]
    parts.append(
        '<div class="cards">'
        + "".join(
            f'<div class="card"><b>{v}</b><span>{esc(label)}</span></div>' for v, label in cards
        )
        + "</div>"
    )

    # routing
    advice = snap.routing.advice(lambda name: f"'{clip(name, 80)}'")
    parts.append('<h2 id="routing">Work no live worker will do</h2>')
    if advice:
        parts.append(
            '<ul class="routing bad">'
            + "".join(f"<li>{html.escape(line, quote=True)}</li>" for line in advice)
            + "</ul>"
        )
    else:
        parts.append(
            '<p class="note">None: a live worker serves every queue with due tasks, and has a '
            "handler for every task seen waiting.</p>"
        )

    parts.append(render_doctor_panel(page.health))

    # queues
    parts.append('<h2 id="queues">Queues</h2>')
    names = sorted({q.queue for q in snap.queues} | {k[0] for k in page.finished})
    pages = max(1, -(-len(names) // QUEUES_PER_PAGE))
    number = min(max(queues_page, 1), pages)
    first = (number - 1) * QUEUES_PER_PAGE
    listed = names[first : first + QUEUES_PER_PAGE]
    by_name = {q.queue: q for q in snap.queues}
    rows = []
    for name in listed:
        q = by_name.get(name) or QueueRow(name, 0, 0, 0, False, None)
        cells = [
            f'<td data-col="queue">{esc(name)}</td>',
            f'<td class="n" data-col="queued">{_count(q, "queued", q.queued)}</td>',
            f'<td class="n" data-col="scheduled">{_count(q, "scheduled", q.delayed)}</td>',
            f'<td class="n" data-col="in_progress">{num(q.running)}</td>',
        ]
        for state in ("done", "failed", "cancelled"):
            if state == "failed":
                value = _count(q, "failed", q.failed)
            elif page.finished_exact:
                value = num(page.finished.get((name, state), 0))
            else:
                n = page.finished.get((name, state))
                value = "-" if n is None else "≈" + num(n)
            cls = " bad" if state == "failed" and value not in ("0", "-") else ""
            cells.append(f'<td class="n{cls}" data-col="{state}">{value}</td>')
        age_cls = " warn" if (q.oldest_seconds or 0) > 60 else ""
        cells.append(f'<td class="n{age_cls}" data-col="oldest">{age(q.oldest_seconds)}</td>')
        served_cls = " bad" if q.unserved else ""
        cells.append(
            f'<td class="{served_cls.strip()}" data-col="served">'
            f"{'yes' if q.served else 'none'}</td>"
        )
        rows.append(f'<tr data-queue="{esc(name)}">{"".join(cells)}</tr>')
    parts.append(
        table(
            [
                "queue",
                "queued (due)",
                "scheduled",
                "in progress",
                "done",
                "failed",
                "cancelled",
                "oldest due",
                "live worker",
            ],
            rows,
            cls="queues",
            empty="no tasks",
        )
    )
    parts.append(_pager(first, len(listed), len(names), number, pages))
    if snap.rest is not None:
        parts.append(
            f'<p class="note bad">Too many queue names to list: the queues after '
            f"<code>{esc(snap.rest.queue)}</code> are not listed, and their "
            f"{'≥' if rest.capped else ''}{num(rest.queued)} queued tasks "
            f"({'≥' if rest.capped else ''}{num(rest.delayed)} scheduled) are counted "
            "together.</p>"
        )
    if not page.finished_exact:
        parts.append(
            '<p class="note">The task table holds many finished rows, so done and cancelled '
            "rows are not counted per queue: ≈ marks the planner's estimates.</p>"
        )
    parts.append(
        '<p class="note">Counts stop at the counting cap: beyond it ≈ marks the planner\'s '
        'estimate, ≥ the cap where the estimate is lower. "oldest due" is how long the oldest '
        "task that may run now has waited.</p>"
    )

    # workers
    many = "over " if len(page.workers) > ROWS_SHOWN else ""
    parts.append(
        f'<h2 id="workers">Workers ({many}{min(len(page.workers), ROWS_SHOWN)} registered and '
        "not stopped)</h2>"
    )
    wrows = []
    for w in page.workers[:ROWS_SHOWN]:
        hb = w.get("heartbeat_age_seconds")
        hb_cls = " bad" if hb is not None and hb > ALIVE_SECONDS else ""
        wrows.append(
            "<tr>"
            f'<td><code title="{esc(w["id"])}">{esc(str(w["id"])[:8])}</code></td>'
            f'<td>{esc(w["host"])}</td><td class="n">{esc(w["pid"])}</td>'
            f"<td>{esc(', '.join(w.get('queues') or []))}</td>"
            f'<td class="n">{esc(w["concurrency"])}</td>'
            f"<td>{esc(when(w['started_at']))}</td>"
            f'<td class="n{hb_cls}">{esc(age(hb))} ago</td>'
            f'<td class="n">{esc(w["in_flight"])}</td>'
            "</tr>"
        )
    parts.append(
        table(
            ["worker", "host", "pid", "queues", "slots", "started", "heartbeat", "in flight"],
            wrows,
            empty="no worker is running",
        )
    )
    parts.append(more_note(page.workers, "workers"))

    # failures
    parts.append('<h2 id="failed">Recent failed tasks</h2>')
    frows = []
    for f in page.failed:
        # Cut once, then split: the first line is the summary, the rest (if any) its details.
        error = clip(f.get("last_error"), ERROR_CHARS, length=f.get("last_error_length"))
        line, _, more = (html.escape(part, quote=True) for part in error.partition("\n"))
        err_html = f"<details><summary>{line}</summary>{more}</details>" if more else line
        task = esc(f["task"], length=f.get("task_length"))
        queue = esc(f["queue"], length=f.get("queue_length"))
        frows.append(
            f'<tr data-task-id="{esc(f["id"])}">'
            f'<td class="n">{esc(f["id"])}</td><td>{task}</td><td>{queue}</td>'
            f'<td class="n">{esc(f["attempts"])}/{esc(f["max_attempts"])}</td>'
            f"<td>{esc(when(f['finished_at']))}</td>"
            f'<td class="err">{err_html}</td></tr>'
        )
    parts.append(
        table(
            ["id", "task", "queue", "attempts", "failed at", "last error"],
            frows,
            empty="no failed task kept",
        )
    )

    # cron
    parts.append('<h2 id="cron">Cron</h2>')
    runs = {str(r["cron_key"]): r for r in page.cron_runs}
    if page.cron_schedules is None:
        parts.append(f'<p class="note">No <code>{esc(schema)}.cron_schedules</code> table.</p>')
    else:
        parts.append("<h3>Schedules</h3>")
        parts.append(cron_table(page.cron_schedules[:ROWS_SHOWN], runs))
        parts.append(more_note(page.cron_schedules, "schedules"))
    parts.append("<h3>Latest run of each cron key (from the task table)</h3>")
    parts.append(
        table(
            ["cron key", "slot", "state", "finished"],
            [
                f"<tr><td>{esc(r['cron_key'])}</td><td>{esc(when(r['cron_at']))}</td>"
                f"<td>{esc(r['state'])}</td><td>{esc(when(r['finished_at']))}</td></tr>"
                for r in page.cron_runs[:ROWS_SHOWN]
            ],
            empty="no cron runs kept",
        )
    )
    parts.append(more_note(page.cron_runs, "cron keys"))

    # locks
    parts.append('<h2 id="locks">Locks</h2>')
    if page.locks is None:
        parts.append(f'<p class="note">No <code>{esc(schema)}.locks</code> table.</p>')
    else:
        parts.append("<h3>Lock table</h3>")
        parts.append(generic_rows(page.locks[:ROWS_SHOWN], first=LOCK_FIRST))
        parts.append(more_note(page.locks, "locks"))
    parts.append("<h3>Advisory locks held in this database</h3>")
    arows = []
    ours = our_advisory_class()
    for a in page.advisory[:ROWS_SHOWN]:
        key, what = lock_key(a, ours)
        arows.append(
            f"<tr><td><code>{esc(key)}</code></td><td>{esc(what)}</td><td>{esc(a['mode'])}</td>"
            f'<td class="n">{esc(a["pid"])}</td><td>{esc(a.get("application_name"))}</td>'
            f"<td>{esc(a.get('client_addr'))}</td><td>{esc(a.get('state'))}</td>"
            f'<td class="n">{esc(age(a.get("xact_seconds")))}</td></tr>'
        )
    parts.append(
        table(
            ["key", "known as", "mode", "pid", "application", "client", "state", "transaction"],
            arows,
            empty="no advisory lock held",
        )
    )
    parts.append(more_note(page.advisory, "advisory locks"))
    parts.append("</main>")
    return (
        '<!DOCTYPE html><html lang="en"><head><meta charset="utf-8">'
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        f"<title>worker status · {esc(schema)}</title><style>{_STYLE}</style></head><body>"
        + "".join(parts)
        + "</body></html>"
    )


__all__ = ["CSP", "render_page"]
