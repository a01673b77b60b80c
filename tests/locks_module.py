"""Lock contenders and holders run as real processes by tests/test_locks.py.

    python tests/locks_module.py contend DSN SCHEMA NAME SLOTS PERIOD TTL THREADS
    python tests/locks_module.py hold DSN SCHEMA NAME TTL
    python tests/locks_module.py advisory DSN NAME

`contend`: THREADS threads, each with its own lock object (its own holder), compete for lock NAME
at every slot START + k * PERIOD, as instances triggered by a scheduler would, and record every
attempt in SCHEMA.lock_attempts. Once every thread is connected it prints "ready" and reads
START (seconds since the epoch) from stdin, so that the test starts the first slot when every
process is ready, however long their start took. `hold` and `advisory` take a lock, say so on
stdout, and work until they are killed.
"""

from __future__ import annotations

import os
import sys
import threading
import time

import psycopg

import worker


def contend(
    dsn: str,
    schema: str,
    name: str,
    slots: int,
    period: float,
    ttl: float,
    threads: int,
) -> None:
    connected = threading.Barrier(threads + 1)  # the threads and this one
    started = threading.Event()
    start: list[float] = []

    def run() -> None:
        with (
            psycopg.connect(dsn, autocommit=True) as conn,
            psycopg.connect(dsn, autocommit=True) as record,
        ):
            lock = worker.ExclusiveLock(conn, name, ttl=ttl, schema=schema)
            connected.wait()
            started.wait()
            for slot in range(slots):
                at = start[0] + slot * period
                time.sleep(max(0.0, at - time.time()))
                # A scheduler does not fire a trigger it is very late for; competing after the
                # winner's lock expired would be a second run of the same slot (the lock's ttl
                # must outlast the moment every instance competes).
                if time.time() - at > ttl / 2:
                    continue
                won = lock.acquire(jitter=0.05)
                record.execute(
                    f"INSERT INTO {schema}.lock_attempts (slot, pid, holder, won)"
                    " VALUES (%s, %s, %s, %s)",
                    (slot, os.getpid(), lock.holder, won),
                )

    workers = [threading.Thread(target=run) for _ in range(threads)]
    for t in workers:
        t.start()
    connected.wait()
    print("ready", flush=True)
    start.append(float(sys.stdin.readline()))
    started.set()
    for t in workers:
        t.join()


def hold(dsn: str, schema: str, name: str, ttl: float) -> None:
    lock = worker.ExclusiveLock(dsn, name, ttl=ttl, schema=schema)
    with lock.hold(extend_every=ttl / 4) as held:
        print(f"acquired={held.acquired} holder={held.holder}", flush=True)
        while held.acquired:
            held.check()
            time.sleep(0.05)


def advisory(dsn: str, name: str) -> None:
    with worker.advisory_lock(dsn, name) as lock:
        print(f"acquired={lock.acquired} backend_pid={lock.conn.info.backend_pid}", flush=True)
        time.sleep(600)


def main(argv: list[str]) -> None:
    mode, *rest = argv
    if mode == "contend":
        dsn, schema, name, slots, period, ttl, threads = rest
        contend(dsn, schema, name, int(slots), float(period), float(ttl), int(threads))
    elif mode == "hold":
        dsn, schema, name, ttl = rest
        hold(dsn, schema, name, float(ttl))
    elif mode == "advisory":
        dsn, name = rest
        advisory(dsn, name)
    else:
        raise SystemExit(f"unknown mode {mode!r}")


if __name__ == "__main__":
    main(sys.argv[1:])
