"""The checks of `worker doctor` on the task table itself: dead rows, bloat, indexes grown past
their rows, and whether autovacuum keeps up, from ``pg_stat_user_tables`` and the table's storage
options (doctor.sql).
Reading and judging are apart, as in ``checks``: ``read_tables`` runs the statement,
``table_findings`` is pure.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import psycopg

from .checks import ROWS, Row, int_setting, rows
from .findings import CRITICAL, OK, WARNING, Finding, Thresholds, age, quote, size


def read_tables(conn: psycopg.Connection, schema: str) -> list[dict[str, Any]]:
    return rows(conn, schema, "doctor_tables", {"schema": schema, "limit": ROWS})


def _option(options: list[str], name: str) -> str | None:
    for item in options or []:
        key, _, value = str(item).partition("=")
        if key == name:
            return value
    return None


# What one row version costs an index at most, for the keys of the queue's indexes (ids, times,
# states, queue and task names, dedupe keys of a few dozen characters), at the pages' fill factor.
# An index much larger than this many bytes per row version kept pages it no longer needs.
ENTRY_BYTES = 64 / 0.9


def needed_index_bytes(t: Row) -> float:
    """What the table's indexes need for the row versions it holds, live and dead (an entry
    stays until vacuum removes its row), with a root and a meta page each. The statistics'
    counts start again from 0 after a crash or a reset, so the row count the last vacuum or
    analyse left in the catalog is a floor."""
    counted = int(t.get("live") or 0) + int(t.get("dead") or 0)
    versions = max(counted, int(t.get("reltuples") or 0))
    indexes = int(t.get("index_count") or 0)
    return indexes * (versions * ENTRY_BYTES + 2 * 8192)


def _ago(seconds: float | None) -> str:
    return "never" if seconds is None else f"{age(seconds)} ago"


def autovacuum_threshold(t: Row, settings: Mapping[str, str]) -> float:
    """Dead rows at which autovacuum visits the table: its own settings, else the server's."""
    opts = t.get("reloptions") or []
    base = _option(opts, "autovacuum_vacuum_threshold")
    factor = _option(opts, "autovacuum_vacuum_scale_factor")
    b = float(base if base is not None else settings.get("autovacuum_vacuum_threshold", 50))
    f = float(factor if factor is not None else settings.get("autovacuum_vacuum_scale_factor", 0.2))
    return b + f * float(t.get("reltuples") or 0.0)


