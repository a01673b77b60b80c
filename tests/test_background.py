"""worker.BackgroundWorker: a Worker on a thread of the application's process, stopped
gracefully by its owner (a web framework's lifespan)."""

from __future__ import annotations

import contextlib
import threading
import uuid
from collections.abc import AsyncIterator
from typing import Any

import psycopg
import pytest
from psycopg_pool import AsyncConnectionPool

import worker
from tests.conftest import wait_until
from worker import testing
from worker.db.migrate import latest_version, migrate
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


def test_a_worker_that_cannot_start_raises_from_start(pg_dsn: str) -> None:
    """start() returns once the worker has checked the schema and registered, or raises what
    stopped it; its thread has ended then, and stop() has nothing more to say."""
    background = worker.BackgroundWorker(worker.WorkerConfig(dsn=pg_dsn, schema="no_such_schema"))
    with pytest.raises(worker.SchemaMissing) as info:
        background.start()
    assert str(info.value) == (
        "schema 'no_such_schema' has no worker tables in this database: "
        "run `worker migrate --schema no_such_schema`"
    )
    assert not background.running
    assert background.stop() is None


def test_a_schema_older_than_the_code_stops_the_start(
    pg_dsn: str, conn: psycopg.Connection
) -> None:
    """As `worker run` does: a schema at an older version is refused at start, with its version."""
    name = f"old_{uuid.uuid4().hex[:12]}"
    migrate(conn, name, up_to=12)
    try:
        config = worker.WorkerConfig(dsn=pg_dsn, schema=name, poll_interval=0.2)
        started = []
        with pytest.raises(worker.SchemaMissing) as info, worker.BackgroundWorker(config):
            started.append(True)
        assert started == []
        assert str(info.value) == (
            f"schema '{name}' is at version 12; this version of worker-pg needs "
            f"{latest_version()}: run `worker migrate --schema {name}`"
        )
    finally:
        conn.execute(f"DROP SCHEMA IF EXISTS {name} CASCADE")


def fastapi_app(dsn: str, schema: str, served: list[str]) -> Any:
    """The FastAPI page's application: a pool and a BackgroundWorker in the lifespan, a request
    that enqueues in its transaction."""
    from fastapi import FastAPI

    reg = Registry()

    @reg.task("welcome")
    def welcome(payload: dict) -> None:
        served.append(payload["email"])

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        async with AsyncConnectionPool(dsn, open=False) as pool:
            app.state.pool = pool
            config = worker.WorkerConfig(dsn=dsn, schema=schema, poll_interval=0.2)
            async with worker.BackgroundWorker(config, reg):
                yield

    app = FastAPI(lifespan=lifespan)

    @app.post("/signup")
    async def signup(email: str) -> dict[str, int]:
        async with app.state.pool.connection() as conn:
            return {
                "id": await worker.enqueue_async(conn, "welcome", {"email": email}, schema=schema)
            }

    return app


def test_a_fastapi_app_on_a_missing_schema_fails_at_start_up(
    pg_dsn: str, conn: psycopg.Connection
) -> None:
    """The application's start-up (the lifespan, as uvicorn runs it) raises SchemaMissing with
    one line naming the command, and serves nothing; once that command has run, the same
    application starts and its worker runs what the requests enqueue."""
    from fastapi.testclient import TestClient

    name = f"absent_{uuid.uuid4().hex[:12]}"
    served: list[str] = []
    app = fastapi_app(pg_dsn, name, served)
    started = []
    with pytest.raises(worker.SchemaMissing) as info, TestClient(app):
        started.append(True)
    assert started == []  # the start-up failed: not one request
    assert str(info.value) == (
        f"schema '{name}' has no worker tables in this database: "
        f"run `worker migrate --schema {name}`"
    )
    assert not [t for t in threading.enumerate() if t.name == "worker-background"]

    migrate(conn, name)  # what `worker migrate --schema NAME` does
    try:
        with TestClient(app) as client:
            response = client.post("/signup", params={"email": "ada@example.com"})
            assert response.status_code == 200
            wait_until(lambda: served == ["ada@example.com"])
    finally:
        conn.execute(f"DROP SCHEMA IF EXISTS {name} CASCADE")
