"""The pieces of every page (the status page's and the console's): escaping and cutting,
numbers, ages, the one way a time is shown (``stamp``), the badge of a task state (``badge``),
and the tables of rows that other features own (cron schedules, locks), whose columns the page
does not fix.

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
    """A time as text: ``2025-01-05 14:03:22 UTC`` (for places that cannot hold markup: a chart's
    tooltip, a message); pages show times with ``stamp``, whose text this is."""
    if isinstance(value, datetime):
        if value.year in (1, 9999):  # what the console reads for -infinity and infinity
            return "-infinity" if value.year == 1 else "infinity"
        return value.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S UTC")
    return "-" if value is None else str(value)


def relative(value: datetime, now: datetime | None = None) -> str:
    """How long ago (or how far ahead) ``value`` is: ``just now``, ``42 s ago``, ``3 min ago``,
    ``in 5 h``, ``12 d ago``."""
    seconds = ((now or datetime.now(UTC)) - value).total_seconds()
    span = abs(seconds)
    if span < 5:
        return "just now"
    if span < 90:
        n, unit = round(span), "s"
    elif span < 90 * 60:
        n, unit = round(span / 60), "min"
    elif span < 36 * 3600:
        n, unit = round(span / 3600), "h"
    else:
        n, unit = round(span / 86400), "d"
    return f"in {n:,} {unit}" if seconds < 0 else f"{n:,} {unit} ago"


def as_time(value: Any) -> datetime | None:
    """A datetime, or a timestamp as to_jsonb writes it (``2025-01-05T14:03:22.5+00:00``)."""
    if isinstance(value, datetime):
        return value if value.tzinfo else value.replace(tzinfo=UTC)
    if isinstance(value, str) and len(value) >= 19 and value[4] == "-" and value[10] == "T":
        with contextlib.suppress(ValueError):
            parsed = datetime.fromisoformat(value)
            return parsed if parsed.tzinfo else parsed.replace(tzinfo=UTC)
    return None


def stamp(value: Any, now: datetime | None = None) -> str:
    """A time as every page shows it: ``2025-01-05 14:03:22 UTC`` in a ``<time>`` element whose
    title says how long ago it was; ``-`` for none; anything else escaped as it is."""
    at = as_time(value)
    if at is None:
        return esc(when(value))
    if at.year in (1, 9999):
        return esc(when(at))
    iso = at.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    return f'<time datetime="{iso}" title="{relative(at, now)}">{when(at)}</time>'


# The task states, in the order a task goes through them, with the label each is shown with. Each
# has its colour (the style sheet's .state-NAME), always beside its label, never alone.
STATE_LABELS = {
    "waiting": "waiting",  # a workflow's step, until its dependencies finish
    "scheduled": "scheduled",
    "queued": "queued",
    "in_progress": "in progress",
    "done": "done",
    "failed": "failed",
    "cancelled": "cancelled",
}


def badge(state: Any, label: str | None = None) -> str:
    """A task state as a coloured label (its own label, or ``label``)."""
    name = str(state)
    shown = label if label is not None else STATE_LABELS.get(name, name)
    cls = f"state state-{name}" if name in STATE_LABELS else "state"
    return f'<span class="{cls}">{esc(shown)}</span>'


def cell(value: Any) -> str:
    if isinstance(value, dict | list):
        return esc(json.dumps(value, sort_keys=True, default=str))
    if as_time(value) is not None:
        return stamp(value)  # a datetime, or a timestamp from to_jsonb
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
        out = [f"{badge(last['state'])} slot {stamp(last['cron_at'])}" if last else "-"]
        if not has_next:
            out.append(stamp(next_cron(row, now)))
        return out

    head = ("latest run",) if has_next else ("latest run", "next run")
    return generic_rows(schedules, first=CRON_FIRST, extra_head=head, extra=extra)


def next_cron(row: dict[str, Any], now: datetime) -> datetime | None:
    expr = next((row[k] for k in CRON_EXPR if isinstance(row.get(k), str)), None)
    if not expr:
        return None
    try:
        tz_name = row.get("timezone") or row.get("tz") or "UTC"
        start = now.astimezone(ZoneInfo(str(tz_name)))
        found = croniter(expr, start).get_next(datetime)
        return found if isinstance(found, datetime) else None
    except Exception:
        return None


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
    "STATE_LABELS",
    "age",
    "as_time",
    "badge",
    "cron_table",
    "esc",
    "generic_rows",
    "lock_key",
    "more_note",
    "num",
    "our_advisory_class",
    "relative",
    "stamp",
    "table",
    "when",
]
