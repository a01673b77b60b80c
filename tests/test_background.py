"""worker.BackgroundWorker: a Worker on a thread of the application's process, stopped
gracefully by its owner (a web framework's lifespan)."""

from __future__ import annotations

import threading

import psycopg
import pytest

import worker
from tests.conftest import wait_until
from worker import testing
from worker.tasks.registry import Registry


def test_stop_lets_the_running_task_finish(
    pg_dsn: str, schema: str, conn: psycopg.Connection
) -> None:
    reg = Registry()
    started, release = threading.Event(), threading.Event()

    @reg.task("slow")
    def slow(payload: dict) -> None:
        started.set()
        release.wait(10)

    config = worker.WorkerConfig(dsn=pg_dsn, schema=schema, poll_interval=0.2, grace_seconds=10)
    background = worker.BackgroundWorker(config, reg).start()
    worker.enqueue(conn, "slow", schema=schema)
    assert started.wait(10)
    stopping = threading.Thread(target=background.stop)
    stopping.start()
    wait_until(lambda: background.worker.stopping)
    assert background.running  # waiting for the task, within the grace period
    release.set()
    stopping.join(15)
    assert not background.running
    assert background.exit_code == 0
    assert [r.state for r in testing.enqueued(conn, schema=schema)] == ["done"]


def test_a_worker_that_cannot_start_raises_on_stop(pg_dsn: str) -> None:
    background = worker.BackgroundWorker(worker.WorkerConfig(dsn=pg_dsn, schema="no_such_schema"))
    with pytest.raises(worker.SchemaMissing), background:
        wait_until(lambda: not background.running)
