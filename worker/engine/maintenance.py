"""Maintenance apart from the claim loop: rescue, retention, cron, forgetting dead workers and
the minute rollup the charts read (``rollup``).

One thread per worker process, with its own connection, so that a slow purge of a table with a
million retained failures, or a cron tick, never delays a claim or a lease renewal. Every worker
process runs it; none is a leader: each statement takes its rows with SKIP LOCKED, so concurrent
maintainers share the work instead of waiting on each other.

Each service has an interval and a first run spread at random over that interval, so a fleet that
starts together does not run them in step.
"""

from __future__ import annotations

import contextlib
import logging
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timedelta

import psycopg

from .. import store
from ..coord.cron import Ticker
from ..db.connect import MAINTENANCE, Backoff, OwnConnection
from ..db.outage import OUTAGE, unreachable
from ..db.sql import Queries
from . import rollup
from .vacuum import Vacuumer

log = logging.getLogger("worker")

# Bounds how long one maintenance statement may hold the thread up (a vacuum gets longer).
_STATEMENT_TIMEOUT_MS = 10_000

# A rescue pass starts this far before the previous one began (see Maintenance.rescue), and
# walks the whole lease index at least this often.
_RESCUE_OVERLAP = timedelta(seconds=10)
_FULL_RESCUE_SECONDS = 30.0
# The cursor probe's spacing while notifications arrive (see _run).
_RELAXED_PROBE_SECONDS = 30.0

# Runs a transaction whose events the worker's hooks hear (see Worker.counted).
Counted = Callable[[psycopg.Connection], contextlib.AbstractContextManager[None]]


@dataclass
class MaintenanceConfig:
    rescue_seconds: float
    purge_seconds: float
    keep_done_seconds: float
    keep_failed_seconds: float
    cron_keep_seconds: float
    rescue_batch: int = 1000
    purge_batch: int = 5000
    purge_rounds: int = 20  # batches per purge pass; a backlog is worked off over several passes
    forget_workers_after: float = 86400.0
    rollup_seconds: float = rollup.INTERVAL_SECONDS  # 0: record no minute


