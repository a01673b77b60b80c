"""The checks of `worker doctor` on what holds the xmin horizon back: sessions with an old
snapshot or transaction id (idle in a transaction or not), prepared transactions and replication
slots; and the sessions of other roles this role cannot see.

As in ``checks``, ``read_horizon`` runs the statements and the rest are pure.
"""

from __future__ import annotations

from typing import Any

import psycopg

from .checks import ROWS, Row, rows
from .findings import CRITICAL, OK, WARNING, Finding, Thresholds, age, quote, redact_query, size

NAMED = 5  # holders named one finding each; the last one lists the rest briefly
OTHERS = 50  # ... at most this many of them


def read_horizon(conn: psycopg.Connection, schema: str) -> dict[str, list[dict[str, Any]]]:
    return {
        "sessions": rows(conn, schema, "doctor_sessions", {"limit": ROWS}),
        "prepared": rows(conn, schema, "doctor_prepared", {"limit": ROWS}),
        "slots": rows(conn, schema, "doctor_slots", {"limit": ROWS}),
        "hidden": rows(conn, schema, "doctor_hidden_sessions"),
    }


def _pinned(dead: int | None) -> str:
    return "" if dead is None else f"; the task table holds {dead:,} dead row versions"


def _by_time(seconds: float | None, xid_age: int | None, th: Thresholds) -> str:
    """The severity of a holder: by how long it has held (or by its xid age, without a time)."""
    if seconds is not None:
        if seconds >= th.xmin_critical_seconds:
            return CRITICAL
        return WARNING if seconds >= th.xmin_warning_seconds else OK
    return _by_xid_age(xid_age, th)


def _by_xid_age(xid_age: int | None, th: Thresholds) -> str:
    if xid_age is None:
        return OK
    if xid_age >= th.xid_age_critical:
        return CRITICAL
    return WARNING if xid_age >= th.xid_age_warning else OK


def session_details(s: Row) -> dict[str, Any]:
    return {
        "pid": s["pid"],
        "application_name": s.get("application_name") or "",
        "user": s.get("usename"),
        "database": s.get("datname"),
        "client_addr": s.get("client_addr"),
        "backend_type": s.get("backend_type"),
        "state": s.get("state"),
        "xact_seconds": s.get("xact_seconds"),
        "state_seconds": s.get("state_seconds"),
        "backend_xid": s.get("backend_xid"),
        "backend_xmin": s.get("backend_xmin"),
        "xid_age": s.get("xid_age"),
        "query": redact_query(s.get("query")),
    }


def _who(s: Row) -> str:
    parts = [f"pid {s['pid']}", f"application {quote(s.get('application_name') or '')}"]
    if s.get("usename"):
        parts.append(f"user {quote(s['usename'], 40)}")
    if s.get("datname"):
        parts.append(f"database {quote(s['datname'], 40)}")
    parts.append(str(s.get("state") or s.get("backend_type") or "unknown state"))
    return ", ".join(parts)


def _others(flagged: list[tuple[Row, str]], i: int) -> list[dict[str, Any]]:
    """The last named finding lists (briefly) the sessions past the first NAMED."""
    if i != NAMED - 1:
        return []
    return [
        {
            "pid": s["pid"],
            "application_name": s.get("application_name") or "",
            "database": s.get("datname"),
            "state": s.get("state"),
            "xact_seconds": s.get("xact_seconds"),
            "state_seconds": s.get("state_seconds"),
        }
        for s, _ in flagged[NAMED : NAMED + OTHERS]
    ]


