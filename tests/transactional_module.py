"""A transactional handler for tests/test_transactional.py, run by real `worker run` processes.

The handler writes a row through ctx.conn (the transaction that will also mark the task done),
reports its progress on a separate autocommit connection (so the test can see it while the
transaction is still open), and on its first attempt sleeps long enough to be killed mid-job.
"""

from __future__ import annotations

import os
import time
from typing import Any

import psycopg

import worker


@worker.task("tx_write", transactional=True, max_attempts=3)
def tx_write(payload: dict[str, Any], ctx: worker.Context) -> None:
    schema = os.environ["WORKER_SCHEMA"]
    assert ctx.conn is not None
    ctx.conn.execute(
        f"INSERT INTO {schema}.side_effects (task_id, attempt, pid) VALUES (%s, %s, %s)",
        (ctx.task_id, ctx.attempt, os.getpid()),
    )
    with psycopg.connect(os.environ["WORKER_DSN"], autocommit=True) as progress:
        progress.execute(
            f"INSERT INTO {schema}.progress (task_id, attempt, pid) VALUES (%s, %s, %s)",
            (ctx.task_id, ctx.attempt, os.getpid()),
        )
    if ctx.attempt == 1:
        time.sleep(float(payload.get("sleep", 60)))
