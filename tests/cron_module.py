"""Schedules for tests that run real `worker run` processes (tests/ is on their PYTHONPATH).

A per-second schedule (croniter's sixth field is seconds) stands in for a minute of accelerated
time. Every run records itself in the schema's `executions` table with the slot it ran for.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any

import psycopg

import worker

_local = threading.local()


def _conn() -> psycopg.Connection:
    conn = getattr(_local, "conn", None)
    if conn is None or conn.closed:
        conn = psycopg.connect(os.environ["WORKER_DSN"], autocommit=True)
        _local.conn = conn
    return conn


@worker.cron("* * * * * *", name="every_second", payload={"kind": "tick"}, catch_up="skip")
def every_second(payload: dict[str, Any], ctx: worker.Context) -> None:
    schema = os.environ["WORKER_SCHEMA"]
    _conn().execute(
        f"INSERT INTO {schema}.executions (task_id, attempt, pid, started, finished)"
        " VALUES (%s, %s, %s, to_timestamp(%s), clock_timestamp())",
        (ctx.task_id, ctx.attempt, os.getpid(), time.time()),
    )


# A plain-configuration schedule for a handler registered above: shows in `worker cron`.
worker.schedule("nightly_report", "30 2 * * *", task="every_second", tz="Europe/Paris")
