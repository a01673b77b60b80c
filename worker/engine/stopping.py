"""A graceful stop: what a worker does between being asked to stop and exiting. One state
machine, whether the worker owns its process (``worker run``) or runs on a thread of an
application (``BackgroundWorker``):

1. It claims nothing more, and tells every running handler: ``ctx.cancelled`` turns true (a
   handler that stops then, raising ``ctx.check()``'s ``Cancelled``, gives its task back to the
   queue, its attempt not counted).
2. For up to the grace period it acknowledges each finished job as it comes (within the usual
   batching delay, not at the end) while the lease keeper renews the leases of the others.
3. Then it gives back the jobs whose handlers never started, without counting their attempt (a
   runner can no longer start them: the runners' start lock decides). A handler still running is
   given back only when its thread ends with the process (``exits_after_stop``: ``worker run``).
   In an application's process the thread runs on, so its row keeps its lease, which lapses
   after the worker is gone; a rescue then puts it back (counting the attempt) and says so, as
   for a hung worker. It is never handed back while it runs. Handlers past their timeout keep
   their lease in both cases.
A stop with ``now`` skips the wait.
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
    for job in w.table.jobs.values():
        job.stop_requested = True  # ctx.cancelled: the handler may stop and give its task back
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
    """Give back the jobs no runner started (and, when the process exits with the stop, the
    running ones); leave the others leased. See the module's docstring."""
    back: list[tuple[int, int]] = []
    running: list[int] = []
    unfinished = set(w.table.to_hand_back())  # claimed or running; overdue ones stay leased
    with w.executor.start_lock:  # a job is either started or given back, never both
        for job in w.table.jobs.values():
            if (job.id, job.attempt) not in unfinished:
                continue
            if not job.started or w.config.exits_after_stop:
                # Never started (a runner that frees up must not start it now), or its thread
                # ends with the process.
                job.lost = True
                back.append((job.id, job.attempt))
            else:
                running.append(job.id)
    if running:
        shown = ", ".join(str(i) for i in sorted(running)[:20])
        more = ", ..." if len(running) > 20 else ""
        log.warning(
            "stopping with %d task(s) still running (%s%s): their handlers go on in this "
            "process, and their rows keep their leases until they lapse (within %gs); then "
            "a rescue puts them back, and another worker may run them again",
            len(running),
            shown,
            more,
            w.config.lease_seconds,
        )
        w.left_running = sorted(running)
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