def horizon_findings(sessions: list[Row], pinned_dead: int | None, th: Thresholds) -> list[Finding]:
    """One finding per session holding the horizon past the thresholds (the oldest NAMED), and
    idle-in-transaction sessions that hold no snapshot but still locks and a connection."""
    holders = [
        (s, _by_time(s.get("xact_seconds"), s.get("xid_age"), th)) for s in sessions if s["holds"]
    ]
    flagged = [(s, sev) for s, sev in holders if sev != OK]
    out: list[Finding] = []
    for i, (s, sev) in enumerate(flagged[:NAMED]):
        more = len(flagged) - NAMED
        tail = f" (and {more} more session(s) like it)" if i == NAMED - 1 and more > 0 else ""
        held = (
            f"has held a transaction open for {age(s['xact_seconds'])}"
            if s.get("xact_seconds") is not None
            else "holds the horizon"
        )
        query = redact_query(s.get("query"))
        out.append(
            Finding(
                "xmin_horizon_held",
                sev,
                f"{_who(s)} {held} (xmin age {s.get('xid_age') or 0:,} transactions): vacuum "
                f"cannot remove rows that died since{_pinned(pinned_dead)}; last query "
                f"{quote(query, 200)}{tail}",
                f"end that transaction (in its application, or SELECT pg_terminate_backend("
                f"{s['pid']})); set idle_in_transaction_session_timeout so it cannot recur",
                session_details(s) | {"pinned_dead": pinned_dead, "others": _others(flagged, i)},
            )
        )
    if not out:
        oldest = max((s.get("xact_seconds") or 0.0 for s, _ in holders), default=0.0)
        out.append(
            Finding(
                "xmin_horizon_held",
                OK,
                f"no session holds the xmin horizon longer than {age(th.xmin_warning_seconds)} "
                f"(oldest transaction holding it: {age(oldest)}){_pinned(pinned_dead)}",
                "none needed",
                {"oldest_seconds": oldest, "pinned_dead": pinned_dead},
            )
        )
    flagged_pids = {s["pid"] for s, _ in flagged}
    idle = [
        s
        for s in sessions
        if str(s.get("state") or "").startswith("idle in transaction")
        and s["pid"] not in flagged_pids
        and (s.get("state_seconds") or 0.0) >= th.xmin_warning_seconds
    ]
    for i, s in enumerate(idle[:NAMED]):
        out.append(
            Finding(
                "idle_in_transaction",
                WARNING,
                f"{_who(s)} has been idle inside a transaction for {age(s['state_seconds'])} "
                f"(it holds its locks and a connection); last query "
                f"{quote(redact_query(s.get('query')), 200)}",
                f"commit or roll back in its application, or SELECT pg_terminate_backend("
                f"{s['pid']}); set idle_in_transaction_session_timeout",
                session_details(s) | {"others": _others([(x, WARNING) for x in idle], i)},
            )
        )
    if not idle:
        out.append(
            Finding(
                "idle_in_transaction",
                OK,
                f"no other session idle in a transaction for {age(th.xmin_warning_seconds)} or "
                "more",
                "none needed",
            )
        )
    return out


def prepared_findings(
    prepared: list[Row], pinned_dead: int | None, th: Thresholds
) -> list[Finding]:
    flagged = [(p, _by_time(p.get("prepared_seconds"), None, th)) for p in prepared]
    flagged = [(p, sev) for p, sev in flagged if sev != OK]
    out = []
    for p, sev in flagged[:NAMED]:
        gid = str(p["gid"])
        out.append(
            Finding(
                "prepared_xact_held",
                sev,
                f"prepared transaction {quote(gid)} (owner {quote(p.get('owner'), 40)}, database "
                f"{quote(p.get('database'), 40)}) has waited {age(p['prepared_seconds'])} for its "
                f"COMMIT PREPARED (xmin age {p.get('xid_age') or 0:,}): it holds the horizon and "
                f"its locks{_pinned(pinned_dead)}",
                f"ask its transaction manager which outcome it wanted, then COMMIT PREPARED or "
                f"ROLLBACK PREPARED {quote(gid, 200)} in database {quote(p.get('database'), 40)}",
                {
                    "gid": gid,
                    "owner": p.get("owner"),
                    "database": p.get("database"),
                    "prepared_seconds": p.get("prepared_seconds"),
                    "xid_age": p.get("xid_age"),
                    "pinned_dead": pinned_dead,
                },
            )
        )
    if not out:
        out.append(
            Finding(
                "prepared_xact_held",
                OK,
                f"{len(prepared)} prepared transaction(s), none older than "
                f"{age(th.xmin_warning_seconds)}",
                "none needed",
                {"prepared": len(prepared)},
            )
        )
    return out


