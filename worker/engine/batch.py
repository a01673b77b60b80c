"""The statements of one batch: acknowledge finished jobs and claim the next rows, in one
transaction, and what the results mean.

One commit per batch instead of two: with durable commits the WAL flush, not the SQL, is what a
batch costs most. The worker (``engine.loop``) decides when to run a batch and moves its jobs'
states; this module only talks to the database and reads the answers.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import psycopg

from .. import store
from ..db.sql import Queries
from ..tasks.registry import TaskDef
from .job import Job
from .outcomes import Finished

log = logging.getLogger("worker")


@dataclass(slots=True)
class Claim:
    """What one claim statement asked for, and got: rows, and the limited queues a limit held
    back (``waits``: seconds until a rate allows the next start; ``held``: a full concurrency
    limit)."""

    queues: list[str]
    limit: int
    rows: list[store.Claimed]
    waits: dict[str, float] = field(default_factory=dict)
    held: set[str] = field(default_factory=set)


# Beyond this many queues, the poll asks which queues hold work before claiming (polls_all).
MANY_QUEUES = 8
# Rows promoted per statement; more wait for the next claim, which comes at once (see claim).
PROMOTE_LIMIT = 1000


class Batcher:
    """The claiming side of a worker: which queues to read, from where, and when to promote.

    A claim reads only the queues that may hold work: those named by a notification since the
    last claim, those whose last claim came back full, and every queue once per poll interval.
    So a worker serving 200 queues does not read 200 empty ones on every wake-up.
    """

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
        poll_interval: float,
        channel: str,
        done_channel: str = "",
        stores_result: Callable[[TaskDef], bool] = lambda d: False,
        move_done: bool = False,
    ) -> None:
        self.q = q
        self.worker_id = worker_id
        self.queues = list(queues)
        self._served = set(self.queues)
        self.batch_size = batch_size
        self.lease_seconds = lease_seconds
        self.delete_done = delete_done
        # Plain done rows leave the task table for the history (schema/0025, keep_history).
        self.move_done = move_done and not delete_done
        self.max_attempts = dict(max_attempts)
        self._handlers = store.HandlerLimits(self.max_attempts)  # the claim's form of it
        self.poll_interval = poll_interval
        self.channel = channel
        self.done_channel = done_channel  # where tasks that store a result are announced
        self.stores_result = stores_result
        # Rows that commit up to this far behind the cursor are still found by the claim (and
        # promotion, which runs when the next row is due, is seldom later than that).
        self.cursor = store.ClaimCursor(1.0, rows=2 * batch_size)
        self._hot: set[str] = set(self.queues)  # the first claim reads every queue
        self._poll_at = 0.0  # monotonic time of the next claim over every queue
        self._promote_at = 0.0  # monotonic time of the next promotion
        self._turn = 0
        self._held: set[str] = set()  # limited queues a concurrency limit held back
        self._waiting: set[str] = set()  # limited queues a rate limit held back
        self._limit_at = math.inf  # monotonic time when the rate limits allow the next start
        # Rate-limited queues whose starts the next claim takes ahead, in a transaction of its
        # own (store.pace_ahead), and those the claim paces itself (other limits too); the
        # latter are asked again at every poll.
        self._paced: set[str] = set()
        self._paced_inline: set[str] = set()
        self._pace: store.Pace | None = None
        # Queues where the last acknowledgement made workflow steps ready (see wake_left).
        self._readied: list[str] = []

    # -- what wakes a claim --------------------------------------------------------------------

    def notified(self, payload: str | None) -> bool:
        """A notification named these queues (comma-separated; empty or None: any queue), with
        the earliest run_at of its rows (schema/0015). A queue whose cursor is past that time is
        read from that time next (ClaimCursor.rewind); every queue is read from its start after
        a notification that names none (too many names, or LISTEN was made again and some may
        have been missed). Returns whether this worker serves any of the queues."""
        names, earliest = store.parse_notification(payload)
        if names is None:
            self._hot.update(self.queues)
            for name in self.cursor.placed():
                self.cursor.reset(name)
            return True
        served = self._served.intersection(names)
        self._hot.update(served)
        if earliest is not None:
            for name in served:
                self.cursor.rewind(name, earliest)
        return bool(served)

    def mark(self, names: Sequence[str]) -> None:
        """These queues hold work (the maintenance thread's poll): read them next."""
        self._hot.update(n for n in names if n in self._served)

    def learn(self, definition: TaskDef) -> None:
        """A handler met after the claim (a registry that loads handlers on demand): the next
        claims fill in its max_attempts for rows whose producer left it to the handler, as they
        do for every handler known at start."""
        if self.max_attempts.get(definition.name) != definition.max_attempts:
            self.max_attempts[definition.name] = definition.max_attempts
            self._handlers = store.HandlerLimits(self.max_attempts)

    def freed(self) -> None:
        """This worker finished tasks: limited queues held back by a concurrency limit may have
        room now."""
        self._hot.update(self._held)
        self._held.clear()

    def polls_all(self) -> bool:
        """Whether the poll claims over every queue. A worker serving many queues leaves the
        poll to the maintenance thread instead (``store.due_queues``, one index probe per queue,
        off the claim path), which names the queues that hold work."""
        return len(self.queues) <= MANY_QUEUES

    def wants_claim(self, now: float) -> bool:
        """A queue may hold work, or it is time to poll or promote."""
        return (
            bool(self._hot)
            or now >= self._poll_at
            or now >= self._promote_at
            or now >= self._limit_at
        )

    def next_deadline(self) -> float:
        """Monotonic time of the next poll, promotion or start a rate limit allows; 0 while a
        queue waits to be read (after a failed claim, say, with nothing else to wake the loop)."""
        if self._hot:
            return 0.0
        return min(self._poll_at, self._promote_at, self._limit_at)

    # -- the statements ------------------------------------------------------------------------

    def acknowledge(
        self, conn: psycopg.Connection, jobs: list[Job], *, claim_follows: bool = False
    ) -> tuple[dict[int, str], dict[int, str]]:
        """The done, failed and handed-back jobs, one statement each: ({id: "done" or
        "cancelled"} of the jobs that succeeded, {id: new state} of the others). Rows with a
        cancel request end "cancelled" either way. Jobs that carry a result (see tasks.results)
        take a statement of their own, and those of tasks that store one are announced to
        waiters; the others' acknowledgement is ``complete`` alone. Workflow steps that others
        wait for carry their result (see engine.runners), and the statement that acknowledges
        them settles their dependents (``store.complete_steps``); steps that failed or were
        handed back settle theirs after (``store.settle_steps``). With ``claim_follows``, a
        claim comes next in this transaction: the queues where steps become ready are not woken
        now (that claim reads them), and ``wake_left`` wakes them after it if it may have left
        a ready step behind."""
        f = Finished.of(jobs)
        done, with_result, step_results = f.done, f.with_result, f.step_results
        failures, released, handbacks, carry = f.failures, f.released, f.handbacks, f.carry
        kept: dict[int, str] = {}
        states: dict[int, str] = {}
        # Steps made ready here are read by the claim that follows in this transaction: a
        # chain's next step is claimed in the commit that finished the one before it, without
        # waking any worker (this one included) for a claim that would find nothing.
        quiet = self.queues if claim_follows else []
        self._readied = []
        if jobs and self._held:
            self.freed()
        if done:
            kept = store.complete(
                conn,
                self.q.schema,
                worker_id=self.worker_id,
                done=done,
                delete=self.delete_done,
                move=self.move_done,
            )
        stored: dict[int, str] = {}
        if with_result:
            stored = store.complete_with_result(
                conn, self.q.schema, worker_id=self.worker_id, done=with_result, move=self.move_done
            )
        settled: dict[int, str] = {}
        if step_results:
            settled, self._readied = store.complete_steps(
                conn, self.q.schema, worker_id=self.worker_id, done=step_results, quiet=quiet
            )
            stored.update(settled)
        if stored:
            # The results of tasks that store one are announced: whoever waits for one of them
            # learns at the commit that it ended. A workflow step's result kept only for its
            # dependents is not: a wait for it learns by reading again, as for any task that
            # stores no result. A notification serializes the commits of every session that
            # sends one, and a fan-out's steps would then commit one after the other.
            told = [j.id for j in carry if j.id in stored and self.stores_result(j.definition)]
            if told:
                store.notify_done(conn, self.q.schema, channel=self.done_channel, ids=sorted(told))
            kept.update(stored)
        if failures:
            states = store.fail(conn, self.q.schema, worker_id=self.worker_id, failures=failures)
            # Tasks that store a result and failed for good: their waiters hear it at once.
            failed = [j for j in jobs if states.get(j.id) == "failed"]
            ended = [j.id for j in failed if self.stores_result(j.definition)]
            if ended:
                store.notify_done(conn, self.q.schema, channel=self.done_channel, ids=ended)
        if handbacks:
            back = store.hand_back(conn, self.q.schema, worker_id=self.worker_id, rows=handbacks)
            for task_id, state in back.items():
                states[task_id] = "cancelled" if state == "cancelled" else "handed_back"
        if released:
            back = store.release(conn, self.q.schema, worker_id=self.worker_id, tasks=released)
            for task_id, state in back.items():
                states[task_id] = "cancelled" if state == "cancelled" else "released"
        # Workflows: the other steps that others wait for (known at their claim: failed, handed
        # back, or no longer ours) settle those in this transaction; a batch of plain tasks skips
        # it. A step passed over here that did not finish is settled when it does.
        steps = [j.id for j in jobs if j.claimed.dependents and j.outcome and j.id not in settled]
        if steps:
            self._readied += store.settle_steps(conn, self.q.schema, steps, quiet=quiet)
        self.mark(self._readied)
        return kept, states

    def wake_left(self, conn: psycopg.Connection, claim: Claim | None) -> None:
        """After the claim that follows ``acknowledge(claim_follows=True)``, in the same
        transaction: wake the workers of the queues where steps became ready unless this claim
        surely took every ready step there (it read the queue, came back short of its limit, and
        no limit held the queue back). A paused queue is woken when it is resumed."""
        readied, self._readied = self._readied, []
        drained: set[str] = set()
        if claim is not None and len(claim.rows) < claim.limit:
            drained = set(claim.queues) - claim.held - set(claim.waits)
        left = [name for name in readied if name in self._served and name not in drained]
        store.wake_queues(conn, self.q.schema, left)

    def pace_ahead(self, conn: psycopg.Connection, free: int) -> None:
        """Outside the claim's transaction: take the starts of the next claim of the rate-limited
        queue it reads first, if that queue is paced ahead. The claim then holds no lock on the
        queue's pace until it commits, and two workers' claims of one rate-limited queue no
        longer take turns (see schema/0024). Starts the claim does not use go back to the pace."""
        self._pace = None
        if free <= 0 or not self._paced or not self._hot:
            return
        n = len(self.queues)
        first = next(
            (q for i in range(n) if (q := self.queues[(self._turn + i) % n]) in self._hot), None
        )
        if first is None or first not in self._paced:
            return
        pace = store.pace_ahead(conn, self.q.schema, first, min(self.batch_size, free))
        if pace is None:
            self._paced.discard(first)
            self._paced_inline.add(first)
        self._pace = pace

    def claim(self, conn: psycopg.Connection, free: int, now: float) -> Claim | None:
        """Promote due scheduled rows when it is time, then claim up to ``free`` rows of the
        queues that may hold work, in one statement. None when no queue needs reading."""
        pace, self._pace = self._pace, None
        if now >= self._poll_at:
            self._paced_inline.clear()
            if self.polls_all:
                self._hot.update(self.queues)
            self._poll_at = now + self.poll_interval
        if now >= self._promote_at:
            promoted = store.promote(conn, self.q.schema, limit=PROMOTE_LIMIT, channel=self.channel)
            wait = self.poll_interval
            if promoted.count >= PROMOTE_LIMIT:
                wait = 0.0
            elif promoted.next_due_in is not None:
                wait = min(wait, max(promoted.next_due_in, 0.0))
            self._promote_at = now + wait
            if promoted.count:
                self._hot.update(self.queues)
                # Rows due a while ago (promotion ran late) may sit behind this worker's cursor.
                if promoted.earliest is not None:
                    for name in promoted.queues:
                        self.cursor.rewind(name, promoted.earliest)
        if now >= self._limit_at:
            self._hot.update(self._waiting)
            self._waiting.clear()
            self._limit_at = math.inf
        if free <= 0 or not self._hot:
            return None
        n = len(self.queues)
        order = [self.queues[(self._turn + i) % n] for i in range(n)]
        self._turn += 1
        names = [name for name in order if name in self._hot]
        limit = min(self.batch_size, free)
        taken = store.claim_all(
            conn,
            self.q.schema,
            queues=names,
            limit=limit,
            worker_id=self.worker_id,
            lease_seconds=self.lease_seconds,
            cursor=self.cursor,
            max_attempts=self._handlers,
            pace=pace,
        )
        for wait in taken.waits.values():
            self._limit_at = min(self._limit_at, now + wait)
        return Claim(names, limit, taken.rows, taken.waits, taken.held)

    def committed(self, claim: Claim | None) -> bool:
        """After the commit: move the cursors and decide which queues stay hot. True when the
        claim came back full (more may wait)."""
        if claim is None:
            return False
        by_queue: dict[str, list[store.Claimed]] = {}
        if len(claim.queues) == 1 and not claim.waits and not claim.held:
            if claim.rows and not claim.rows[0].limited:
                by_queue[claim.queues[0]] = claim.rows  # one queue: every row is of it
        else:
            for row in claim.rows:  # in claim order within each queue
                if not row.limited:  # limited queues are read from their start
                    by_queue.setdefault(row.queue, []).append(row)
        for name, rows in by_queue.items():
            self.cursor.advance(name, rows)
        for row in claim.rows:
            if row.start_in is not None and row.queue not in self._paced_inline:
                self._paced.add(row.queue)  # paced by a rate: its next claims pace it ahead
        full = len(claim.rows) >= claim.limit
        self._hot.difference_update(claim.queues)
        if full:
            # The statement stopped at the limit: the queues it reached may hold more, and the
            # ones after them were not read at all.
            last = claim.rows[-1].queue
            self._hot.update(claim.queues[max(0, claim.queues.index(last)) :])
        # A limited queue held back waits for a slot (freed), or for the rate's next start
        # (_limit_at); the poll reads it again in any case.
        self._held.update(claim.held)
        self._waiting.update(claim.waits)
        self._hot.difference_update(claim.held, claim.waits)
        return full

    def rolled_back(self, claim: Claim | None) -> None:
        """The transaction failed: read the same queues again next time."""
        if claim is not None:
            self._hot.update(claim.queues)

    def rewind(self, found: Sequence[tuple[str, int | None]]) -> None:
        """Rows committed behind the cursor of these queues, the earliest at this run_at
        (microseconds since the epoch; None: unknown, see store.behind): read them from
        there."""
        for name, earliest in found:
            if earliest is None:
                self.cursor.reset(name)
            else:
                self.cursor.rewind(name, earliest)
            if name in self._served:
                self._hot.add(name)


__all__ = ["MANY_QUEUES", "PROMOTE_LIMIT", "Batcher", "Claim"]
