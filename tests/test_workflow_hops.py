"""How a workflow moves from one step to the next: the worker that acknowledges a step claims the
steps it made ready in the same transaction."""

from __future__ import annotations

import itertools
import os
import time
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


def _queue_notifications(listener: psycopg.Connection, seconds: float) -> list[str]:
    """The payloads the tasks channel carried to ``listener`` within ``seconds``."""
    return [n.payload for n in listener.notifies(timeout=seconds)]


def test_a_chains_hops_wake_no_worker(
    recorded: str, pg_dsn: str, conn: psycopg.Connection, thread_worker
) -> None:
    """The worker that acknowledges a step claims its successor in the same transaction, so the
    hop sends no notification: no worker (that one included) wakes for a claim that would find
    nothing. A listener on the queue channel hears the enqueue of a chain of 12 and nothing
    after it, while the chain runs to its end."""
    schema = recorded
    flow = worker.chain(*[worker.step(fm.add, {"n": 1}, queue="abc"[i % 3]) for i in range(12)])
    with psycopg.connect(pg_dsn, autocommit=True) as listener:
        listener.execute(f'LISTEN "{schema}.tasks"')
        worker.enqueue_workflow(conn, flow, schema=schema)
        assert _queue_notifications(listener, 0.5), "the enqueue notifies the queue's workers"
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
            heard = _queue_notifications(listener, 0.5)
    assert heard == []


def test_steps_a_full_claim_left_behind_wake_the_other_workers(
    recorded: str, conn: psycopg.Connection, thread_worker
) -> None:
    """Two workers with one slot each and a poll interval of a minute; a step whose two
    dependents sleep 3 s. Whichever worker acknowledges the first step claims one dependent in
    that transaction (its claim is full) and wakes the queue's workers for the other: the idle
    worker starts it at once, not after its poll or after the first dependent's 3 s."""
    schema = recorded
    flow = worker.Workflow("split")
    first = flow.add(fm.add, {"n": 1})
    flow.add(fm.sleep, {"s": 3}, depends_on=[first])
    flow.add(fm.sleep, {"s": 3}, depends_on=[first])
    reg = worker.Registry()
    reg.task(fm.add.name, max_attempts=3)(fm.add.fn)
    reg.task(fm.sleep.name, max_attempts=3)(fm.sleep.fn)
    one_slot = {"concurrency": 1, "batch_size": 1, "poll_interval": 60.0, "queues": ["default"]}
    with thread_worker(reg, **one_slot), thread_worker(reg, **one_slot):
        time.sleep(1.0)  # both listening, their first claims (over every queue) made
        ids = worker.enqueue_workflow(conn, flow, schema=schema)
        wait_until(
            lambda: (
                conn.execute(
                    f"SELECT count(*) FROM {schema}.tasks WHERE workflow_id = %s"
                    " AND state = 'done'",
                    (ids.id,),
                ).fetchone()[0]
                == 3
            ),
            timeout=60,
        )
    finished = conn.execute(
        f"SELECT finished_at FROM {schema}.tasks WHERE id = %s", (ids[first],)
    ).fetchone()[0]
    rows = conn.execute(
        f"SELECT worker_id, started_at FROM {schema}.tasks WHERE workflow_id = %s AND id <> %s",
        (ids.id, ids[first]),
    ).fetchall()
    assert len({r[0] for r in rows}) == 2, "the two dependents ran on both workers"
    delays = sorted((r[1] - finished).total_seconds() for r in rows)
    assert delays[0] == 0.0  # claimed by the acknowledging transaction
    assert delays[1] < 1.5, delays  # woken, not left for the poll or the first one's end


def test_a_step_twice_in_one_acknowledgement_releases_its_join_with_its_current_result(
    recorded: str, conn: psycopg.Connection
) -> None:
    """A worker may hold two outcomes of one step when it acknowledges: one of an attempt that
    was cancelled before it could be acknowledged, and one of the same step retried and claimed
    again by this worker. The acknowledgement ends the step at its current attempt, with that
    attempt's result, and releases the join waiting for it, whichever outcome comes first."""
    schema = recorded
    me = "00000000-0000-0000-0000-0000000000ab"
    for stale_first in (True, False):
        chord = worker.group([worker.step(fm.add, {"n": n}) for n in range(3)], then=fm.collect)
        ids = worker.enqueue_workflow(conn, chord, schema=schema)
        inputs = [ids[s] for s in chord.steps[:-1]]
        join = ids[chord.steps[-1]]
        conn.execute(
            f"UPDATE {schema}.tasks SET state = 'in_progress', attempts = 2, worker_id = %s,"
            " started_at = now(), lease_expires_at = now() + interval '1 hour'"
            " WHERE id = ANY(%s)",
            (me, inputs),
        )
        done = [(i, 2, str(n)) for n, i in enumerate(inputs)]
        done.insert(0 if stale_first else 1, (inputs[0], 1, '"stale"'))
        with conn.transaction():
            acked, queues = worker.store.complete_steps(conn, schema, worker_id=me, done=done)
        assert acked == dict.fromkeys(inputs, "done")
        assert queues == ["default"]
        state, got = conn.execute(
            f"SELECT state::text, inputs FROM {schema}.tasks WHERE id = %s", (join,)
        ).fetchone()
        assert (state, got) == ("queued", [0, 1, 2])
