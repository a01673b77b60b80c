"""The lease keeper: a thread with its own connection that renews this process's leases.

Nothing on the claim path can delay it: it does not share the main thread's connection or loop,
it waits on no row lock (rows locked by our own acknowledgement or by a transactional handler's
commit are skipped and still counted as ours), and it keeps running through a graceful stop's
grace period, so a task that is still running when a deploy begins keeps its lease until it ends.

Every ``interval`` seconds it renews, in one statement, every row of the jobs it is given that is
still this worker's at the claimed attempt, and reports the ones that are not (rescued, claimed
again by another worker, or, for the same worker, at another attempt) as lost.

It is also the fallback by which a worker learns of cancel requests (see ``coord.cancel``): each
heartbeat reports the renewed rows that have one, and while the worker cannot LISTEN (``polling``
says so: PgBouncer in transaction mode, ``--no-listen``, a LISTEN being made again) it reads the
marks of the rows it holds every ``cancel_poll`` seconds, one primary-key read of those rows.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable

import psycopg

from .. import store
from ..coord import cancel as _cancel
from ..db.connect import LEASE, OwnConnection
from ..db.outage import OUTAGE, unreachable
from ..db.sql import Queries

log = logging.getLogger("worker")

# (id, attempt) pairs to renew; called on the lease thread, must be cheap and thread-safe.
Leased = Callable[[], Iterable[tuple[int, int]]]
# (id, attempt) pairs found lost, for the worker to act on (it re-checks each job's state).
OnLost = Callable[[list[tuple[int, int]]], None]
# Task ids with a cancel request, for the worker to act on (it re-checks each job's state).
OnCancel = Callable[[list[int]], None]
# The ids of the rows whose handler has not come back (those a cancel request can still stop).
Running = Callable[[], Iterable[int]]
# How often the marks are read while the worker cannot LISTEN: the promise is "within a second".
CANCEL_POLL = 1.0


class LeaseKeeper:
    def __init__(
        self,
        dsn: str,
        q: Queries,
        *,
        worker_id: str,
        lease_seconds: float,
        interval: float,
        leased: Leased,
        on_lost: OnLost,
        prepare: bool = True,
        running: Running = list,
        on_cancel: OnCancel | None = None,
        polling: Callable[[], bool] = lambda: False,
        cancel_poll: float = CANCEL_POLL,
    ) -> None:
        self.dsn = dsn
        self.q = q
        self.worker_id = worker_id
        self.lease_seconds = lease_seconds
        self.interval = interval
        self._leased = leased
        self._on_lost = on_lost
        self._prepare = prepare
        self._running = running
        self._on_cancel = on_cancel
        self._polling = polling
        self.cancel_poll = cancel_poll
        self._check_cancels = False  # read the marks at the next turn (check_cancels)
        self._stop = threading.Event()
        self._now = threading.Event()
        self._thread: threading.Thread | None = None
        # A renewal that cannot finish within a third of the lease is no use: fail fast and
        # retry on a new connection rather than queue behind whatever holds it up.
        self._conn = OwnConnection(
            dsn,
            LEASE.with_timeouts(statement_ms=max(int(lease_seconds * 1000 / 3), 100)),
            session=prepare,
        )
        self.last_renewal = time.monotonic()  # when a renewal last succeeded

    def start(self) -> None:
        self.last_renewal = time.monotonic()
        self._thread = threading.Thread(target=self._run, name="worker-lease", daemon=True)
        self._thread.start()

    def check_cancels(self) -> None:
        """Read the cancel marks of the rows held, soon (LISTEN was just made again, or a
        notification named no ids)."""
        self._check_cancels = True
        self._now.set()

    def stop(self) -> None:
        self._stop.set()
        self._now.set()
        if self._thread is not None:
            self._thread.join(timeout=2)
        self._conn.close()

    def _run(self) -> None:
        next_beat = 0.0
        next_poll = 0.0
        while not self._stop.is_set():
            now = time.monotonic()
            if now >= next_beat:
                self._check_cancels = False  # the heartbeat reads the marks too
                try:
                    ok = self._beat()
                except Exception:  # never die: the worker stops claiming when renewals stop
                    log.exception("lease renewal failed")
                    self._conn.close()
                    ok = False
                # After a failure try again soon while there are leases to keep: an outage
                # shorter than a lease must not cost them. Holding none, the next heartbeat
                # comes at its usual time (retrying faster would only fill the log).
                soon = not ok and any(True for _ in self._leased())
                next_beat = now + (min(self.interval, 0.5) if soon else self.interval)
                next_poll = now + self.cancel_poll
            elif self._check_cancels or (self._polling() and now >= next_poll):
                self._check_cancels = False
                self._poll_cancels()
                next_poll = now + self.cancel_poll
            # At least once per cancel_poll, to notice when polling starts (the listening
            # connection was lost): a wake-up without a statement unless polling.
            wake = min(next_beat, next_poll if self._polling() else now + self.cancel_poll)
            self._now.wait(max(wake - time.monotonic(), 0.0))
            self._now.clear()

    def _poll_cancels(self) -> None:
        """Read the cancel marks of the rows whose handler still runs; a failure waits for the
        next turn (the heartbeat reconnects)."""
        if self._on_cancel is None:
            return
        ids = list(self._running())
        if not ids:
            return
        try:
            found = _cancel.requests(self._conn.get(), self.q, worker_id=self.worker_id, ids=ids)
        except psycopg.Error as exc:
            self._conn.close()
            log.info("reading cancel requests failed (%s); retrying", _first_line(exc))
            return
        if found:
            self._on_cancel(sorted(found))

    def _beat(self) -> bool:
        pairs = list(self._leased())
        try:
            beat = store.heartbeat(
                self._conn.get(),
                self.q.schema,
                worker_id=self.worker_id,
                tasks=pairs,
                lease_seconds=self.lease_seconds,
            )
        except psycopg.Error as exc:
            self._conn.close()
            if unreachable(exc):
                OUTAGE.lost("lease renewal", exc)
            else:
                log.warning("lease renewal failed (%s); retrying", _first_line(exc))
            return False
        OUTAGE.back("lease renewal")
        self.last_renewal = time.monotonic()
        if beat.lost:
            self._on_lost(sorted(beat.lost))
        if beat.cancel and self._on_cancel is not None:
            self._on_cancel(sorted(beat.cancel))
        return True


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


__all__ = ["LeaseKeeper"]
