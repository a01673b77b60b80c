"""`worker demo`: a worker pool, a producer and the operator console on one database.

Without ``--tasks`` it runs until Ctrl-C (or SIGTERM): a producer enqueues at a steady rate,
some tasks fail once and retry, one in a hundred fails for good, a cron job runs every 5
seconds, and one line sums up this run. With ``--tasks N`` it enqueues N tasks at once and exits
when they have settled (the form the tests and scripts use).

It uses its own schema (worker_demo by default) so it never mixes with real queues.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import psycopg
from psycopg.rows import dict_row

from ..db.connect import BENCH, connect
from ..db.dsn import scrub
from ..db.migrate import migrate
from ..db.sql import queries
from ..engine.supervisor import (
    CONSOLE_TOKEN_FD_ENV,
    PARENT_PID_ENV,
    PARENT_SIGNAL_ENV,
    child_environ,
    secret_pipe,
)
from ..ops.status import status
from ..tasks.enqueue import enqueue, enqueue_many
from .embedded.install import _pick_free_port, _port_is_free

# The statements of this room lie beside its modules (the core never loads them).
SQL_DIR = Path(__file__).resolve().parent

DEFAULT_CONSOLE_PORT = 9187
_TTY_EVERY = 1.0  # seconds between updates of the summary line on a terminal
_LOG_EVERY = 5.0  # ... and between summary lines when stdout is a file or a pipe


def main(
    args: argparse.Namespace, dsn: str, *, embedded: bool = False, console_token: str | None = None
) -> int:
    """``worker demo``; the CLI resolves the DSN (flag, environment or embedded server) and takes
    the console's token out of the environment (``console_token``: for the pool's console)."""
    schema = args.schema if args.schema != "worker" else "worker_demo"
    with connect(dsn, BENCH) as conn:
        migrate(conn, schema)
        if args.tasks is not None:
            print(f"demo: schema {schema}, {args.processes} worker processes, {args.tasks} tasks")
            with _Pool(dsn, schema, args.processes, "worker.dev.demo_tasks", [], "WARNING") as pool:
                return _settle(conn, schema, args.tasks, pool.proc)
        try:
            return _live(conn, dsn, schema, args, embedded, console_token)
        except psycopg.OperationalError as exc:
            first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
            print(f"\ndemo: lost the database ({scrub(first)}); stopped", file=sys.stderr)
            return 1


class _Pool:
    """``worker run`` in a child process, in a session of its own so that a terminal's Ctrl-C
    reaches the demo only, which passes on one SIGTERM (two would mean "stop at once")."""

    def __init__(
        self,
        dsn: str,
        schema: str,
        processes: int,
        module: str,
        extra: list[str],
        log_level: str,
        console_token: str | None = None,
    ) -> None:
        # The console's token on a pipe the pool reads once, never in its environment.
        handed = {} if console_token is None else {CONSOLE_TOKEN_FD_ENV: secret_pipe(console_token)}
        try:
            self._start(dsn, schema, processes, module, extra, log_level, handed)
        finally:
            for fd in handed.values():
                os.close(fd)

    def _start(
        self,
        dsn: str,
        schema: str,
        processes: int,
        module: str,
        extra: list[str],
        log_level: str,
        handed: dict[str, int],
    ) -> None:
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "worker",
                "run",
                module,
                "--schema",
                schema,
                "--processes",
                str(processes),
                "--log-level",
                log_level,
                *extra,
            ],
            # The DSN goes through the environment (argv is public), and the pool stops with
            # the demo, however the demo ends (PARENT_*: see engine.supervisor.die_with_parent).
            env=child_environ(
                {
                    "WORKER_DSN": dsn,
                    PARENT_PID_ENV: str(os.getpid()),
                    PARENT_SIGNAL_ENV: "SIGTERM",
                    **{name: str(fd) for name, fd in handed.items()},
                }
            ),
            pass_fds=tuple(handed.values()),
            start_new_session=True,
        )

    def __enter__(self) -> _Pool:
        return self

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=90)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def __exit__(self, *exc: object) -> None:
        self.stop()


class _Stop:
    """SIGINT and SIGTERM ask the demo to stop; the loop notices within a tenth of a second.
    Nothing is raised from the handler, so no statement or enqueue is cut in half."""

    def __init__(self) -> None:
        self.requested = False
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> _Stop:
        for sig in (signal.SIGINT, signal.SIGTERM):
            self._previous[sig] = signal.signal(sig, self._on_signal)
        return self

    def _on_signal(self, _signum: int, _frame: object) -> None:
        self.requested = True

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


def _console_port(wanted: int | None) -> int:
    if wanted is not None:
        return wanted
    return DEFAULT_CONSOLE_PORT if _port_is_free(DEFAULT_CONSOLE_PORT) else _pick_free_port()


def _answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=1) as response:
            return bool(response.status == 200)
    except OSError:
        return False


def _live(
    conn: psycopg.Connection,
    dsn: str,
    schema: str,
    args: argparse.Namespace,
    embedded: bool,
    console_token: str | None,
) -> int:
    q = queries(schema, SQL_DIR)
    after = conn.execute(q["demo_last_id"]).fetchone()[0]
    port = _console_port(args.port)
    begun = time.monotonic()
    with _Stop() as stop:
        extra = ["--metrics-port", str(port), "--grace", "5"]
        # ERROR: a task failing for good is in the summary line; a log line would break it.
        with _Pool(
            dsn, schema, args.processes, "worker.dev.demo_live", extra, "ERROR", console_token
        ) as pool:
            url = f"http://127.0.0.1:{port}/"
            while not _answers(url + "healthz"):
                if pool.proc.poll() is not None:
                    print(
                        f"demo: the worker pool exited with {pool.proc.returncode}", file=sys.stderr
                    )
                    return 1
                if stop.requested:
                    break
                time.sleep(0.1)
            print(
                f"demo: schema {schema}, {args.processes} worker processes, {args.rate:g} tasks a "
                f"second, a cron job every 5 s. Console: {url}console/ (Ctrl-C stops)",
                flush=True,
            )
            start = time.monotonic()  # the steady rate starts once the workers are up
            code = _produce(conn, schema, args.rate, after, pool, stop, start)
        # The pool has stopped: the last line counts what it finished.
        summary = _summary(conn, schema, after, time.monotonic() - begun)
    _show(summary, final=True)
    hint = (
        " The embedded PostgreSQL keeps running (`worker embedded stop` stops it)."
        if embedded
        else ""
    )
    print(f"demo: stopped.{hint} See this run with `worker status --schema {schema}`.")
    return code


def _produce(
    conn: psycopg.Connection,
    schema: str,
    rate: float,
    after: int,
    pool: _Pool,
    stop: _Stop,
    start: float,
) -> int:
    sent = 0
    shown = 0.0
    every = _TTY_EVERY if sys.stdout.isatty() else _LOG_EVERY
    while not stop.requested:
        now = time.monotonic()
        due = int((now - start) * rate) + 1
        while sent < due and not stop.requested:
            _enqueue_one(conn, schema, sent)
            sent += 1
        if pool.proc.poll() is not None:
            print(f"\ndemo: the worker pool exited with {pool.proc.returncode}", file=sys.stderr)
            return 1
        if now - shown >= every:
            shown = now
            _show(_summary(conn, schema, after, now - start), final=False)
        time.sleep(min(0.1, max(0.0, (sent / rate) - (time.monotonic() - start))))
    return 0


def _enqueue_one(conn: psycopg.Connection, schema: str, i: int) -> None:
    """Four in five resize an image; one in five sends an email, a quarter of which fail once
    (and succeed on retry), and one in a hundred tasks has a bad address and fails for good."""
    if i % 5:
        enqueue(conn, "demo.resize_image", {"image": i}, queue="media", schema=schema)
        return
    to = "not-an-address" if i % 100 == 95 else f"user{i}@example.com"
    enqueue(conn, "demo.send_email", {"to": to, "flaky": i % 20 == 0}, schema=schema)


def _summary(conn: psycopg.Connection, schema: str, after: int, elapsed: float) -> dict[str, Any]:
    with conn.cursor(row_factory=dict_row) as cur:
        row = cur.execute(queries(schema, SQL_DIR)["demo_summary"], {"after": after}).fetchone()
    assert row is not None
    return {"elapsed": elapsed, **row}


def _show(s: dict[str, Any], *, final: bool) -> None:
    line = (
        f"demo: {s['elapsed']:.0f}s, {s['enqueued']} enqueued, {s['done']} done, "
        f"{s['retried']} retried, {s['failed']} failed, {s['running']} running, "
        f"{s['waiting']} waiting, {s['cron_runs']} cron runs, {s['workers']} workers"
    )
    if sys.stdout.isatty():
        # One line, rewritten in place; the final one stays.
        sys.stdout.write("\r" + line + "\x1b[K" + ("\n" if final else ""))
        sys.stdout.flush()
    else:
        print(line, flush=True)


def _settle(conn: psycopg.Connection, schema: str, n: int, pool: subprocess.Popen[bytes]) -> int:
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
    with _Stop() as stop:
        return _wait_settled(conn, schema, n, pool, stop, start)


def _wait_settled(
    conn: psycopg.Connection,
    schema: str,
    n: int,
    pool: subprocess.Popen[bytes],
    stop: _Stop,
    start: float,
) -> int:
    while True:
        for _ in range(10):
            if stop.requested:
                print("demo: stopping the worker pool", file=sys.stderr)
                return 130
            time.sleep(0.1)
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
