"""The minute rollup behind the charts of the console and the status page (schema/0018).

Every worker's maintenance calls ``record_minute`` every few seconds; the first one to run after
a minute ends records it (one row of fleet totals, one per queue), the others find it recorded
and do nothing. The rows are what the charts of every server show: queue depth a minute at a
time, and how long the tasks that finished waited to start. Nothing here touches a task row.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

import psycopg

from ..db.sql import Queries

INTERVAL_SECONDS = 15.0  # how often each worker checks whether the last minute is recorded
SETTLE_SECONDS = 5.0  # a minute is recorded this long after it ended, at the earliest
QUEUE_CAP = 10_000  # queued tasks counted per queue at most
TOTAL_CAP = 1_000_000  # queued tasks counted for the fleet at most
WAIT_SAMPLE = 10_000  # finished tasks a minute whose wait is measured, per outcome, at most
MAX_QUEUES = 100  # queues recorded per minute at most, the busiest first
KEEP_SECONDS = 86_400  # minutes kept


def record_params(minute: datetime) -> dict[str, Any]:
    """The parameters of rollup_record for a claimed minute."""
    return {
        "minute": minute,
        "cap": QUEUE_CAP,
        "total_cap": TOTAL_CAP,
        "sample": WAIT_SAMPLE,
        "max_queues": MAX_QUEUES,
    }


def record_minute(
    conn: psycopg.Connection, q: Queries, *, minute: datetime | None = None
) -> datetime | None:
    """Record the last minute over (or ``minute``) unless a worker did already, in one
    transaction; the minute recorded, or None."""
    with conn.transaction():
        row = conn.execute(
            q["rollup_claim"], {"minute": minute, "settle": SETTLE_SECONDS}
        ).fetchone()
        if row is None:
            return None
        claimed: datetime = row[0]
        conn.execute(q["rollup_record"], record_params(claimed))
        conn.execute(q["rollup_forget"], {"keep": KEEP_SECONDS})
    return claimed


__all__ = ["INTERVAL_SECONDS", "record_minute", "record_params"]
