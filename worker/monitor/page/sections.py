"""The overview's sections, the same on the status page and in the console: headline cards,
routing advice, the queue table, workers, failures, cron and locks (their explanations, behind
each panel's "?", are the ``*_HELP`` texts).

Every value from the database passes through ``esc`` (``html.escape`` of a value cut by
``bounds.clip``): task names, queue names and errors are whatever a producer wrote. Every table
shows a bounded number of rows (queues page by page).
"""

from __future__ import annotations

import html
from collections.abc import Callable
from dataclasses import replace

from ..bounds import ERROR_CHARS, QUEUES_PER_PAGE, ROWS_SHOWN, QueueRow, clip
from ..readmodel import ALIVE_SECONDS, PageData, Snapshot
from .markup import (
    LOCK_FIRST,
    age,
    badge,
    cron_table,
    esc,
    generic_rows,
    lock_key,
    more_note,
    num,
    our_advisory_class,
    stamp,
    table,
)


def _pager(
    first: int,
    shown: int,
    total: int,
    number: int,
    pages: int,
    href: str = "?queues_page={n}#queues",
) -> str:
    """Where this page of queues is in the list, with links to the pages around it (``href``
    with ``{n}`` for the page's number)."""
    if pages <= 1:
        return ""
    links = [
        f'<a href="{esc(href.format(n=n), 10_000)}" rel="{rel}">{label}</a>'
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


def banners(page: PageData) -> str:
    snap = page.snapshot
    return "".join(
        f'<div class="banner">database problem: {esc(err)}</div>'
        for err in dict.fromkeys(e for e in (snap.error, page.error) if e)
    )


def _rest(page: PageData) -> QueueRow:
    snap = page.snapshot
    rest = snap.rest or QueueRow("", 0, 0, 0, False, None)
    if snap.rest is not None and snap.rest.capped:
        rest = replace(rest, capped_states=frozenset({"queued", "scheduled"}))
    return rest


def cards(page: PageData, extra: tuple[tuple[str, str], ...] = ()) -> str:
    """The headline numbers, each task state's in its colour with its label; ``extra``: more
    (value, label) cards, values already escaped."""
    snap = page.snapshot
    shown = [*snap.queues, _rest(page)]
    total_queued = sum(q.queued for q in shown)
    oldest = max((q.oldest_seconds or 0.0 for q in snap.queues), default=0.0)
    failed_total: float | None = sum(q.failed for q in snap.queues)
    failed_mark = ""
    if any("failed" in q.capped_states for q in snap.queues):
        failed_total, failed_mark = snap.estimates.get("failed"), "≈"
    flows = snap.workflows or {}
    waiting = ("≥" if flows.get("capped") else "") + num(flows.get("steps", {}).get("waiting", 0))
    values = [
        (waiting, "waiting", "waiting (workflow steps)"),
        (_mark(shown, ("queued",)) + num(total_queued), "queued", "queued (due)"),
        (_mark(shown, ("scheduled",)) + num(sum(q.delayed for q in shown)), "scheduled", ""),
        (num(sum(q.running for q in snap.queues)), "in_progress", ""),
        (age(oldest) if oldest else "-", "", "oldest due task waited"),
        (num(snap.workers_alive), "", "workers alive"),
        (failed_mark + num(failed_total), "failed", "failed (kept)"),
        *((v, "", label) for v, label in extra),
    ]
    shown_cards = []
    for v, state, label in values:
        cls = f"card card-{state}" if state else "card"
        name = badge(state, label or None) if state else esc(label)
        shown_cards.append(f'<div class="{cls}"><b>{v}</b><span>{name}</span></div>')
    return '<div class="cards">' + "".join(shown_cards) + "</div>"


def routing(snap: Snapshot) -> str:
    advice = snap.routing.advice(lambda name: f"'{clip(name, 80)}'")
    if advice:
        return (
            '<ul class="routing bad">'
            + "".join(f"<li>{html.escape(line, quote=True)}</li>" for line in advice)
            + "</ul>"
        )
    return (
        '<p class="note">None: a live worker serves every queue with due tasks, and has a '
        "handler for every task seen waiting.</p>"
    )


QUEUE_HEAD = [
    "queue",
    badge("waiting"),
    badge("queued", "queued (due)"),
    badge("scheduled"),
    badge("in_progress"),
    badge("done"),
    badge("failed"),
    badge("cancelled"),
    "oldest due",
    "live worker",
]
QUEUES_HELP = (
    "Tasks per queue and state; each count links to those tasks in the job browser. Counts stop "
    "at the counting cap: beyond it ≈ marks the planner's estimate, ≥ the cap where the estimate "
    "is lower. “waiting” counts the workflow steps that wait for their dependencies, read among "
    "the unfinished steps of workflows up to the cap (≥ when it was reached). When the task "
    "table holds many finished rows, done and cancelled rows are not counted per queue: ≈ "
    "marks the planner's estimates there too. “oldest due” is how long the "
    "oldest task that may run now has waited; “live worker” whether a live worker serves the "
    "queue."
)


def queue_names(page: PageData) -> list[str]:
    waiting = (page.snapshot.workflows or {}).get("queues", {})
    return sorted(
        {q.queue for q in page.snapshot.queues} | {k[0] for k in page.finished} | set(waiting)
    )


def queue_table(
    page: PageData,
    queues_page: int = 1,
    *,
    link: Callable[[str, str], str] | None = None,
    extra_head: tuple[str, ...] = (),
    extra: Callable[[str], str] | None = None,
    names: list[str] | None = None,
    pager_href: str = "?queues_page={n}#queues",
) -> str:
    """The queue table with its pager and notes. ``link(queue, state)``: a URL each count links
    to (escaped here); ``extra(queue)``: more cells (already escaped) under ``extra_head``;
    ``names``: the queues to list (default: those with tasks)."""
    snap = page.snapshot
    rest = _rest(page)
    names = queue_names(page) if names is None else names
    pages = max(1, -(-len(names) // QUEUES_PER_PAGE))
    number = min(max(queues_page, 1), pages)
    first = (number - 1) * QUEUES_PER_PAGE
    listed = names[first : first + QUEUES_PER_PAGE]
    by_name = {q.queue: q for q in snap.queues}
    flows = snap.workflows or {}
    waiting, waiting_mark = flows.get("queues", {}), "≥" if flows.get("capped") else ""

    def linked(name: str, state: str, text: str) -> str:
        return f'<a href="{esc(link(name, state), 10_000)}">{text}</a>' if link else text

    rows = []
    for name in listed:
        q = by_name.get(name) or QueueRow(name, 0, 0, 0, False, None)
        n_waiting = waiting.get(name, 0)
        counts = {
            "waiting": (waiting_mark if n_waiting else "") + num(n_waiting),
            "queued": _count(q, "queued", q.queued),
            "scheduled": _count(q, "scheduled", q.delayed),
            "in_progress": num(q.running),
        }
        for state in ("done", "failed", "cancelled"):
            if state == "failed":
                counts[state] = _count(q, "failed", q.failed)
            elif page.finished_exact:
                counts[state] = num(page.finished.get((name, state), 0))
            else:
                # 0 is exact: the planner's estimate is never below one row (see seen_none).
                n = page.finished.get((name, state))
                counts[state] = "-" if n is None else "0" if n == 0 else "≈" + num(n)
        cells = [f'<td data-col="queue">{linked(name, "", esc(name))}</td>']
        for state, value in counts.items():
            cls = " bad" if state == "failed" and value not in ("0", "-") else ""
            cells.append(f'<td class="n{cls}" data-col="{state}">{linked(name, state, value)}</td>')
        age_cls = " warn" if (q.oldest_seconds or 0) > 60 else ""
        cells.append(f'<td class="n{age_cls}" data-col="oldest">{age(q.oldest_seconds)}</td>')
        served_cls = " bad" if q.unserved else ""
        cells.append(
            f'<td class="{served_cls.strip()}" data-col="served">'
            f"{'yes' if q.served else 'none'}</td>"
        )
        if extra:
            cells.append(extra(name))
        rows.append(f'<tr data-queue="{esc(name)}">{"".join(cells)}</tr>')
    parts = [table([*QUEUE_HEAD, *extra_head], rows, cls="queues", empty="no tasks")]
    parts.append(_pager(first, len(listed), len(names), number, pages, pager_href))
    if snap.rest is not None:
        parts.append(
            f'<p class="note bad">Too many queue names to list: the queues after '
            f"<code>{esc(snap.rest.queue)}</code> are not listed, and their "
            f"{'≥' if rest.capped else ''}{num(rest.queued)} queued tasks "
            f"({'≥' if rest.capped else ''}{num(rest.delayed)} scheduled) are counted "
            "together.</p>"
        )
    return "".join(parts)


WORKERS_HELP = (
    "The worker processes registered and not stopped, newest first: the queues each serves, its "
    "slots (concurrency), its last heartbeat (a worker silent for longer than the liveness "
    "window is shown in red: its tasks go back to the queue when their lease runs out) and the "
    "tasks it runs now."
)


def workers_count(page: PageData) -> str:
    many = "over " if len(page.workers) > ROWS_SHOWN else ""
    return (
        f'<p class="count">{many}{min(len(page.workers), ROWS_SHOWN)} registered and not '
        "stopped</p>"
    )


def workers_table(page: PageData) -> str:
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
            f"<td>{stamp(w['started_at'])}</td>"
            f'<td class="n{hb_cls}">{esc(age(hb))} ago</td>'
            f'<td class="n">{esc(w["in_flight"])}</td>'
            "</tr>"
        )
    return table(
        ["worker", "host", "pid", "queues", "slots", "started", "heartbeat", "in flight"],
        wrows,
        empty="no worker is running",
    ) + more_note(page.workers, "workers")


def failed_table(page: PageData, link: Callable[[int], str] | None = None) -> str:
    """The newest failures; ``link(id)``: a URL each id links to."""
    frows = []
    for f in page.failed:
        # Cut once, then split: the first line is the summary, the rest (if any) its details.
        error = clip(f.get("last_error"), ERROR_CHARS, length=f.get("last_error_length"))
        line, _, more = (html.escape(part, quote=True) for part in error.partition("\n"))
        err_html = f"<details><summary>{line}</summary>{more}</details>" if more else line
        task = esc(f["task"], length=f.get("task_length"))
        queue = esc(f["queue"], length=f.get("queue_length"))
        shown_id = esc(f["id"])
        if link:
            shown_id = f'<a href="{esc(link(int(f["id"])))}">{shown_id}</a>'
        frows.append(
            f'<tr data-task-id="{esc(f["id"])}">'
            f'<td class="n">{shown_id}</td><td>{task}</td><td>{queue}</td>'
            f'<td class="n">{esc(f["attempts"])}/{esc(f["max_attempts"])}</td>'
            f"<td>{stamp(f['finished_at'])}</td>"
            f'<td class="err">{err_html}</td></tr>'
        )
    return table(
        ["id", "task", "queue", "attempts", "failed at", "last error"],
        frows,
        empty="no failed task kept",
    )


def cron_section(page: PageData, schema: str) -> str:
    parts = []
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
                f"<tr><td>{esc(r['cron_key'])}</td><td>{stamp(r['cron_at'])}</td>"
                f"<td>{badge(r['state'])}</td><td>{stamp(r['finished_at'])}</td></tr>"
                for r in page.cron_runs[:ROWS_SHOWN]
            ],
            empty="no cron runs kept",
        )
    )
    parts.append(more_note(page.cron_runs, "cron keys"))
    return "".join(parts)


def locks_section(page: PageData, schema: str) -> str:
    parts = []
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
    return "".join(parts)


__all__ = [
    "QUEUES_HELP",
    "QUEUE_HEAD",
    "WORKERS_HELP",
    "banners",
    "cards",
    "cron_section",
    "failed_table",
    "locks_section",
    "queue_names",
    "queue_table",
    "routing",
    "workers_count",
    "workers_table",
]