class Maintenance:
    def __init__(
        self,
        dsn: str,
        q: Queries,
        config: MaintenanceConfig,
        *,
        counted: Counted,
        on_rescued: Callable[[list[tuple[int, str, str, str]]], None],
        on_cron: Callable[[int], None],
        cron: Ticker | None,
        probe: Callable[[psycopg.Connection], None] | None = None,
        probe_seconds: float = 1.0,
        notified: Callable[[], bool] = lambda: False,
        vacuum: Vacuumer | None = None,
        prepare: bool = True,
    ) -> None:
        self.dsn = dsn
        self.q = q
        self.config = config
        self._counted = counted
        self._on_rescued = on_rescued
        self._on_cron = on_cron
        self._cron = cron
        # The claim's cursor check (Batcher.behind): it walks dead index entries, so it runs
        # here rather than on the claim path.
        self._probe = probe
        self._probe_seconds = probe_seconds
        self._notified = notified  # whether notifications for new rows reach us right now
        self._vacuum = vacuum
        self._prepare = prepare
        self._rescue_floor: datetime | None = None
        self._full_rescue_at = 0.0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        # Bounds how long one statement may hold maintenance up (and the hooks lock, for rescue).
        self._conn = OwnConnection(
            dsn, MAINTENANCE.with_timeouts(statement_ms=_STATEMENT_TIMEOUT_MS), session=prepare
        )

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="worker-maintenance", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2)
        self._conn.close()

    # -- the loop ----------------------------------------------------------------------------------

    def _run(self) -> None:
        cfg = self.config
        now = time.monotonic()
        due = {
            "rescue": now + random.uniform(0, cfg.rescue_seconds),
            "purge": now + random.uniform(0, cfg.purge_seconds),
            "cron": now if self._cron is not None else float("inf"),
            "probe": now + self._probe_seconds if self._probe is not None else float("inf"),
            "vacuum": now + self._vacuum.interval if self._vacuum is not None else float("inf"),
            "rollup": now + random.uniform(0, cfg.rollup_seconds)
            if cfg.rollup_seconds > 0
            else float("inf"),
        }
        backoff = Backoff(0.5, 5.0)
        while not self._stop.is_set():
            now = time.monotonic()
            try:
                if now >= due["rescue"]:
                    self.rescue()
                    due["rescue"] = now + cfg.rescue_seconds * random.uniform(0.8, 1.2)
                if self._cron is not None and now >= due["cron"]:
                    conn = self._conn.get()
                    n = self._cron.tick(conn)
                    if n:
                        self._on_cron(n)
                    due["cron"] = now + self._cron.interval
                if self._probe is not None and now >= due["probe"]:
                    began = time.monotonic()
                    self._probe(self._conn.get())
                    # While a long transaction holds vacuum back, the probe walks the dead index
                    # entries the claim avoids, more of them each second: spaced by its own cost,
                    # it never takes more than about 2% of a database core.
                    spent = time.monotonic() - began
                    if self._notified():
                        # Notifications name the earliest run_at of new rows (schema/0015), so
                        # late rows reset the cursor at once: the probe is only a safety net.
                        gap = max(_RELAXED_PROBE_SECONDS, 500 * spent)
                    else:
                        gap = max(self._probe_seconds, 50 * spent)
                    due["probe"] = now + gap
                if self._vacuum is not None and now >= due["vacuum"]:
                    self._vacuum.tick(self._conn.get(), _STATEMENT_TIMEOUT_MS)
                    due["vacuum"] = now + self._vacuum.interval
                if now >= due["rollup"]:
                    rollup.record_minute(self._conn.get(), self.q)
                    due["rollup"] = now + cfg.rollup_seconds * random.uniform(0.8, 1.2)
                if now >= due["purge"]:
                    self.purge()
                    due["purge"] = now + cfg.purge_seconds * random.uniform(0.8, 1.2)
                backoff.reset()
                OUTAGE.back("maintenance")
            except Exception as exc:  # never die: a dead maintainer would rescue nothing again
                self._conn.close()
                delay = backoff.next()
                first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
                if unreachable(exc):
                    OUTAGE.lost("maintenance", exc)
                elif isinstance(exc, psycopg.Error):
                    log.warning("maintenance failed (%s); retrying in %.1fs", first, delay)
                else:
                    log.exception("maintenance failed; retrying in %.1fs", delay)
                self._stop.wait(delay)
                continue
            wake = min(due.values())
            self._stop.wait(min(max(wake - time.monotonic(), 0.01), 1.0))

    # -- the services ------------------------------------------------------------------------------

    def rescue(self) -> int:
        """Rows whose lease ran out go back to queued (or failed when out of attempts).

        A pass reads the lease index from a little before this worker's last complete pass began
        (by the database clock): a lease that ran out before then was there for that pass to
        see. A full pass, from the oldest lease, runs first and then now and then (spaced by its
        own cost, like the probe), for rows a pass skipped because their owner held them locked
        at that instant and then kept them.

        It looks first (store.first_expired), holding nothing, and rescues from the first lease
        found, if any, in the worker's counted transaction: the worker's claims and
        acknowledgements wait for that one, so the walk over dead index entries (millions while a
        long transaction elsewhere holds vacuum back) is made before it, not during it."""
        total = 0
        conn = self._conn.get()
        began = time.monotonic()
        full = began >= self._full_rescue_at
        started = conn.execute(self.q["db_now"]).fetchone()[0]
        since = None if full else self._rescue_floor
        since = store.first_expired(conn, self.q.schema, since=since)
        while since is not None:
            with self._counted(conn):
                rows = store.rescue(
                    conn, self.q.schema, limit=self.config.rescue_batch, since=since
                )
                if rows:
                    self._on_rescued(rows)
            if rows:
                log.warning("rescued %d task(s) whose lease expired", len(rows))
            total += len(rows)
            if len(rows) < self.config.rescue_batch or self._stop.is_set():
                break
        # Workflow steps that a rescue (or anything but an acknowledgement) finished: their
        # dependents are settled here (two probes of empty indexes when there are none).
        store.settle_missed(conn, self.q.schema, limit=self.config.rescue_batch)
        self._rescue_floor = started - _RESCUE_OVERLAP
        if full:
            spent = time.monotonic() - began
            self._full_rescue_at = began + max(_FULL_RESCUE_SECONDS, 50 * spent)
        return total

    def purge(self) -> int:
        cfg = self.config
        if cfg.keep_done_seconds < 0:
            return 0
        total = 0
        conn = self._conn.get()
        for _ in range(cfg.purge_rounds):
            n = store.purge(
                conn,
                self.q.schema,
                done_seconds=cfg.keep_done_seconds,
                failed_seconds=cfg.keep_failed_seconds,
                cron_keep_seconds=cfg.cron_keep_seconds,
                limit=cfg.purge_batch,
            )
            total += n
            if n < cfg.purge_batch or self._stop.is_set():
                break
        # The history (schema/0025): whole slots emptied, whoever moved rows there.
        store.rotate_history(conn, self.q.schema, done_seconds=cfg.keep_done_seconds)
        conn.execute(self.q["forget_stale"], {"older_than_seconds": cfg.forget_workers_after})
        return total


__all__ = ["Maintenance", "MaintenanceConfig"]
