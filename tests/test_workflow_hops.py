"""How a workflow moves from one step to the next: the worker that acknowledges a step claims the
steps it made ready in the same transaction."""

from __future__ import annotations

import itertools
import os
from collections.abc import Iterator

import flows_module as fm
import psycopg
import pytest
from conftest import wait_until

import worker


@pytest.fixture
def recorded(pg_dsn: str, schema: str, conn: psycopg.Connection) -> Iterator[str]:
    """The handlers of flows_module record their runs in this schema."""
    fm.make_runs(conn, schema)
    saved = {k: os.environ.get(k) for k in ("WORKER_DSN", "WORKER_SCHEMA")}
    os.environ["WORKER_DSN"], os.environ["WORKER_SCHEMA"] = pg_dsn, schema
    yield schema
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


def test_a_chains_next_step_is_claimed_in_the_commit_that_finished_the_one_before(
    recorded: str, conn: psycopg.Connection, thread_worker
) -> None:
    """One worker runs a chain of 12 steps, each adding 1 to the result it is given, their queues
    taking turns (a, b, c). Every step after the first was claimed by the transaction that
    acknowledged the step before it (its start, by that transaction's clock, is the other's
    finish): a hop costs one commit, not a commit, a notification and another commit."""
    schema = recorded
    flow = worker.chain(*[worker.step(fm.add, {"n": 1}, queue="abc"[i % 3]) for i in range(12)])
    ids = worker.enqueue_workflow(conn, flow, schema=schema)
    reg = worker.Registry()
    reg.task(fm.add.name, max_attempts=3)(fm.add.fn)
    with thread_worker(reg, concurrency=8, queues=["a", "b", "c"]):
        wait_until(
            lambda: (
                conn.execute(
                    f"SELECT count(*) FROM {schema}.tasks WHERE state = 'done'"
                ).fetchone()[0]
                == 12
            ),
            timeout=60,
        )
    rows = [
        conn.execute(
            f"SELECT started_at, finished_at, result FROM {schema}.tasks WHERE id = %s",
            (ids[s],),
        ).fetchone()
        for s in flow.steps
    ]
    # Results are kept for the steps others wait for: all but the last.
    assert [r[2] for r in rows] == [*range(1, 12), None]
    hops = [(nxt[0] - prev[1]).total_seconds() for prev, nxt in itertools.pairwise(rows)]
    assert hops == [0.0] * 11, hops
