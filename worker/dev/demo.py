"""`worker demo`: a worker pool and a producer on one database, until the demo tasks settle.

It uses its own schema (worker_demo by default) so it never mixes with real queues.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time

import psycopg

from .._admin import status
from .._config import redact
from .._enqueue import enqueue, enqueue_many
from .._migrate import migrate
from .._supervisor import PARENT_PID_ENV, PARENT_SIGNAL_ENV


def main(args: argparse.Namespace, dsn: str) -> int:
    """``worker demo``; the CLI resolves the DSN (flag, environment or embedded server)."""
    schema = args.schema if args.schema != "worker" else "worker_demo"
    print(f"demo: database {redact(dsn)}, schema {schema}")
    with psycopg.connect(dsn, autocommit=True) as conn:
        migrate(conn, schema)
        pool = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "worker",
                "run",
                "worker.dev.demo_tasks",
                "--schema",
                schema,
                "--processes",
                str(args.processes),
                "--log-level",
                "WARNING",
            ],
            # The DSN goes through the environment (argv is public), and the pool stops with
            # the demo, however the demo ends (PARENT_*: see _supervisor.die_with_parent).
            env={
                **os.environ,
                "WORKER_DSN": dsn,
                PARENT_PID_ENV: str(os.getpid()),
                PARENT_SIGNAL_ENV: "SIGTERM",
            },
            # Its own session: a terminal's Ctrl-C reaches the demo only, which passes on one
            # SIGTERM (two signals would tell the pool to stop at once instead of gracefully).
            start_new_session=True,
        )

        def forward(signum: int, _frame: object) -> None:
            if pool.poll() is None:
                pool.send_signal(signal.SIGTERM)
            raise KeyboardInterrupt

        previous = {s: signal.signal(s, forward) for s in (signal.SIGTERM, signal.SIGINT)}
        try:
            return _produce_and_watch(conn, schema, args.tasks, pool)
        except KeyboardInterrupt:
            print("demo: stopping the worker pool", file=sys.stderr)
            return 130
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            if pool.poll() is None:
                pool.send_signal(signal.SIGTERM)
            try:
                pool.wait(timeout=90)
            except subprocess.TimeoutExpired:
                pool.kill()


def _produce_and_watch(
    conn: psycopg.Connection, schema: str, n: int, pool: subprocess.Popen[bytes]
) -> int:
    start = time.monotonic()
    images = int(n * 0.9)
    enqueue_many(
        conn,
        "demo.resize_image",
        ({"image": i} for i in range(images)),
        queue="media",  # the handler's queue (see demo_tasks; this process does not import it)
        schema=schema,
    )
    for i in range(n - images - 1):
        enqueue(
            conn,
            "demo.send_email",
            {"to": f"user{i}@example.com", "flaky": i % 10 == 0},
            dedupe_key=f"welcome-{i}",
            schema=schema,
        )
    enqueue(conn, "demo.send_email", {"to": "not-an-address"}, schema=schema)
    print(
        f"demo: enqueued {n} tasks ({images} by COPY, the rest one by one with dedupe keys);"
        " one has a bad address and will fail for good"
    )
    while True:
        time.sleep(1)
        if pool.poll() is not None:
            print(f"demo: the worker pool exited with {pool.returncode}", file=sys.stderr)
            return 1
        st = status(conn, schema)
        totals: dict[str, int] = {}
        for q in st.queues:
            for state, count in q.counts.items():
                totals[state] = totals.get(state, 0) + count
        print(
            "demo: "
            + ", ".join(f"{k} {v}" for k, v in totals.items() if v)
            + f" ({len(st.workers)} workers)"
        )
        # Retries wait as scheduled (their backoff): not settled until they ran.
        if sum(totals.get(k, 0) for k in ("scheduled", "queued", "in_progress")) == 0:
            break
        if time.monotonic() - start > 300:
            print("demo: tasks did not settle within 5 minutes", file=sys.stderr)
            return 1
    for f in st.failed:
        print(f"demo: failed task #{f['id']} {f['task']}: {f['last_error'].splitlines()[0]}")
    print(
        f"demo: all {n} tasks settled in {time.monotonic() - start:.1f}s. Try `worker status "
        f"--schema {schema}` or enqueue more with `worker enqueue demo.send_email --payload "
        f'\'{{"to": "you@example.com"}}\' --schema {schema}`.'
    )
    return 0
