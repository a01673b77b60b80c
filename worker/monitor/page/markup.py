"""The status page's pieces: escaping and cutting, numbers, ages and times, and the tables of
rows that other features own (cron schedules, locks), whose columns the page does not fix.

Every value from the database goes through ``esc``: cut by ``bounds.clip``, then escaped.
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

from ...coord.advisory import advisory_keys
from ...coord.locks import DEFAULT_NAMESPACE
from ...db.migrate import MIGRATE_LOCK_CLASS
from ..bounds import NAME_CHARS, ROWS_SHOWN, clip


def esc(value: Any, limit: int = NAME_CHARS, length: int | None = None) -> str:
    """Cut anything to ``limit`` characters (see ``bounds.clip``) and escape it for HTML text or a
    quoted attribute."""
    return html.escape(clip(value, limit, length=length), quote=True)


def more_note(rows: list[Any], what: str) -> str:
    """The note under a table whose query returned one row more than the page shows."""
    if len(rows) <= ROWS_SHOWN:
        return ""
    return f'<p class="note">Only the first {ROWS_SHOWN} {esc(what)} are shown.</p>'


def num(n: int | float | None) -> str:
    if n is None:
        return "-"
    return f"{round(n):,}"


def age(seconds: float | None) -> str:
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


def when(value: Any) -> str:
    if isinstance(value, datetime):
        return value.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S UTC")
    return "-" if value is None else str(value)


def cell(value: Any) -> str:
    if isinstance(value, dict | list):
        return esc(json.dumps(value, sort_keys=True, default=str))
    if isinstance(value, str) and len(value) >= 19 and value[4] == "-" and value[10] == "T":
        with contextlib.suppress(ValueError):
            return esc(when(datetime.fromisoformat(value)))  # a timestamp from to_jsonb
    return esc(when(value))


def table(head: Iterable[str], rows: list[str], *, cls: str = "", empty: str = "none") -> str:
    cols = list(head)
    if not rows:
        rows = [f'<tr><td class="empty" colspan="{len(cols)}">{esc(empty)}</td></tr>']
    th = "".join(f"<th>{c}</th>" for c in cols)
    return (
        f'<table class="{cls}"><thead><tr>{th}</tr></thead><tbody>{"".join(rows)}</tbody></table>'
    )


def generic_rows(
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
        + "".join(f"<td>{cell(r.get(c))}</td>" for c in cols)
        + ("".join(f"<td>{x}</td>" for x in extra(r)) if extra else "")
        + "</tr>"
        for r in rows
    ]
    return table([esc(c) for c in cols] + list(extra_head), body, cls="generic")


CRON_FIRST = ("key", "expr", "tz", "task", "queue", "last_slot", "next_slot", "catch_up")
CRON_KEYS = ("key", "cron_key", "name")
CRON_EXPR = ("expr", "expression", "cron", "spec")
LOCK_FIRST = ("name", "kind", "holder", "acquired_at", "renewed_at", "expires_at")


def cron_table(schedules: list[dict[str, Any]], runs: dict[str, dict[str, Any]]) -> str:
    """Schedules with the state of their latest run from the task table, and their next slot
    (computed with croniter when the table does not store one)."""
    now = datetime.now(UTC)
    has_next = any("next" in k for r in schedules for k in r)

    def extra(row: dict[str, Any]) -> list[str]:
        last = next((runs[str(row[k])] for k in CRON_KEYS if str(row.get(k)) in runs), None)
        out = [esc(f"{last['state']} (slot {when(last['cron_at'])})") if last else "-"]
        if not has_next:
            out.append(esc(next_cron(row, now)))
        return out

    head = ("latest run",) if has_next else ("latest run", "next run")
    return generic_rows(schedules, first=CRON_FIRST, extra_head=head, extra=extra)


def next_cron(row: dict[str, Any], now: datetime) -> str:
    expr = next((row[k] for k in CRON_EXPR if isinstance(row.get(k), str)), None)
    if not expr:
        return "-"
    try:
        tz_name = row.get("timezone") or row.get("tz") or "UTC"
        start = now.astimezone(ZoneInfo(str(tz_name)))
        return when(croniter(expr, start).get_next(datetime))
    except Exception:
        return "-"


def our_advisory_class() -> int | None:
    """The first key of the lock feature's advisory locks, to name them on the page."""
    try:
        return int(advisory_keys("status-page", DEFAULT_NAMESPACE)[0])
    except Exception:
        return None


def lock_key(row: dict[str, Any], ours: int | None) -> tuple[str, str]:
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


__all__ = [
    "LOCK_FIRST",
    "age",
    "cron_table",
    "esc",
    "generic_rows",
    "lock_key",
    "more_note",
    "num",
    "our_advisory_class",
    "table",
    "when",
]
