"""Handlers for the flow-control tests (tests/ is on the PYTHONPATH of `worker run` processes).

Every run (but those of rated.run) writes its start and its end to the schema's `runs` table by
the database clock (clock_timestamp(), two statements of the handler's own connection), so a
test can compute how many runs overlapped, per queue and per key, and when each started. The
tests create the table.

Limits declared here (what a worker records when it starts, unless an operator set them):
- queue "flow": at most 8 running fleet-wide, at most 2 per key (the payload's "k").
- queue "rated": at most 50 starts in any second, fleet-wide.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any

import psycopg

import worker

_local = threading.local()

worker.limit("flow", concurrency=8, key_concurrency=2)
worker.limit("rated", rate="50/s")


def _conn() -> psycopg.Connection:
    conn = getattr(_local, "conn", None)
    if conn is None or conn.closed:
        conn = psycopg.connect(os.environ["WORKER_DSN"], autocommit=True, connect_timeout=5)
        _local.conn = conn
    return conn


def _run(payload: dict[str, Any], ctx: worker.Context) -> None:
    schema = os.environ["WORKER_SCHEMA"]
    row = (
        _conn()
        .execute(
            f"INSERT INTO {schema}.runs (task_id, attempt, queue, k, pid, started)"
            " VALUES (%s, %s, %s, %s, %s, clock_timestamp()) RETURNING id",
            (ctx.task_id, ctx.attempt, ctx.queue, payload.get("k"), os.getpid()),
        )
        .fetchone()
    )
    assert row is not None
    time.sleep(float(payload.get("sleep", 0)))
    _conn().execute(f"UPDATE {schema}.runs SET finished = clock_timestamp() WHERE id = %s", row)


@worker.task("flow.run", queue="flow", limit_key="k")
def flow_run(payload: dict[str, Any], ctx: worker.Context) -> None:
    _run(payload, ctx)


@worker.task("rated.run", queue="rated")
def rated_run(payload: dict[str, Any]) -> None:
    """No side table (the rate test reads tasks.started_at): a rate test runs many slots, and a
    connection per slot would be hundreds of connections."""


@worker.task("open.run", queue="open")
def open_run(payload: dict[str, Any], ctx: worker.Context) -> None:
    _run(payload, ctx)
