"""What `worker doctor` reports: findings, their severities and thresholds, and the text helpers
its checks share (ages, sizes, and query text with its secrets taken out).

A finding is one line for a person: a stable ``code`` (for scripts, alerts and the
``worker_doctor_findings`` gauge), a ``severity`` (ok, warning or critical), a ``summary`` with
the figures, and an ``action``: what to do about it. ``details`` holds the same figures for
``--json``. Every check reports under its own code, with severity ok when it found nothing, so
the output says what was checked as well as what is wrong.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field
from typing import Any

from ...db.dsn import scrub

OK, WARNING, CRITICAL = "ok", "warning", "critical"
SEVERITIES = (OK, WARNING, CRITICAL)
_RANK = {s: i for i, s in enumerate(SEVERITIES)}

# Every code a finding can carry, with what its check looks at (for --help, the README and the
# metric's label values: a fixed set, never data from the database).
CODES: dict[str, str] = {
    "xmin_horizon_held": "a session's open transaction or snapshot keeps vacuum from removing "
    "dead rows",
    "idle_in_transaction": "a session left idle inside a transaction (holds locks and a "
    "connection)",
    "prepared_xact_held": "a prepared (two-phase) transaction nobody committed or rolled back",
    "replication_slot_held": "a replication slot that holds the xmin horizon or retains WAL",
    "stats_hidden": "sessions of other roles this role cannot see",
    "dead_tuples_high": "dead row versions in the queue's tables",
    "autovacuum_behind": "dead rows far above the autovacuum threshold with no recent vacuum",
    "autovacuum_disabled": "autovacuum off for the server or a queue table",
    "indexes_oversized": "a queue table's indexes far larger than its rows need",
    "claim_cost_high": "buffers the claim statement reads per row it claims",
    "connections_low": "connection headroom",
    "tasks_running_long": "tasks in progress for longer than expected",
    "leases_expired": "running tasks whose lease ran out and nobody rescued",
    "queue_unserved": "due tasks in queues that no live worker serves",
    "handler_missing": "tasks waiting for a handler no live worker has",
    "check_failed": "a check that could not run",
}


@dataclass
class Finding:
    code: str
    severity: str
    summary: str
    action: str
    details: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        assert self.code in CODES, self.code
        assert self.severity in SEVERITIES, self.severity

    @property
    def rank(self) -> int:
        return _RANK[self.severity]

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def worst(findings: list[Finding]) -> str:
    return max((f.severity for f in findings), key=_RANK.__getitem__, default=OK)


def ordered(findings: list[Finding]) -> list[Finding]:
    """Critical first, then warnings, then ok; the checks' order within each."""
    return sorted(findings, key=lambda f: -f.rank)


@dataclass
class Thresholds:
    """When a figure becomes a warning or critical (the CLI's options; the scrape uses these
    defaults)."""

    xmin_warning_seconds: float = 300.0  # a transaction or snapshot held this long
    xmin_critical_seconds: float = 3600.0
    xid_age_warning: int = 10_000_000  # for holders with no start time (slots, walsenders)
    xid_age_critical: int = 100_000_000
    dead_tuples_warning: int = 100_000  # dead row versions in one queue table
    dead_tuples_critical: int = 1_000_000
    autovacuum_factor: float = 4.0  # dead rows over this many times the autovacuum threshold
    index_factor: float = 4.0  # indexes this many times what their row versions need
    index_min_bytes: int = 64 * 1024**2  # and at least this large (smaller is never reported)
    slot_wal_bytes: int = 1024**3  # WAL an inactive slot may retain
    claim_base_buffers: int = 20  # buffers a claim's scan may read whatever it claims
    claim_buffers_per_row: int = 4  # and per row it claims; ten times both is critical
    connections_warning: float = 0.80  # share of the connections non-superusers may open
    connections_critical: float = 0.95
    long_task_seconds: float = 3600.0  # a task in progress this long
    lease_grace_seconds: float = 60.0  # a lease expired this long ago and still not rescued


# -- text ------------------------------------------------------------------------------------------


def age(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    seconds = max(seconds, 0.0)
    if seconds < 120:
        return f"{seconds:.1f}s"
    if seconds < 7200:
        return f"{seconds / 60:.1f}m"
    if seconds < 172800:
        return f"{seconds / 3600:.1f}h"
    return f"{seconds / 86400:.1f}d"


def size(n: float | None) -> str:
    if n is None:
        return "-"
    for unit in ("B", "kB", "MB", "GB"):
        if abs(n) < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TB"


def quote(name: object, limit: int = 80) -> str:
    """A name from the database as the finding shows it: quoted, cut."""
    text = "" if name is None else str(name)
    return repr(text[:limit] + ("..." if len(text) > limit else ""))


QUERY_CHARS = 200

# A secret's keyword, then (within a few characters: a column name's rest, a quote, an operator)
# its value: a string literal (standard, E'' or dollar-quoted), a quoted identifier, or after an
# "=" a bare word. The value goes, the keyword stays: "PASSWORD '***'".
_SECRET = re.compile(
    r"""(?P<key>(?:pass(?:word|wd)?|pwd|secret|token|api_?key|credentials?|private_?key)\w*)
        (?P<gap>["']?\s*(?:=>|:=|=|:|,)?\s*)
        (?P<value>
            [Ee]'(?:[^'\\]|\\.|'')*(?:'|$)
          | '(?:[^']|'')*(?:'|$)
          | \$(?P<tag>[A-Za-z_]*)\$.*?(?:\$(?P=tag)\$|$)
          | "[^"]*(?:"|$)
          | [^\s,;)'"]+
        )""",
    re.IGNORECASE | re.VERBOSE | re.DOTALL,
)


def _mask(m: re.Match[str]) -> str:
    value, gap = m["value"], m["gap"]
    bare = not value.startswith(("'", '"', "$", "E'", "e'"))
    if bare and not any(op in gap for op in "=:"):
        return m[0]  # a keyword followed by a plain word ("password_hash FROM"): no value
    return f"{m['key']}{gap}'***'"


def redact_query(text: str | None, limit: int = QUERY_CHARS) -> str:
    """A statement from pg_stat_activity fit to show: secret literals masked (``ALTER ROLE bob
    PASSWORD '***'``), DSN passwords scrubbed, on one line, and cut to ``limit`` characters.
    Masked before cutting, so a cut can never leave half a secret behind."""
    if not text:
        return ""
    masked = _SECRET.sub(_mask, text)
    flat = " ".join(scrub(masked).split())
    return flat[:limit] + ("..." if len(flat) > limit else "")


__all__ = [
    "CODES",
    "CRITICAL",
    "OK",
    "SEVERITIES",
    "WARNING",
    "Finding",
    "Thresholds",
    "age",
    "ordered",
    "quote",
    "redact_query",
    "size",
    "worst",
]
