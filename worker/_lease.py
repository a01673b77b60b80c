"""The lease keeper: a thread with its own connection that renews this process's leases.

Nothing on the claim path can delay it: it does not share the main thread's connection or loop,
it waits on no row lock (rows locked by our own acknowledgement or by a transactional handler's
commit are skipped and still counted as ours), and it keeps running through a graceful stop's
grace period, so a task that is still running when a deploy begins keeps its lease until it ends.

Every ``interval`` seconds it renews, in one statement, every row of the jobs it is given that is
still this worker's at the claimed attempt, and reports the ones that are not (rescued, claimed
again by another worker, or, for the same worker, at another attempt) as lost.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable

import psycopg

from . import _transitions as tr
from ._conn import OwnConnection
from ._sql import Queries

log = logging.getLogger("worker")

# (id, attempt) pairs to renew; called on the lease thread, must be cheap and thread-safe.
Leased = Callable[[], Iterable[tuple[int, int]]]
# (id, attempt) pairs found lost, for the worker to act on (it re-checks each job's state).
OnLost = Callable[[list[tuple[int, int]]], None]


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
    ) -> None:
        self.dsn = dsn
        self.q = q
        self.worker_id = worker_id
        self.lease_seconds = lease_seconds
        self.interval = interval
        self._leased = leased
        self._on_lost = on_lost
        self._prepare = prepare
        self._stop = threading.Event()
        self._now = threading.Event()
        self._thread: threading.Thread | None = None
        # A renewal that cannot finish within a third of the lease is no use: fail fast and
        # retry on a new connection rather than queue behind whatever holds it up.
        self._conn = OwnConnection(
            dsn,
            name="worker-lease",
            prepare=prepare,
            timeout_ms=max(int(lease_seconds * 1000 / 3), 100),
            timeout_query=q["session_statement_timeout"],
            plans_query=q["session_index_plans"],
        )
        self.last_renewal = time.monotonic()  # when a renewal last succeeded

    def start(self) -> None:
        self.last_renewal = time.monotonic()
        self._thread = threading.Thread(target=self._run, name="worker-lease", daemon=True)
        self._thread.start()

    def renew_now(self) -> None:
        """Renew at once (e.g. when the worker starts holding new rows after an outage)."""
        self._now.set()

    def stop(self) -> None:
        self._stop.set()
        self._now.set()
        if self._thread is not None:
            self._thread.join(timeout=2)
        self._conn.close()

    def _run(self) -> None:
        while not self._stop.is_set():
            started = time.monotonic()
            try:
                ok = self._beat()
            except Exception:  # never die: the worker stops claiming when renewals stop
                log.exception("lease renewal failed")
                self._conn.close()
                ok = False
            # After a failure try again soon: an outage shorter than the lease must not cost it.
            wait = self.interval if ok else min(self.interval, 0.5)
            self._now.wait(max(wait - (time.monotonic() - started), 0.0))
            self._now.clear()

    def _beat(self) -> bool:
        pairs = list(self._leased())
        try:
            lost = tr.heartbeat(
                self._conn.get(),
                self.q,
                worker_id=self.worker_id,
                tasks=pairs,
                lease_seconds=self.lease_seconds,
            )
        except psycopg.Error as exc:
            self._conn.close()
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            log.warning("lease renewal failed (%s); retrying", first)
            return False
        self.last_renewal = time.monotonic()
        if lost:
            self._on_lost(sorted(lost))
        return True


__all__ = ["LeaseKeeper"]
