"""The statements of one batch: acknowledge finished jobs and claim the next rows, in one
transaction, and what the results mean.

One commit per batch instead of two: with durable commits the WAL flush, not the SQL, is what a
batch costs most. The worker (``_worker``) decides when to run a batch and moves its jobs'
states; this module only talks to the database and reads the answers.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import psycopg

from . import _transitions as tr
from ._backoff import retry_delay
from ._job import Job
from ._registry import DEFAULT_BACKOFF
from ._sql import Queries

log = logging.getLogger("worker")


@dataclass(slots=True)
class QueueClaim:
    """What one claim statement asked of one queue, and got."""

    queue: str
    at: float  # monotonic time of the statement, for the cursor
    limit: int
    rows: list[tr.Claimed]


class Batcher:
    def __init__(
        self,
        q: Queries,
        worker_id: str,
        *,
        queues: Sequence[str],
        batch_size: int,
        lease_seconds: float,
        delete_done: bool,
        max_attempts: Mapping[str, int],
        cursor_reset_seconds: float,
    ) -> None:
        self.q = q
        self.worker_id = worker_id
        self.queues = list(queues)
        self.batch_size = batch_size
        self.lease_seconds = lease_seconds
        self.delete_done = delete_done
        self.max_attempts = dict(max_attempts)
        self.cursor = tr.ClaimCursor(cursor_reset_seconds)
        self._turn = 0

    def acknowledge(
        self, conn: psycopg.Connection, jobs: list[Job]
    ) -> tuple[set[int], dict[int, str]]:
        """The done and the failed jobs, one statement each: (ids completed, {id: new state})."""
        done = [(j.id, j.attempt) for j in jobs if j.outcome and j.outcome.ok]
        failures = [failure(j) for j in jobs if j.outcome and not j.outcome.ok]
        kept: set[int] = set()
        states: dict[int, str] = {}
        if done:
            kept = tr.complete(
                conn, self.q, worker_id=self.worker_id, done=done, delete=self.delete_done
            )
        if failures:
            states = tr.fail(conn, self.q, worker_id=self.worker_id, failures=failures)
        return kept, states

    def claim(self, conn: psycopg.Connection, free: int) -> list[QueueClaim]:
        """Up to ``free`` rows, one statement per queue, starting at the next queue in turn."""
        out: list[QueueClaim] = []
        n = len(self.queues)
        for i in range(n):
            if free <= 0:
                break
            name = self.queues[(self._turn + i) % n]
            now = time.monotonic()
            limit = min(self.batch_size, free)
            rows = tr.claim(
                conn,
                self.q,
                queue=name,
                limit=limit,
                worker_id=self.worker_id,
                lease_seconds=self.lease_seconds,
                cursor=self.cursor.position(name, now),
                max_attempts=self.max_attempts,
            )
            out.append(QueueClaim(name, now, limit, rows))
            free -= len(rows)
        self._turn += 1
        return out

    def committed(self, claims: list[QueueClaim]) -> bool:
        """After the commit: move the cursors. True when a queue came back full (more waits)."""
        full = False
        for c in claims:
            if c.rows:
                self.cursor.advance(c.queue, c.rows[-1])
            if len(c.rows) < c.limit:
                self.cursor.reset(c.queue, c.at)
            else:
                full = True
        return full

    def reset_cursors(self, now: float) -> None:
        for name in self.queues:
            self.cursor.reset(name, now)


def failure(job: Job) -> tr.Failure:
    """The retry statement's view of a failed job: when to try again, and why it failed."""
    c, outcome = job.claimed, job.outcome
    assert outcome is not None
    base = job.definition.retry_backoff if job.definition else DEFAULT_BACKOFF
    return tr.Failure(
        c.id, c.attempt, retry_delay(c.attempt, base), outcome.error or "", outcome.permanent
    )


def log_acknowledged(jobs: list[Job], kept: set[int], states: dict[int, str]) -> int:
    """After the commit: say what happened to each job; returns how many completed."""
    completed = 0
    for job in jobs:
        outcome = job.outcome
        assert outcome is not None
        if outcome.ok and job.id in kept:
            completed += 1
        elif not outcome.ok and job.id in states:
            state = states[job.id]
            log.log(
                logging.WARNING if state == "failed" else logging.INFO,
                "task %d attempt %d %s: %s",
                job.id,
                job.attempt,
                "failed for good" if state == "failed" else "will retry",
                outcome.error.splitlines()[0] if outcome.error else "",
            )
        else:
            log.warning(
                "could not %s task %d: this worker no longer owns it (lease expired, rescued)",
                "complete" if outcome.ok else "retry",
                job.id,
            )
    return completed


__all__ = ["Batcher", "QueueClaim", "failure", "log_acknowledged"]
