"""The claim probe of `worker doctor`: what the claim statement reads now, per row it claims.

A claim reads the first entries of a queue's range in ``tasks_claim_idx``. Rows claimed since the
last vacuum leave dead entries at the front of that range, and while a long transaction holds the
xmin horizon back, vacuum cannot remove them: every claim then walks them (and visits their heap
pages) before it finds a live row. The buffers a claim reads for a handful of rows show that at
once: a healthy claim of ten rows reads a dozen buffers; one behind twenty thousand dead entries
reads hundreds.

Two ways to look (``mode``):

- ``claim``: ``EXPLAIN (ANALYZE, BUFFERS)`` of the real claim statement (store/claims.sql), with
  the parameters a freshly started worker uses (its cursor at the start of each queue), in a
  transaction that is always rolled back. It locks the rows it would claim for the milliseconds
  that takes (workers skip them: SKIP LOCKED) and changes nothing: the rollback undoes the
  update, as tests/test_doctor.py checks row by row.
- ``read-only``: the same range of the same index read by a plain SELECT (doctor.sql,
  doctor_claim_probe), in a READ ONLY transaction: no lock, no write, for roles that may not
  update the table.

Only the scan that picks the rows is measured (the ``picked`` CTE of the claim), not the update
of the rows it found, whose cost does not depend on dead entries. It is compared with a budget:
``claim_base_buffers`` plus ``claim_buffers_per_row`` per row found; ten times the budget is
critical. Never run at scrape time.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
from psycopg import sql

from ... import store
from ...db.sql import queries
from .findings import CRITICAL, OK, WARNING, Finding, Thresholds, quote

# The statements of this room lie beside its modules (the core never loads them).
SQL_DIR = Path(__file__).resolve().parent

MODES = ("claim", "read-only", "off")
CLAIM_INDEX = "tasks_claim_idx"
_EXPLAIN = sql.SQL("EXPLAIN (ANALYZE, BUFFERS, TIMING OFF, FORMAT JSON) ")


def _nodes(plan: dict[str, Any]) -> Iterator[dict[str, Any]]:
    yield plan
    for child in plan.get("Plans", []):
        yield from _nodes(child)


def _buffers(node: dict[str, Any]) -> int:
    """Shared buffers a node read, its children included (EXPLAIN's figures are cumulative)."""
    return int(node.get("Shared Hit Blocks", 0)) + int(node.get("Shared Read Blocks", 0))


def _measure(plan: dict[str, Any], mode: str) -> tuple[int, int, list[str]]:
    """(buffers of the scan, rows it found, indexes it used) from an EXPLAIN plan."""
    scan = plan
    if mode == "claim":
        scan = next((n for n in _nodes(plan) if n.get("Subplan Name") == "CTE picked"), plan)
    indexes = sorted({n["Index Name"] for n in _nodes(scan) if n.get("Index Name")})
    return _buffers(scan), int(scan.get("Actual Rows", 0)), indexes


def _explain(
    conn: psycopg.Connection, schema: str, queue: str, rows: int, mode: str, statement_ms: int
) -> dict[str, Any]:
    q = queries(schema, SQL_DIR)
    with conn.transaction(force_rollback=True):
        if mode == "read-only" and conn.autocommit:  # first in its own transaction
            conn.execute("SET TRANSACTION READ ONLY")
        conn.execute(
            q["doctor_local_timeouts"], {"statement_ms": str(statement_ms), "lock_ms": "1000"}
        )
        conn.execute(q["doctor_worker_plans"])
        if mode == "claim":
            result = store.explain_claim(conn, schema, _EXPLAIN, queue=queue, limit=rows)
        else:
            params = {"queue": queue, "limit": rows}
            statement = _EXPLAIN + q["doctor_claim_probe"]
            row = conn.execute(statement, params, prepare=False).fetchone()
            assert row is not None
            result = row[0]
    return (result[0] if isinstance(result, list) else result)["Plan"]


def _timed_out(
    schema: str, queue: str, rows: int, statement_ms: int, mode: str, horizon_held: bool
) -> Finding:
    cause = "end the transaction holding the xmin horizon (see xmin findings), then "
    cause = cause if horizon_held else ""
    return Finding(
        "claim_cost_high",
        CRITICAL,
        f"a claim of up to {rows} rows from queue {quote(queue)} did not finish within "
        f"{statement_ms / 1000:g}s (the statement timeout)",
        f"{cause}VACUUM {schema}.tasks; see the dead-tuple and autovacuum findings",
        {"mode": mode, "limit": rows, "probes": [{"queue": queue, "timed_out": True}]},
    )


def claim_findings(
    conn: psycopg.Connection,
    schema: str,
    queues: list[str],
    th: Thresholds,
    *,
    rows: int = 10,
    mode: str = "claim",
    statement_ms: int = 10_000,
    horizon_held: bool = False,
) -> list[Finding]:
    """Probe each of ``queues`` (a claim of up to ``rows`` rows each) and judge the worst."""
    probes = []
    for queue in queues:
        try:
            plan = _explain(conn, schema, queue, rows, mode, statement_ms)
        except psycopg.errors.QueryCanceled:  # the statement timeout: as bad as it gets
            return [_timed_out(schema, queue, rows, statement_ms, mode, horizon_held)]
        buffers, found, indexes = _measure(plan, mode)
        budget = th.claim_base_buffers + th.claim_buffers_per_row * found
        probes.append(
            {
                "queue": queue,
                "rows": found,
                "buffers": buffers,
                "budget": budget,
                "buffers_per_row": round(buffers / max(found, 1), 1),
                "indexes": indexes,
            }
        )
    details = {"mode": mode, "limit": rows, "probes": probes}
    how = "rolled-back claim" if mode == "claim" else "read-only probe"
    worst = max(probes, key=lambda p: p["buffers"] / p["budget"])
    off_index = [p for p in probes if CLAIM_INDEX not in p["indexes"]]
    out = []
    if off_index:
        p = off_index[0]
        out.append(
            Finding(
                "claim_cost_high",
                WARNING,
                f"the claim of queue {quote(p['queue'])} is not planned on {CLAIM_INDEX} (it "
                f"used {', '.join(p['indexes']) or 'no index'}; {how})",
                f"ANALYZE {schema}.tasks, and check that `worker migrate` is up to date and the "
                "index is valid (\\d {schema}.tasks)",
                details,
            )
        )
    ratio = worst["buffers"] / worst["budget"]
    sev = CRITICAL if ratio > 10 else WARNING if ratio > 1 else OK
    figures = (
        f"{worst['buffers']:,} buffers for {worst['rows']} row(s), budget {worst['budget']:,} "
        f"({th.claim_base_buffers} + {th.claim_buffers_per_row} per row)"
    )
    if sev == OK:
        out.append(
            Finding(
                "claim_cost_high",
                OK,
                f"a claim of up to {rows} rows reads at most {figures} (queue "
                f"{quote(worst['queue'])}; {len(probes)} queue(s), {how})",
                "none needed",
                details,
            )
        )
        return out
    cause = (
        "end the transaction holding the xmin horizon (see xmin findings), then "
        if horizon_held
        else ""
    )
    out.append(
        Finding(
            "claim_cost_high",
            sev,
            f"a claim of up to {rows} rows from queue {quote(worst['queue'])} reads {figures}: "
            f"it walks dead index entries before it finds live rows ({how})",
            f"{cause}VACUUM {schema}.tasks; if it comes back, see the dead-tuple and "
            "autovacuum findings",
            details,
        )
    )
    return out


__all__ = ["MODES", "claim_findings"]
