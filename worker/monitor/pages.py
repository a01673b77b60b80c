"""The status page, rendered on the server as plain HTML.

Every value from the database passes through ``html.escape`` (task names, errors and
payload-derived text are user data), and a strict Content-Security-Policy forbids scripts anyway.
"""

from __future__ import annotations

import contextlib
import html
import json
from collections.abc import Callable, Iterable
from datetime import UTC, datetime
from typing import Any
from zoneinfo import ZoneInfo

from croniter import croniter

from .._advisory import advisory_keys
from .._locks import DEFAULT_NAMESPACE
from .._migrate import MIGRATE_LOCK_CLASS
from .readmodel import ALIVE_SECONDS, PageData, QueueRow

CSP = (
    "default-src 'none'; style-src 'unsafe-inline'; img-src data:; base-uri 'none'; "
    "form-action 'none'; frame-ancestors 'none'"
)

# -- the page --------------------------------------------------------------------------------------


def _e(value: Any) -> str:
    """Escape anything for HTML text or a quoted attribute."""
    return html.escape("" if value is None else str(value), quote=True)


def _num(n: int | float | None) -> str:
    if n is None:
        return "-"
    return f"{round(n):,}"


def _age(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    if seconds < 1:
        return f"{seconds * 1000:.0f} ms"
    if seconds < 120:
        return f"{seconds:.1f} s"
    if seconds < 7200:
        return f"{seconds / 60:.1f} min"
    if seconds < 172800:
        return f"{seconds / 3600:.1f} h"
    return f"{seconds / 86400:.1f} d"


def _when(value: Any) -> str:
    if isinstance(value, datetime):
        return value.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S UTC")
    return "-" if value is None else str(value)


def _cell(value: Any) -> str:
    if isinstance(value, dict | list):
        return _e(json.dumps(value, sort_keys=True, default=str))
    if isinstance(value, str) and len(value) >= 19 and value[4] == "-" and value[10] == "T":
        with contextlib.suppress(ValueError):
            return _e(_when(datetime.fromisoformat(value)))  # a timestamp from to_jsonb
    return _e(_when(value))


def _table(head: Iterable[str], rows: list[str], *, cls: str = "", empty: str = "none") -> str:
    cols = list(head)
    if not rows:
        rows = [f'<tr><td class="empty" colspan="{len(cols)}">{_e(empty)}</td></tr>']
    th = "".join(f"<th>{c}</th>" for c in cols)
    return (
        f'<table class="{cls}"><thead><tr>{th}</tr></thead><tbody>{"".join(rows)}</tbody></table>'
    )


def _generic_rows(
    rows: list[dict[str, Any]],
    *,
    first: tuple[str, ...] = (),
    extra_head: tuple[str, ...] = (),
    extra: Callable[[dict[str, Any]], list[str]] | None = None,
) -> str:
    """A table of rows from a table another feature owns (cron, locks): the columns this page
    knows come first, any others follow as they are, so a new column never breaks the page."""
    seen: list[str] = []
    for r in rows:
        seen.extend(k for k in r if k not in seen)
    cols = [c for c in first if c in seen] + [c for c in seen if c not in first]
    body = [
        "<tr>"
        + "".join(f"<td>{_cell(r.get(c))}</td>" for c in cols)
        + ("".join(f"<td>{x}</td>" for x in extra(r)) if extra else "")
        + "</tr>"
        for r in rows
    ]
    return _table([_e(c) for c in cols] + list(extra_head), body, cls="generic")


_CRON_FIRST = ("key", "expr", "tz", "task", "queue", "last_slot", "next_slot", "catch_up")
_CRON_KEYS = ("key", "cron_key", "name")
_CRON_EXPR = ("expr", "expression", "cron", "spec")
_LOCK_FIRST = ("name", "kind", "holder", "acquired_at", "renewed_at", "expires_at")


def _cron_table(schedules: list[dict[str, Any]], runs: dict[str, dict[str, Any]]) -> str:
    """Schedules with the state of their latest run from the task table, and their next slot
    (computed with croniter when the table does not store one)."""
    now = datetime.now(UTC)
    has_next = any("next" in k for r in schedules for k in r)

    def extra(row: dict[str, Any]) -> list[str]:
        last = next((runs[str(row[k])] for k in _CRON_KEYS if str(row.get(k)) in runs), None)
        out = [_e(f"{last['state']} (slot {_when(last['cron_at'])})") if last else "-"]
        if not has_next:
            out.append(_e(_next_cron(row, now)))
        return out

    head = ("latest run",) if has_next else ("latest run", "next run")
    return _generic_rows(schedules, first=_CRON_FIRST, extra_head=head, extra=extra)


def _next_cron(row: dict[str, Any], now: datetime) -> str:
    expr = next((row[k] for k in _CRON_EXPR if isinstance(row.get(k), str)), None)
    if not expr:
        return "-"
    try:
        tz_name = row.get("timezone") or row.get("tz") or "UTC"
        start = now.astimezone(ZoneInfo(str(tz_name)))
        return _when(croniter(expr, start).get_next(datetime))
    except Exception:
        return "-"


def _our_advisory_class() -> int | None:
    """The first key of the lock feature's advisory locks, to name them on the page."""
    try:
        return int(advisory_keys("status-page", DEFAULT_NAMESPACE)[0])
    except Exception:
        return None


def _lock_key(row: dict[str, Any], ours: int | None) -> tuple[str, str]:
    """Advisory keys as the application wrote them: pg_locks shows them as two unsigned oids."""
    classid, objid, sub = int(row["classid"]), int(row["objid"]), int(row["objsubid"])
    if sub == 1:  # one bigint key, split over two oids
        key = (classid << 32) | objid
        key = key - 2**64 if key >= 2**63 else key
        return str(key), ""
    k1 = classid - 2**32 if classid >= 2**31 else classid
    k2 = objid - 2**32 if objid >= 2**31 else objid
    what = "worker migration" if k1 == MIGRATE_LOCK_CLASS else "worker lock" if k1 == ours else ""
    return f"({k1}, {k2})", what


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


def render_page(page: PageData, *, schema: str, dsn: str, expected_version: int, ttl: float) -> str:
    """The whole status page as one HTML string; every dynamic value goes through ``_e``."""
    snap = page.snapshot
    parts: list[str] = []
    parts.append(
        "<header><h1>worker status</h1>"
        f'<div class="meta">schema <code>{_e(schema)}</code> · database <code>{_e(dsn)}</code>'
        f" · schema version {_e(page.version or '?')} (code expects {_e(expected_version)})"
        f" · data as of {_e(_when(page.wall))}, refreshed at most every {_e(f'{ttl:g}')} s"
        "</div></header><main>"
    )
    for err in dict.fromkeys(e for e in (snap.error, page.error) if e):
        parts.append(f'<div class="banner">database problem: {_e(err)}</div>')

    total_queued = sum(q.queued for q in snap.queues)
    oldest = max((q.oldest_seconds or 0.0 for q in snap.queues), default=0.0)
    failed_total = (
        sum(n for (_, s), n in page.finished.items() if s == "failed")
        if page.finished is not None
        else snap.estimates.get("failed")
    )
    cards = [
        (("≥" if any(q.capped for q in snap.queues) else "") + _num(total_queued), "queued"),
        (_num(sum(q.running for q in snap.queues)), "in progress"),
        (_age(oldest) if oldest else "-", "oldest due task waited"),
        (_num(snap.workers_alive), "workers alive"),
        (_num(failed_total), "failed (kept)" if page.finished is not None else "failed (≈)"),
    ]
    parts.append(
        '<div class="cards">'
        + "".join(
            f'<div class="card"><b>{v}</b><span>{_e(label)}</span></div>' for v, label in cards
        )
        + "</div>"
    )

    # queues
    parts.append('<h2 id="queues">Queues</h2>')
    names = sorted({q.queue for q in snap.queues} | {k[0] for k in (page.finished or {})})
    by_name = {q.queue: q for q in snap.queues}
    rows = []
    for name in names:
        q = by_name.get(name) or QueueRow(name, 0, 0, 0, False, None)
        queued = f"≥{_num(q.queued)}" if q.capped else _num(q.queued)
        cells = [
            f'<td data-col="queue">{_e(name)}</td>',
            f'<td class="n" data-col="queued">{queued}</td>',
            f'<td class="n" data-col="delayed">{_num(q.delayed)}</td>',
            f'<td class="n" data-col="in_progress">{_num(q.running)}</td>',
        ]
        for state in ("done", "failed", "cancelled"):
            value = _num(page.finished.get((name, state), 0)) if page.finished is not None else "-"
            cls = " bad" if state == "failed" and value not in ("0", "-") else ""
            cells.append(f'<td class="n{cls}" data-col="{state}">{value}</td>')
        age_cls = " warn" if (q.oldest_seconds or 0) > 60 else ""
        cells.append(f'<td class="n{age_cls}" data-col="oldest">{_age(q.oldest_seconds)}</td>')
        rows.append(f'<tr data-queue="{_e(name)}">{"".join(cells)}</tr>')
    parts.append(
        _table(
            [
                "queue",
                "queued",
                "of which delayed",
                "in progress",
                "done",
                "failed",
                "cancelled",
                "oldest due",
            ],
            rows,
            cls="queues",
            empty="no tasks",
        )
    )
    if page.finished is None:
        est = ", ".join(f"{s} ≈ {_num(n)}" for s, n in sorted(snap.estimates.items()))
        parts.append(
            '<p class="note">The task table is large, so finished rows are not counted per '
            f"queue. Planner estimates for the whole table: {_e(est or 'not analyzed yet')}.</p>"
        )
    parts.append(
        '<p class="note">Queued counts stop at the counting cap (shown as ≥); "oldest due" is '
        "how long the oldest task that may run now has waited.</p>"
    )

    # workers
    parts.append(f'<h2 id="workers">Workers ({len(page.workers)} registered and not stopped)</h2>')
    wrows = []
    for w in page.workers:
        hb = w.get("heartbeat_age_seconds")
        hb_cls = " bad" if hb is not None and hb > ALIVE_SECONDS else ""
        wrows.append(
            "<tr>"
            f'<td><code title="{_e(w["id"])}">{_e(str(w["id"])[:8])}</code></td>'
            f'<td>{_e(w["host"])}</td><td class="n">{_e(w["pid"])}</td>'
            f"<td>{_e(', '.join(w.get('queues') or []))}</td>"
            f'<td class="n">{_e(w["concurrency"])}</td>'
            f"<td>{_e(_when(w['started_at']))}</td>"
            f'<td class="n{hb_cls}">{_e(_age(hb))} ago</td>'
            f'<td class="n">{_e(w["in_flight"])}</td>'
            "</tr>"
        )
    parts.append(
        _table(
            ["worker", "host", "pid", "queues", "slots", "started", "heartbeat", "in flight"],
            wrows,
            empty="no worker is running",
        )
    )

    # failures
    parts.append('<h2 id="failed">Recent failed tasks</h2>')
    frows = []
    for f in page.failed:
        error = f.get("last_error") or ""
        first, _, rest = error.partition("\n")
        err_html = (
            f"<details><summary>{_e(first)}</summary>{_e(rest)}</details>" if rest else _e(first)
        )
        frows.append(
            f'<tr data-task-id="{_e(f["id"])}">'
            f'<td class="n">{_e(f["id"])}</td><td>{_e(f["task"])}</td><td>{_e(f["queue"])}</td>'
            f'<td class="n">{_e(f["attempts"])}/{_e(f["max_attempts"])}</td>'
            f"<td>{_e(_when(f['finished_at']))}</td>"
            f'<td class="err">{err_html}</td></tr>'
        )
    parts.append(
        _table(
            ["id", "task", "queue", "attempts", "failed at", "last error"],
            frows,
            empty="no failed task among the most recent finished ones",
        )
    )

    # cron
    parts.append('<h2 id="cron">Cron</h2>')
    runs = {str(r["cron_key"]): r for r in page.cron_runs}
    if page.cron_schedules is None:
        parts.append(f'<p class="note">No <code>{_e(schema)}.cron_schedules</code> table.</p>')
    else:
        parts.append("<h3>Schedules</h3>")
        parts.append(_cron_table(page.cron_schedules, runs))
    parts.append("<h3>Latest run of each cron key (from the task table)</h3>")
    parts.append(
        _table(
            ["cron key", "slot", "state", "finished"],
            [
                f"<tr><td>{_e(r['cron_key'])}</td><td>{_e(_when(r['cron_at']))}</td>"
                f"<td>{_e(r['state'])}</td><td>{_e(_when(r['finished_at']))}</td></tr>"
                for r in page.cron_runs
            ],
            empty="no cron runs kept",
        )
    )

    # locks
    parts.append('<h2 id="locks">Locks</h2>')
    if page.locks is None:
        parts.append(f'<p class="note">No <code>{_e(schema)}.locks</code> table.</p>')
    else:
        parts.append("<h3>Lock table</h3>")
        parts.append(_generic_rows(page.locks, first=_LOCK_FIRST))
    parts.append("<h3>Advisory locks held in this database</h3>")
    arows = []
    ours = _our_advisory_class()
    for a in page.advisory:
        key, what = _lock_key(a, ours)
        arows.append(
            f"<tr><td><code>{_e(key)}</code></td><td>{_e(what)}</td><td>{_e(a['mode'])}</td>"
            f'<td class="n">{_e(a["pid"])}</td><td>{_e(a.get("application_name"))}</td>'
            f"<td>{_e(a.get('client_addr'))}</td><td>{_e(a.get('state'))}</td>"
            f'<td class="n">{_e(_age(a.get("xact_seconds")))}</td></tr>'
        )
    parts.append(
        _table(
            ["key", "known as", "mode", "pid", "application", "client", "state", "transaction"],
            arows,
            empty="no advisory lock held",
        )
    )
    parts.append("</main>")
    return (
        '<!DOCTYPE html><html lang="en"><head><meta charset="utf-8">'
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        f"<title>worker status · {_e(schema)}</title><style>{_STYLE}</style></head><body>"
        + "".join(parts)
        + "</body></html>"
    )


__all__ = ["CSP", "render_page"]