def slot_findings(slots: list[Row], th: Thresholds) -> list[Finding]:
    """Slots holding the horizon (xmin: every table; catalog_xmin: the catalogs) past the xid age
    thresholds, inactive slots that hold either, and inactive slots retaining much WAL."""
    out = []
    for r in slots:
        xmin_age, cat_age = r.get("xmin_age"), r.get("catalog_xmin_age")
        retained = r.get("retained_bytes")
        sev = _by_xid_age(max(xmin_age or 0, cat_age or 0) or None, th)
        inactive = not r.get("active")
        holds = xmin_age is not None or cat_age is not None
        too_much_wal = retained is not None and retained >= th.slot_wal_bytes
        if inactive and (holds or too_much_wal) and sev == OK:
            sev = WARNING
        if r.get("wal_status") == "lost":
            sev = CRITICAL
        if sev == OK:
            continue
        held = []
        if xmin_age is not None:
            held.append(f"xmin age {xmin_age:,} (every table's horizon)")
        if cat_age is not None:
            held.append(f"catalog_xmin age {cat_age:,} (the system catalogs')")
        name = str(r["slot_name"])
        state = "inactive" if inactive else f"active, pid {r.get('active_pid')}"
        out.append(
            Finding(
                "replication_slot_held",
                sev,
                f"{r.get('slot_type')} replication slot {quote(name)} "
                f"({state})"
                f" holds {', '.join(held) or 'no horizon'} and retains {size(retained)} of WAL"
                f" (wal_status {r.get('wal_status') or '-'})",
                f"start its consumer again, or if none will come back: SELECT "
                f"pg_drop_replication_slot({quote(name, 200)})",
                {
                    "slot_name": name,
                    "slot_type": r.get("slot_type"),
                    "database": r.get("database"),
                    "active": bool(r.get("active")),
                    "xmin_age": xmin_age,
                    "catalog_xmin_age": cat_age,
                    "retained_bytes": retained,
                    "wal_status": r.get("wal_status"),
                },
            )
        )
    if not out:
        out.append(
            Finding(
                "replication_slot_held",
                OK,
                f"{len(slots)} replication slot(s), none holding the horizon or WAL back",
                "none needed",
                {"slots": len(slots)},
            )
        )
    return out[: NAMED + 1]


def hidden_findings(hidden: int, sees_all: bool) -> list[Finding]:
    if sees_all or not hidden:
        return []
    return [
        Finding(
            "stats_hidden",
            WARNING,
            f"{hidden} session(s) of other roles are hidden from this role: their states, start "
            "times and queries cannot be read, so one holding the horizon is only judged by its "
            "xid age",
            "run doctor as a superuser, or GRANT pg_monitor (or pg_read_all_stats) TO this role",
            {"hidden": hidden},
        )
    ]


def horizon_age(sessions: list[Row], prepared: list[Row], slots: list[Row]) -> tuple[float, int]:
    """(seconds, transactions): how old the oldest holder of the horizon is (0, 0 when none)."""
    seconds = [s.get("xact_seconds") or 0.0 for s in sessions if s["holds"]]
    seconds += [p.get("prepared_seconds") or 0.0 for p in prepared]
    xids = [s.get("xid_age") or 0 for s in sessions if s["holds"]]
    xids += [p.get("xid_age") or 0 for p in prepared]
    xids += [r.get("xmin_age") or 0 for r in slots]
    return max(seconds, default=0.0), int(max(xids, default=0))