def table_findings(
    schema: str,
    tables: list[Row],
    settings: Mapping[str, str],
    th: Thresholds,
    *,
    horizon_held: bool,
) -> list[Finding]:
    """Dead rows and sizes per table; autovacuum off, or not keeping up."""
    out: list[Finding] = []
    naptime = float(int_setting(settings, "autovacuum_naptime", 60))
    server_on = settings.get("autovacuum", "on") == "on"
    if not server_on:
        out.append(
            Finding(
                "autovacuum_disabled",
                WARNING,
                "autovacuum is off for the whole server: dead rows of the queue pile up until "
                "someone vacuums",
                "set autovacuum = on (postgresql.conf or ALTER SYSTEM) and reload",
                {"table": None},
            )
        )
    if settings.get("track_counts") == "off":
        out.append(
            Finding(
                "autovacuum_disabled",
                WARNING,
                "track_counts is off: autovacuum cannot tell which tables need it, and every "
                "dead-row figure here reads 0",
                "set track_counts = on (postgresql.conf or ALTER SYSTEM) and reload",
                {"table": None},
            )
        )
    shown: dict[str, str] = {}
    for t in tables:
        name = f"{schema}.{t['name']}"
        dead = int(t.get("dead") or 0)
        since = [s for s in (t.get("vacuum_seconds"), t.get("autovacuum_seconds")) if s is not None]
        last = min(since) if since else None
        figures = (
            f"{name}: {dead:,} dead and {int(t.get('live') or 0):,} live row versions, table "
            f"{size(t.get('table_bytes'))}, indexes {size(t.get('index_bytes'))}; last vacuum "
            f"{_ago(t.get('vacuum_seconds'))}, last autovacuum {_ago(t.get('autovacuum_seconds'))}"
        )
        shown[t["name"]] = figures
        details = {
            "table": t["name"],
            "dead": dead,
            "live": t.get("live"),
            "table_bytes": t.get("table_bytes"),
            "index_bytes": t.get("index_bytes"),
            "vacuum_seconds": t.get("vacuum_seconds"),
            "autovacuum_seconds": t.get("autovacuum_seconds"),
        }
        if dead >= th.dead_tuples_warning:
            sev = CRITICAL if dead >= th.dead_tuples_critical else WARNING
            if horizon_held:
                action = (
                    "vacuum cannot remove them while the horizon is held: end the transaction, "
                    "prepared transaction or slot named by the xmin findings"
                )
            else:
                action = (
                    f"VACUUM (VERBOSE) {name}; if they come back, let autovacuum work faster "
                    "(autovacuum_vacuum_cost_limit, autovacuum_vacuum_cost_delay)"
                )
            out.append(Finding("dead_tuples_high", sev, figures, action, details))
        enabled = _option(t.get("reloptions") or [], "autovacuum_enabled")
        if enabled is not None and enabled.lower() in ("false", "off", "0", "no"):
            out.append(
                Finding(
                    "autovacuum_disabled",
                    WARNING,
                    f"autovacuum is off for {name} (autovacuum_enabled = false); {dead:,} dead "
                    "row versions",
                    f"ALTER TABLE {name} RESET (autovacuum_enabled)",
                    details,
                )
            )
        threshold = autovacuum_threshold(t, settings)
        stale = last is None or last > 2 * naptime
        if dead > th.autovacuum_factor * threshold and dead >= 1000 and stale:
            out.append(
                Finding(
                    "autovacuum_behind",
                    WARNING,
                    f"{name}: {dead:,} dead row versions, {dead / max(threshold, 1):.0f} times "
                    f"autovacuum's threshold ({threshold:,.0f}), and no vacuum in "
                    f"{'its history' if last is None else age(last)} (naptime {age(naptime)})",
                    "check that autovacuum runs (pg_stat_activity, autovacuum_max_workers busy "
                    f"on other tables?), and VACUUM {name} now",
                    details | {"threshold": threshold},
                )
            )
        out += _oversized(name, t, th, details, horizon_held=horizon_held)
    if not any(f.code == "dead_tuples_high" for f in out):
        out.append(
            Finding(
                "dead_tuples_high",
                OK,
                f"none of the {len(tables)} table(s) of schema {quote(schema)} holds "
                f"{th.dead_tuples_warning:,} dead row versions or more"
                + (f"; {shown['tasks']}" if "tasks" in shown else ""),
                "none needed",
                {"tables": len(tables)},
            )
        )
    for code, what in (
        ("autovacuum_disabled", "autovacuum is on for the server and the queue's tables"),
        ("autovacuum_behind", "autovacuum keeps up with the queue's tables"),
        ("indexes_oversized", "the queue tables' indexes are in proportion to their rows"),
    ):
        if not any(f.code == code for f in out):
            out.append(Finding(code, OK, what, "none needed"))
    return out


def _oversized(
    name: str, t: Row, th: Thresholds, details: dict[str, Any], *, horizon_held: bool
) -> list[Finding]:
    """Indexes that grew while vacuum could not keep up (a held transaction, a backlog since
    drained) keep their size: vacuum frees their pages for reuse but never gives them back."""
    have = int(t.get("index_bytes") or 0)
    need = needed_index_bytes(t)
    if have < th.index_min_bytes or have <= th.index_factor * need:
        return []
    then = "once the transaction holding the xmin horizon has ended, " if horizon_held else ""
    return [
        Finding(
            "indexes_oversized",
            WARNING,
            f"{name}: its {int(t.get('index_count') or 0)} indexes take {size(have)} for "
            f"{int(t.get('live') or 0):,} live and {int(t.get('dead') or 0):,} dead row "
            f"versions, which need about {size(need)}: they grew while vacuum could not remove "
            "entries and keep their size (scans skip the empty pages; the disk and the cache "
            "carry them)",
            f"{then}REINDEX TABLE CONCURRENTLY {name} (the workers go on; it needs room for a "
            "second copy of each index while it runs)",
            details | {"index_count": t.get("index_count"), "needed_bytes": round(need)},
        )
    ]


__all__ = [
    "ENTRY_BYTES",
    "autovacuum_threshold",
    "needed_index_bytes",
    "read_tables",
    "table_findings",
]
