"""A database restart in the middle of workflows: every step runs to its end, no join is lost or
fired twice, and results flow along the edges as if nothing happened."""

from __future__ import annotations

import time

import flows_module as fm
import psycopg
from conftest import spawn_cli, wait_until
from test_pool import child_pids, kill_tree

import worker
from worker.db.migrate import migrate
from worker.dev.embedded import EmbeddedPostgres


def _states(dsn: str, schema: str) -> dict[str, int] | None:
    try:
        with psycopg.connect(dsn, autocommit=True, connect_timeout=2) as c:
            rows = c.execute(
                f"SELECT state::text, count(*) FROM {schema}.tasks GROUP BY 1"
            ).fetchall()
    except psycopg.OperationalError:
        return None
    return dict(rows)


def test_a_database_restart_mid_workflow_loses_no_step_and_fires_each_join_once(
    private_server: EmbeddedPostgres,
) -> None:
    """A fan-out of 300 steps with a join and a chain of 40 steps (each adding 1 to the result
    before it) run on two processes; the server is stopped once 60 steps are done and started
    again 2 s later. Every step ends done, each once (one attempt: the outage failed no
    handler and no lease ran out), the join holds the 300 results in order, and the chain's
    results count 1 to 39 along it."""
    dsn = private_server.start()
    schema = "flows"
    n, length = 300, 40
    fan = worker.group(
        [worker.step(fm.offline, {"n": i, "s": 0.02}) for i in range(n)],
        then=worker.step(fm.offline),
    )
    chain = worker.chain(*[worker.step(fm.offline, {"n": 1, "s": 0.05}) for _ in range(length)])
    with psycopg.connect(dsn, autocommit=True) as c:
        migrate(c, schema)
        fan_ids = worker.enqueue_workflow(c, fan, schema=schema)
        chain_ids = worker.enqueue_workflow(c, chain, schema=schema)
    total = n + 1 + length
    proc = spawn_cli(
        "run", "flows_module", "--dsn", dsn, "--schema", schema,
        "--processes", "2", "--concurrency", "4", "--lease", "10",
        env={"WORKER_DSN": dsn, "WORKER_SCHEMA": schema},
    )  # fmt: skip
    try:
        wait_until(
            lambda: (_states(dsn, schema) or {}).get("done", 0) >= 60, timeout=60, interval=0.05
        )
        before = child_pids(proc)
        private_server.stop()
        wait_until(lambda: _states(dsn, schema) is None, timeout=10)
        time.sleep(2)
        assert private_server.start() == dsn
        wait_until(lambda: _states(dsn, schema) == {"done": total}, timeout=120, interval=0.5)
        assert proc.poll() is None and child_pids(proc) == before  # rode it out
    finally:
        kill_tree(proc)
    with psycopg.connect(dsn, autocommit=True) as c:
        join = c.execute(
            f"SELECT attempts, inputs FROM {schema}.tasks WHERE id = %s",
            (fan_ids[fan.steps[-1]],),
        ).fetchone()
        assert join == (1, list(range(n)))
        results = [
            c.execute(
                f"SELECT result FROM {schema}.tasks WHERE id = %s", (chain_ids[s],)
            ).fetchone()[0]
            for s in chain.steps[:-1]
        ]
        assert results == list(range(1, length))
        retried = c.execute(f"SELECT count(*) FROM {schema}.tasks WHERE attempts <> 1").fetchone()
        assert retried == (0,)
