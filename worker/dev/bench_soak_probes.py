"""What `worker bench --soak` reads while it runs (see bench_soak): a steady producer, the CPU
time of the server's processes, the vacuums of the task table, and each minute's waits.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import psycopg

from ..db.connect import BENCH, connect
from ..db.sql import queries
from ..tasks.enqueue import enqueue_many
from .bench_phases import BENCH_SCHEMA, SQL_DIR, TASK, worker_command
from .bench_phases import worker_env as _worker_env

SAMPLE = 20_000  # tasks read per minute at most (every n-th id of the minute's range)
PROGRESS_SECONDS = 0.5  # how often running vacuums are sampled
TICK = 0.01  # the producer's batching interval at high rates
_START_TIMEOUT = 60.0


# -- the producer ----------------------------------------------------------------------------------


class Producer(threading.Thread):
    """Tasks at a steady rate through enqueue_many (COPY), in a batch per TICK at high rates and
    one at a time at low ones; after each batch it notes the last id (minutes are id ranges)."""

    def __init__(self, dsn: str, rate: float, last_id: int) -> None:
        super().__init__(name="bench-soak-producer", daemon=True)
        self.rate = rate
        self.last_id = last_id
        self.sent = 0
        self.error: BaseException | None = None
        self._conn = connect(dsn, BENCH)
        self._halt = threading.Event()
        self.lock = threading.Lock()

    def run(self) -> None:
        q = queries(BENCH_SCHEMA, SQL_DIR)
        tick = max(TICK, 1.0 / self.rate)
        start = time.perf_counter()
        try:
            while not self._halt.is_set():
                due = int((time.perf_counter() - start) * self.rate) - self.sent
                if due > 0:
                    n = self.sent
                    enqueue_many(
                        self._conn, TASK, ({"i": n + i} for i in range(due)), schema=BENCH_SCHEMA
                    )
                    last = self._conn.execute(q["soak_last_id"], {"schema": BENCH_SCHEMA})
                    with self.lock:
                        self.last_id, self.sent = int(last.fetchone()[0]), n + due
                self._halt.wait(tick)
        except BaseException as exc:  # reported by the main thread
            self.error = exc
        finally:
            self._conn.close()

    def mark(self) -> tuple[int, int]:
        with self.lock:
            return self.last_id, self.sent

    def stop(self) -> None:
        self._halt.set()
        self.join(timeout=30)


# -- the server's CPU ------------------------------------------------------------------------------


class ServerCpu:
    """CPU seconds used by every process of the server since it started, from /proc, when it runs
    on this machine: the postmaster, its children alive now, and the children it has reaped."""

    def __init__(self, conn: psycopg.Connection) -> None:
        q = queries(BENCH_SCHEMA, SQL_DIR)
        self.postmaster: int | None = None
        self._tick = os.sysconf("SC_CLK_TCK")
        if not conn.execute(q["bench_server_is_local"]).fetchone()[0]:
            return
        backend = conn.execute(q["soak_backend_pid"]).fetchone()[0]
        try:
            ppid = int(self._stat(backend)[1])
            if Path(f"/proc/{ppid}/comm").read_text().startswith("postgres"):
                self.postmaster = ppid
        except (OSError, ValueError, IndexError):
            pass  # another machine or pid namespace: the figure is left out

    @staticmethod
    def _stat(pid: int) -> list[str]:
        """The fields of /proc/PID/stat after the command name (state is [0], ppid [1])."""
        text = Path(f"/proc/{pid}/stat").read_text()
        return text[text.rindex(")") + 2 :].split()

    def seconds(self) -> float | None:
        if self.postmaster is None:
            return None
        try:
            own = self._stat(self.postmaster)
            # utime, stime, cutime, cstime: fields 14-17 of stat, [11:15] here.
            ticks = sum(int(x) for x in own[11:15])
        except (OSError, ValueError, IndexError):
            return None
        for entry in os.scandir("/proc"):
            if not entry.name.isdigit():
                continue
            try:
                fields = self._stat(int(entry.name))
                if int(fields[1]) == self.postmaster:
                    ticks += int(fields[11]) + int(fields[12])
            except (OSError, ValueError, IndexError):
                continue  # ended meanwhile: the postmaster's reaped count has it
        return ticks / self._tick


# -- what a minute reads ---------------------------------------------------------------------------


class Vacuums:
    """Runs of VACUUM on the task table seen by sampling, each [auto, first seen, last seen]
    (monotonic seconds). A run is one process seen vacuuming the table in consecutive samples: a
    worker's maintenance connection runs many, one after another."""

    def __init__(self) -> None:
        self.runs: list[list[Any]] = []
        self._running: dict[int, list[Any]] = {}  # pid -> its run, as of the last sample

    def sample(self, conn: psycopg.Connection, q: Any) -> None:
        now = time.monotonic()
        seen: dict[int, list[Any]] = {}
        for pid, auto in conn.execute(q["soak_vacuuming"], {"schema": BENCH_SCHEMA}):
            run = self._running.get(pid)
            if run is None:
                run = [bool(auto), now, now]
                self.runs.append(run)
            run[2] = now
            seen[pid] = run
        self._running = seen

    def busy(self, start: float, end: float, *, auto: bool) -> float:
        """Seconds of [start, end) during which such a vacuum was seen running."""
        return sum(
            max(0.0, min(last + PROGRESS_SECONDS, end) - max(first, start))
            for kind, first, last in self.runs
            if kind == auto
        )

    def durations(self, t0: float, minute: float, *, auto: bool) -> list[dict[str, float]]:
        """Each run seen: the minute it began in, and how long it was seen running (to the
        sampling's half second)."""
        return [
            {
                "minute": int((first - t0) // minute),
                "seconds": round(last - first + PROGRESS_SECONDS, 1),
            }
            for kind, first, last in self.runs
            if kind == auto
        ]


def table_stats(conn: psycopg.Connection, q: Any) -> dict[str, int]:
    cur = conn.execute(q["soak_table"], {"schema": BENCH_SCHEMA})
    names = [d.name for d in cur.description or []]
    return dict(zip(names, (int(x) for x in cur.fetchone()), strict=True))


def read_waits(conn: psycopg.Connection, q: Any, lo: int, hi: int) -> tuple[list[float], int]:
    """Enqueue-to-claim of at most SAMPLE of the tasks with ids in (lo, hi], and how many of
    those were not claimed yet."""
    step = max(1, -(-(hi - lo) // SAMPLE))
    rows = conn.execute(q["soak_latency"], {"lo": lo, "hi": hi, "step": step}).fetchall()
    return [float(ms) for ms, _ in rows], sum(1 for _, waiting in rows if waiting)


def percentile(ordered: list[float], p: float) -> float:
    """As percentile_cont: linear between the two nearest ranks."""
    k = (len(ordered) - 1) * p
    low = int(k)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (k - low)


def summary(waits: list[float]) -> dict[str, float | int | None]:
    if not waits:
        return {"sampled": 0, "p50_ms": None, "p99_ms": None, "max_ms": None}
    ordered = sorted(waits)
    return {
        "sampled": len(ordered),
        "p50_ms": round(percentile(ordered, 0.5), 2),
        "p99_ms": round(percentile(ordered, 0.99), 2),
        "max_ms": round(ordered[-1], 2),
    }


def ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or not b else round(a / b, 2)


def per_task(
    amount: float | None, tasks: int, scale: float = 1.0, *, digits: int = 3
) -> float | None:
    return None if amount is None or not tasks else round(amount * scale / tasks, digits)


def start_worker(conn: psycopg.Connection, dsn: str, args: argparse.Namespace) -> Any:
    q = queries(BENCH_SCHEMA, SQL_DIR)
    proc = subprocess.Popen(worker_command(args), env=_worker_env(dsn))
    deadline = time.monotonic() + _START_TIMEOUT
    while conn.execute(q["bench_workers_alive"]).fetchone()[0] < args.processes:
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            proc.wait()
            raise RuntimeError("the benchmark's workers did not start")
        time.sleep(0.1)
    time.sleep(1.0)  # let every process reach its LISTEN
    return proc


def stop_worker(proc: Any) -> None:
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
