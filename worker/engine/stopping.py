"""A graceful stop: what a worker does between being asked to stop and exiting.

It claims nothing more, acknowledges each finished job as it comes (within the usual batching
delay, not at the end), and keeps the leases of the running ones renewed (the lease keeper runs
on) for up to the grace period. Then it hands back what has not finished, without counting the
attempt, leaves handlers past their timeout leased (their threads still run: the lease lapses
when the process is gone, and a rescue records the attempt), and marks the worker stopped. A
stop with ``now`` skips the wait.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

import psycopg

from .. import store
from . import reports

if TYPE_CHECKING:
    from .loop import Worker

log = logging.getLogger("worker")

# Longest a stopping loop waits for the next outcome before looking at its deadlines again.
_WAIT = 0.1


def shutdown(w: Worker) -> None:
    """Acknowledge finished jobs as they come, for up to the grace period (their leases are
    renewed meanwhile), then hand back the rest without counting their attempt."""
    cfg = w.config
    now_only = w.stop_now.is_set()
    deadline = time.monotonic() + (0 if now_only else cfg.grace_seconds)
    if w.table.unfinished():
        log.info(
            "stopping: waiting up to %.0fs for %d task(s)",
            cfg.grace_seconds,
            w.table.unfinished(),
        )
    delay = 0.1
    while True:
        w.collect(block=False, timeout=0)
        try:
            w.flush()
            delay = 0.1
        except psycopg.Error as exc:
            w.conn.close()
            log.warning("could not acknowledge on stop (%s); retrying", _first_line(exc))
            time.sleep(delay)
            delay = min(delay * 2, 1.0)
        left = deadline - time.monotonic()
        if not w.table.unfinished() and not w.table.pending:
            break
        if left <= 0 or w.stop_now.is_set():
            break
        w.collect(block=True, timeout=min(_WAIT, left))
        reports.check_deadlines(w, time.monotonic())
    hand_back(w)


def hand_back(w: Worker) -> None:
    """Release unstarted and running jobs; leave overdue ones leased (their threads still run:
    the lease lapses when this process is gone, and a rescue records the attempt)."""
    back = w.table.to_hand_back()
    for job in w.table.jobs.values():
        if (job.id, job.attempt) in back:
            job.lost = True  # a runner that frees up must not start it: it is going back
    settled = False
    for attempt in range(5):
        try:
            conn = w.conn.get()
            w.flush()
            if back:
                returned = store.release(conn, w.q.schema, worker_id=w.id, tasks=back)
                log.warning("handed back %d unfinished task(s)", len(returned))
                back = []
            conn.execute(w.q["unregister"], {"worker_id": w.id})
            settled = True
            break
        except psycopg.Error as exc:
            w.conn.close()
            log.warning("could not settle tasks on stop (%s); retrying", _first_line(exc))
            time.sleep(min(0.5 * 2**attempt, 4))
    if not settled:
        # Not a clean stop: say so (a supervisor then hands the rows back itself, or their
        # leases lapse).
        log.error("could not hand back this worker's tasks; their leases will lapse")
        w.exit_code = w.exit_code or 1
    log.info("worker %s stopped", w.id[:8])


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


__all__ = ["hand_back", "shutdown"]
