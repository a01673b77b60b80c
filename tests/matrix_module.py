"""Handlers for the composition matrix (tests/test_matrix.py); tests/ is on the PYTHONPATH of the
`worker run` processes, of the application processes of tests/matrix_app.py and of the Django
workers (tests/django_site/matrix_tasks.py records its runs with ``record_run`` below).

Every run writes a row to the schema's ``mx_runs`` table when its handler starts and updates it
when the handler ends: task id, attempt, worker id, pid, and clock_timestamp() at both ends (the
database's clock), a workflow step's inputs, plus the handler's own clock at its start
(time.time(): what the service a rate limit protects sees). The database is on this machine, so
both are the same clock: when the recording connection is down (a database restart), the handler
keeps trying and records the moment it took by its own clock instead (``late``), never the later
moment the server came back.

One task per combination of the three handler options the matrix pairs (results, transactional,
typed payload): ``mx.plain``, ``mx.results``, ``mx.results.tx.typed``... all on queue ``mx``.

Environment read by the handlers: WORKER_DSN, WORKER_SCHEMA (where to record), MATRIX_KIND (what
ran the handler: ``cli``, ``django`` or ``inproc``, recorded with each run).
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
import threading
import time
from collections.abc import Callable
from typing import Any

import psycopg

import worker

QUEUE = "mx"
OPTIONS = ("results", "tx", "typed")

_local = threading.local()


@dataclasses.dataclass
class MxPayload:
    """The typed payload: ``sleep`` seconds of work, the limit key it was enqueued under."""

    sleep: float
    key: str
    n: int = 0


def task_name(options: Any) -> str:
    chosen = [o for o in OPTIONS if o in set(options)]
    return "mx." + (".".join(chosen) if chosen else "plain")


def _conn() -> psycopg.Connection:
    conn = getattr(_local, "conn", None)
    if conn is None or conn.closed or conn.broken:
        conn = psycopg.connect(os.environ["WORKER_DSN"], autocommit=True, connect_timeout=3)
        _local.conn = conn
    return conn


def _record(sql: str, params: dict[str, Any]) -> Any:
    """Run one recording statement, reconnecting while the server is away (up to 60 s). On a
    retry ``late`` is true: the statement must then use the handler's clock, ``wall``."""
    deadline = time.monotonic() + 60
    late = False
    while True:
        try:
            return _conn().execute(sql, {**params, "late": late}).fetchone()
        except psycopg.OperationalError:
            _local.conn = None
            if time.monotonic() > deadline:
                raise
            late = True
            time.sleep(0.1)


def record_run(
    task_id: int,
    attempt: int,
    worker_id: str,
    sleep: float,
    *,
    typed: str = "",
    check: Callable[[], None] | None = None,
    conn: psycopg.Connection | None = None,
    inputs: list[Any] | None = None,
) -> dict[str, Any]:
    """One run: record its start (and ``inputs``, a workflow step's results of its dependencies),
    work for ``sleep`` seconds (calling ``check`` every 20 ms, which raises worker.Cancelled
    when the run is cancelled or its worker stops), write the transactional side effect on
    ``conn`` if given, record its end; return the result."""
    schema = os.environ["WORKER_SCHEMA"]
    wall = time.time()
    (run_id,) = _record(
        f"INSERT INTO {schema}.mx_runs (task_id, attempt, worker_id, pid, kind, typed, wall,"
        " inputs, started, late_start) VALUES (%(task_id)s, %(attempt)s, %(worker_id)s, %(pid)s,"
        " %(kind)s, %(typed)s, %(wall)s, %(inputs)s::jsonb,"
        " CASE WHEN %(late)s THEN to_timestamp(%(wall)s) ELSE clock_timestamp() END, %(late)s)"
        " RETURNING id",
        {
            "task_id": task_id,
            "attempt": attempt,
            "worker_id": worker_id,
            "pid": os.getpid(),
            "kind": os.environ.get("MATRIX_KIND", "cli"),
            "typed": typed,
            "wall": wall,
            "inputs": None if inputs is None else json.dumps(inputs),
        },
    )
    outcome = "error"
    try:
        deadline = time.monotonic() + sleep
        while time.monotonic() < deadline:
            if check is not None:
                try:
                    check()
                except worker.Cancelled:
                    outcome = "cancelled"
                    raise
            time.sleep(0.02)
        result = {"task_id": task_id, "attempt": attempt, "worker_id": worker_id}
        if conn is not None:
            conn.execute(
                f"INSERT INTO {schema}.mx_effects (task_id, attempt, worker_id)"
                " VALUES (%s, %s, %s)",
                (task_id, attempt, worker_id),
            )
        outcome = "ok"
        return result
    finally:
        _record(
            f"UPDATE {schema}.mx_runs SET outcome = %(outcome)s, late_end = %(late)s, finished ="
            " CASE WHEN %(late)s THEN to_timestamp(%(now)s) ELSE clock_timestamp() END"
            " WHERE id = %(id)s RETURNING id",
            {"outcome": outcome, "now": time.time(), "id": run_id},
        )


def _define(options: tuple[str, ...]) -> None:
    typed = "typed" in options
    tx = "tx" in options

    def handler(payload: Any, ctx: worker.Context) -> dict[str, Any]:
        if typed:
            kind = type(payload).__name__
            sleep = payload.sleep
        else:
            kind = type(payload).__name__ if not isinstance(payload, dict) else ""
            sleep = float(payload["sleep"])
        return record_run(
            ctx.task_id,
            ctx.attempt,
            ctx.worker_id,
            sleep,
            typed=kind,
            check=ctx.check,
            conn=ctx.conn if tx else None,
            inputs=ctx.inputs,
        )

    worker.task(
        task_name(options),
        queue=QUEUE,
        max_attempts=10,
        retry_backoff=0.2,
        store_result=True if "results" in options else None,
        transactional=tx,
        payload=MxPayload if typed else None,
    )(handler)


for _n in range(len(OPTIONS) + 1):
    for _options in itertools.combinations(OPTIONS, _n):
        _define(_options)
