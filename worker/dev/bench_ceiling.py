"""The bare-SQL ceiling of `worker bench`: what the same database does with no framework at all.

As many connections as the worker has processes, each on a thread of its own, each looping over
one transaction per batch: acknowledge the previous batch and claim the next (the worker's
statement shapes, nothing else), then commit. Threads are enough: each spends its time waiting
for the server (psycopg releases the GIL while it waits), and the phase reports how much of one
core the client used, so a ceiling held back by Python would show as a figure near 1.
"""

from __future__ import annotations

import contextlib
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import psycopg

from ..db.connect import CEILING, connect
from ..db.sql import queries

# The statements of this room lie beside its modules (the core never loads them).
SQL_DIR = Path(__file__).resolve().parent

QUEUE = "default"


@dataclass(frozen=True, slots=True)
class Ceiling:
    tasks: int  # acknowledged, over every connection
    per_s: float
    client_cpu: float  # cores this process used meanwhile (1.0: one core busy throughout)


def _loop(
    conn: psycopg.Connection,
    schema: str,
    batch: int,
    delete: bool,
    start: threading.Barrier,
    done: list[int],
    errors: list[BaseException],
) -> None:
    q = queries(schema, SQL_DIR)
    ack = q["bench_ack_delete" if delete else "bench_ack"]
    worker_id = str(uuid.uuid4())
    ids: list[int] = []
    try:
        start.wait()
        while True:
            with conn.transaction():
                if ids:
                    conn.execute(ack, {"ids": ids})
                acked = len(ids)
                ids = [
                    r[0]
                    for r in conn.execute(
                        q["bench_claim"],
                        {"queue": QUEUE, "limit": batch, "worker_id": worker_id},
                    )
                ]
            done.append(acked)
            if not ids:
                return
    except BaseException as exc:  # re-raised on the main thread
        errors.append(exc)
        start.abort()


def ceiling(dsn: str, schema: str, *, batch: int, connections: int, delete: bool) -> Ceiling:
    """Drain the queued rows of the default queue; time from the start signal to the last commit.

    ``delete``: acknowledge by deleting, as the worker does when it keeps no finished rows.
    """
    conns: list[psycopg.Connection] = []
    try:
        for _ in range(connections):
            conns.append(connect(dsn, CEILING, autocommit=False))
        start = threading.Barrier(connections + 1)
        done: list[int] = []  # list.append is atomic: one list for every thread
        errors: list[BaseException] = []
        threads = [
            threading.Thread(
                target=_loop,
                args=(c, schema, batch, delete, start, done, errors),
                name=f"bench-ceiling-{i}",
                daemon=True,
            )
            for i, c in enumerate(conns)
        ]
        for t in threads:
            t.start()
        with contextlib.suppress(threading.BrokenBarrierError):
            start.wait()  # broken: a thread failed before the start; its error is raised below
        t0, cpu0 = time.perf_counter(), time.process_time()
        for t in threads:
            t.join()
        wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
        if errors:
            raise errors[0]
    finally:
        for c in conns:
            c.close()
    n = sum(done)
    return Ceiling(tasks=n, per_s=n / wall, client_cpu=cpu / wall)
