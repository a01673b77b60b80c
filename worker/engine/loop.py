"""One worker process: claim batches, hand them to runner threads, acknowledge in batches.

Read this module top to bottom for the path of a task inside a worker (ARCHITECTURE.md has the
whole path). Four kinds of thread, each with one job and its own connection, so none can delay
another:

* the main thread (this module) claims and acknowledges: one transaction per batch that
  acknowledges the finished jobs and claims the next rows (``engine.batch``), and nothing else.
  Its connection also LISTENs, and the loop sleeps on that socket and on what the other threads
  report (``engine.inbox``);
* runner threads (``engine.runners``) run handlers and report outcomes as plain values;
* the lease keeper (``engine.lease``) renews the leases of every job the process holds, and reads
  cancel requests when no listener can hear them;
* maintenance (``engine.maintenance``) rescues expired rows, purges old ones and enqueues cron
  slots.

Each job is a small state machine (``engine.job``), and only this thread moves jobs between
states: the rule that keeps the other threads lock-free. ``engine.startup`` builds the parts and
registers the worker; ``engine.dispatch`` turns claimed rows into jobs; ``engine.reports`` says
what the other threads' reports mean; ``engine.stopping`` is the graceful stop.

Over 400 lines on purpose: the loop, its decisions of when to claim and how long to sleep, and
the one transaction that acknowledges and claims share the job table and the hooks lock, and
read best together; each part that can stand apart (above) does.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue as queue_mod
import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

import psycopg
from psycopg_pool import ConnectionPool

from .. import store
from ..coord import cancel as _cancel
from ..db.connect import HANDLERS, Backoff, pool
from ..db.outage import OUTAGE, unreachable
from ..db.sql import queries
from ..hooks import Hooks
from ..tasks import results
from ..tasks.registry import DEFAULT_QUEUE, Context, Registry, TaskDef, registry
from . import dispatch, reports, startup, stopping
from .batch import Claim
from .inbox import Inbox
from .job import Job, JobTable, Outcome, State, decode_inputs, format_error
from .settings import WorkerConfig
from .supervisor import LIVENESS_ENV, WORKER_ID_ENV

log = logging.getLogger("worker")

_WAKE = object()
# Longest an outcome waits to be acknowledged with others (unless a claim or stop comes first).
_MAX_ACK_DELAY = 0.02
# A handler is written off this long after its timeout (async ones are cancelled at the timeout).
_OVERDUE_MARGIN = 0.25
# Longest the main loop waits between two reconnection attempts after a database error.
_MAX_BACKOFF = 1.0


class Worker:
    """A worker process's engine. ``run()`` blocks until ``stop()`` and returns an exit code."""

    def __init__(
        self,
        config: WorkerConfig,
        tasks: Registry | None = None,
        *,
        hooks: Hooks | None = None,
    ) -> None:
        self.config = config
        # "is None", not "or": a registry that loads handlers on demand starts out empty (falsy).
        self.registry = registry if tasks is None else tasks
        self.hooks = hooks or Hooks()
        self.id = config.worker_id or os.environ.get(WORKER_ID_ENV) or str(uuid.uuid4())
        self.q = queries(config.schema)
        queues = config.queues or sorted({*self.registry.queues(), DEFAULT_QUEUE})
        self.queues = list(dict.fromkeys(queues))
        results.check_config(self.config, self.registry)
        self._stop = threading.Event()
        self.stop_now = threading.Event()
        self.started = threading.Event()  # registered, its services running (see run)
        self.events = Inbox()  # what the other threads report, and the notifications
        self.table = JobTable(_OVERDUE_MARGIN)  # every job this process holds
        self._last_claim = 0.0
        self._hooks_lock = threading.RLock()  # one counted transaction at a time (see counted)
        self.exit_code = 0
        self.pool: ConnectionPool | None = None  # for transactional handlers (made by run)
        self.max_abandoned = config.max_abandoned or max(config.concurrency, 4)
        self._liveness = os.environ.get(LIVENESS_ENV)
        self._touched = 0.0
        parts = startup.assemble(self)
        self.batcher, self.executor, self.lease = parts.batcher, parts.executor, parts.lease
        self.maintenance, self.listener, self.conn = parts.maintenance, parts.listener, parts.conn
        self._listens_here = config.listen and not config.listen_dsn  # on the claim connection
        # Wall-clock marks for the benchmark: first claim, last acknowledgement, tasks done.
        self.first_claim: float | None = None
        self.last_ack: float | None = None
        self.done_count = 0
        # Tasks still running when a stop ended, in a process that goes on (see engine.stopping).
        self.left_running: list[int] = []

    def stores_result(self, definition: TaskDef) -> bool:
        return results.stores(definition, self.config.store_results)

    # -- lifecycle -----------------------------------------------------------------------------

    def stop(self, *, now: bool = False) -> None:
        """Ask for a graceful stop (finish or hand back in-flight tasks); ``now`` skips the wait."""
        self._stop.set()
        if now:
            self.stop_now.set()
        self.events.put(_WAKE)

    @property
    def stopping(self) -> bool:
        return self._stop.is_set()

    @property
    def listening(self) -> bool:
        """Whether notifications reach this process right now (else it polls)."""
        if self.listener is not None:
            return self.listener.connected
        return self.events.listening

    def run(self) -> int:
        cfg = self.config
        self.pool = pool(
            cfg.dsn,
            HANDLERS,
            max_size=cfg.concurrency,
            name=f"worker-{self.id[:8]}",
            session=cfg.prepare,
        )
        started: list[Any] = []
        try:
            startup.register(self.conn.get(), self)
            started = startup.start([self.executor, self.lease, self.maintenance, self.listener])
            startup.describe(self)
            self.started.set()
            self.hooks.started(self)
            try:
                self._loop()
            except Exception:
                # A bug, not an outage: still give back what this process holds, at once.
                log.exception("the worker loop failed; handing back its tasks and stopping")
                self.exit_code = self.exit_code or 1
                self.stop_now.set()
            stopping.shutdown(self)
        finally:
            self._stop.set()
            startup.stop(started)
            self.pool.close(timeout=2)
            self.conn.close()
            self.events.close()
            self.hooks.stopped(self)
        return self.exit_code

    # -- the loop ------------------------------------------------------------------------------

    def _loop(self) -> None:
        cfg = self.config
        backoff = Backoff(0.1, _MAX_BACKOFF)
        more = True  # the last claim came back full: claim again without waiting
        while not self._stop.is_set():
            wait = 0.0 if more else self._wait_time()
            self.collect(block=wait > 0, timeout=wait, busy=not self._can_claim())
            try:
                now = time.monotonic()
                reports.check_deadlines(self, now)
                ready = (
                    self._ready_to_claim()
                    and not self._stop.is_set()
                    and self.batcher.wants_claim(now)
                )
                pending = self.table.pending
                if (
                    pending
                    and not ready
                    and (
                        not self.table.active()
                        or len(pending) >= cfg.batch_size
                        or now - pending.since >= _MAX_ACK_DELAY
                    )
                ):
                    self.flush()
                more = False
                if ready:
                    claimed, more = self._claim()
                    if cfg.burst and claimed == 0 and not self.table:
                        break
                elif self._listens_here and not self.events.listening:
                    # Lost while every slot is taken: no claim would connect again for as long
                    # as the tasks run, and cancels would wait for the poll. Connect (and LISTEN).
                    self.conn.get()
                self._touch(now)
                backoff.reset()
                OUTAGE.back("claim")
            except (psycopg.OperationalError, psycopg.InterfaceError) as exc:
                self.conn.close()
                delay = backoff.next()
                more = False
                with self._hooks_lock:
                    self.hooks.db_error(self, exc)
                if unreachable(exc):
                    OUTAGE.lost("claim", exc)
                else:
                    log.warning("claim or acknowledgement failed (%s); retrying", _first_line(exc))
                # Retrying is not stuck: tell the supervisor so (see engine.supervisor), or an
                # outage longer than its stuck limit gets every worker process killed.
                self._touch(time.monotonic(), force=True)
                self._stop.wait(delay)
            except psycopg.Error as exc:
                # Not an outage, and not one row's fault (rows are decoded per task, outside
                # this transaction): say so, and keep going rather than take the process down.
                self.conn.close()
                delay = backoff.next()
                more = False
                with self._hooks_lock:
                    self.hooks.db_error(self, exc)
                log.error("claim or acknowledgement failed: %s", _first_line(exc)[:500])
                self._touch(time.monotonic(), force=True)
                self._stop.wait(delay)

    def _touch(self, now: float, *, force: bool = False) -> None:
        if self._liveness and (force or now - self._touched >= 1.0):
            with contextlib.suppress(OSError):
                os.utime(self._liveness)
            self._touched = now

    def _can_claim(self) -> bool:
        """Whether a notification of new rows could be acted on now. When not (every slot
        taken, or too few free to claim yet), it can wait for the loop's next wake-up."""
        return self._ready_to_claim() or not self.table.active()

    def _ready_to_claim(self) -> bool:
        """Claim when at least half a batch of slots is free, so claims stay large when tasks
        are short, or when nothing at all is running, or when free slots have waited a poll
        interval: long tasks free slots one at a time and may not free more for hours."""
        if time.monotonic() - self.lease.last_renewal > self.config.lease_seconds / 2:
            # The lease keeper cannot renew (its connection, or the thread, is failing): rows we
            # claim now could lapse and run elsewhere while they run here. Wait for it.
            return False
        active = self.table.active()
        free = self.config.concurrency - active
        want = min(self.config.batch_size, self.config.concurrency)
        if free <= 0:
            return False
        if not active or free >= max(1, want // 2):
            return True
        return time.monotonic() - self._last_claim >= self.config.poll_interval

    def _wait_time(self) -> float:
        """Sleep until an outcome, a NOTIFY, the ack delay, a deadline or the poll interval."""
        now = time.monotonic()
        wait = self.config.poll_interval
        pending = self.table.pending
        if pending:
            wait = min(wait, max(pending.since + _MAX_ACK_DELAY - now, 0.0))
        deadline = self.table.next_deadline()
        if deadline is not None:
            wait = min(wait, max(deadline - now, 0.0) + 0.01)
        if self._ready_to_claim():  # else a past poll deadline would make this loop spin
            wait = min(wait, max(self.batcher.next_deadline() - now, 0.0))
        return max(wait, 0.001)

    def collect(self, *, block: bool, timeout: float, busy: bool = False) -> None:
        """Take what the other threads reported; block for the first report when idle.
        ``busy``: no claim could follow a notification now (see engine.inbox)."""
        try:
            item = self.events.get(timeout, busy=busy) if block else self.events.get_nowait()
        except queue_mod.Empty:
            return
        rest = self.events.more  # the rest, without looking for notifications again
        freed = False
        while True:
            if type(item) is Outcome:
                with self._hooks_lock:  # hooks hear one thread at a time (see counted)
                    reports.record(self, item)
                freed = True
            elif item is _WAKE:
                pass  # stop() wakes the loop; the loop reads the stop flag itself
            elif item[0] == "notify":
                self.batcher.notified(item[1])
            elif item[0] == "due":
                self.batcher.mark(item[1])
            elif item[0] == "behind":
                self.batcher.rewind(item[1])

            elif item[0] == "started":
                self.table.started(*item[1:])
            elif item[0] == "lost":
                with self._hooks_lock:
                    reports.lost(self, item[1])
            elif item[0] == "cancel":
                reports.cancel_requested(self, item[1])
            try:
                item = rest()
            except queue_mod.Empty:
                break
        if freed:
            # A slot of ours is free: a limited queue held back may have room now, and the claim
            # that acknowledges these outcomes reads it.
            self.batcher.freed()

    def cancel_notified(self, payload: str | None) -> None:
        """A notification on the cancel channel (on the main thread, or the listener's). Every
        id goes to the loop, which skips those it does not hold (see coord.cancel): filtering here
        could drop a task the loop has claimed and not yet recorded (the listener's thread races
        the loop's dispatch), and its cancel would wait for a heartbeat."""
        ids = _cancel.parse_payload(payload)
        if ids is None:  # no ids (too many to list, or a reconnection): read the marks
            self.lease.check_cancels()
            return
        if ids:
            self.events.put(("cancel", ids))

    # -- acknowledging and claiming ----------------------------------------------------------

    @contextlib.contextmanager
    def counted(self, conn: psycopg.Connection) -> Iterator[None]:
        """A transaction whose events the hooks hear inside it, so that an observer can tie what
        it counts to the commit (see worker.hooks.Hooks.begin). One at a time per process: the main
        thread's claims and the maintenance thread's rescues take turns at the hooks."""
        hooks = self.hooks
        with self._hooks_lock:
            hooks.begin()
            try:
                with conn.transaction():
                    yield
                    hooks.prepare(self, conn)
            except BaseException:
                hooks.rollback()
                raise
            try:
                hooks.commit()
            except Exception:  # the transaction committed: an observer must not undo that
                log.exception("a hook failed after a commit; the work goes on")

    def flush(self) -> None:
        """Acknowledge on its own, when no claim is due to carry the acknowledgements."""
        if self.table.pending:
            self._claim(claim=False)

    def _claim(self, *, claim: bool = True) -> tuple[int, bool]:
        """Acknowledge what is pending and fill free slots, in one transaction (see engine.batch).

        If anything fails, both roll back together: the finished jobs stay pending and the rows
        we tried to claim stay queued. Returns how many rows were claimed and whether a queue
        came back full (more may be waiting).
        """
        with self._hooks_lock:  # before taking the jobs: they wait for no one as ACKING
            return self._claim_locked(claim)

    def _claim_locked(self, claim: bool) -> tuple[int, bool]:
        # Connect first: jobs taken for acknowledgement must go back to pending on any failure,
        # or they would stay "acking" (leased, never acknowledged) for good.
        conn = self.conn.get()
        free = self.config.concurrency - self.table.active() if claim else 0
        acking = self.table.take_pending()
        got: Claim | None = None
        now = time.monotonic()
        if claim:
            self._last_claim = now
        try:
            if claim:
                self.batcher.pace_ahead(conn, free)  # in a transaction of its own, first
            with self.counted(conn):
                kept, states = self.batcher.acknowledge(conn, acking, claim_follows=claim)
                if claim:
                    got = self.batcher.claim(conn, free, now)
                    self.batcher.wake_left(conn, got)
                self._report_acked(acking, kept, states)
                if got is not None and got.rows:
                    self.hooks.claimed(self, got.rows)
        except BaseException:
            self.table.unack(acking)  # not acknowledged: they wait for the next transaction
            self.batcher.rolled_back(got)
            raise
        for job in acking:
            self.table.forget(job)
        completed = reports.log_acknowledged(acking, kept, states)
        if completed:
            self.done_count += completed
            self.last_ack = time.time()
        full = self.batcher.committed(got)
        if got is None or not got.rows:
            return 0, full
        if self.first_claim is None:
            self.first_claim = time.time()
        self._dispatch(got.rows)
        return len(got.rows), full

    def _report_acked(self, jobs: list[Job], kept: dict[int, str], states: dict[int, str]) -> None:
        """Inside the acknowledging transaction: tell the hooks what it changed."""
        cancelled: list[int] = []
        if "cancelled" in kept.values() or "cancelled" in states.values():  # rare: look closer
            cancelled = [i for i, s in (*kept.items(), *states.items()) if s == "cancelled"]
            kept = {i: s for i, s in kept.items() if s != "cancelled"}
            states = {i: s for i, s in states.items() if s != "cancelled"}
        # kept holds only jobs that succeeded (see acknowledge): its ids are the done ones.
        if any(j.outcome and j.outcome.ok for j in jobs):
            self.hooks.acked(self, "done", list(kept))
        if any(j.outcome and not j.outcome.ok for j in jobs):
            self.hooks.acked(self, "failed", states)
        if cancelled:
            self.hooks.acked(self, "cancelled", cancelled)

    def _dispatch(self, rows: list[store.Claimed]) -> None:
        """Claimed rows become jobs; those a runner can start go to the runners, the others
        (no handler here, a payload that cannot be decoded) are settled at once."""
        now = time.monotonic()
        ready: list[Job] = []
        for c in rows:
            definition = self.registry.get(c.task)
            job = self.table.add(c, definition or dispatch.UNKNOWN, now)
            if definition is None:
                error = dispatch.unknown_task(c.task, self.registry, self.id)
                job.state = State.RUNNING
                reports.record(self, Outcome(job.token, ok=False, error=error, handback=True))
                continue
            if definition.name not in self.batcher.max_attempts:
                self.batcher.learn(definition)
            job.not_before, job.not_after = c.not_before, c.not_after  # a rate's pace
            job.payload, error = dispatch.payload_of(c, definition)
            if error is not None:
                job.state = State.RUNNING
                reports.record(self, Outcome(job.token, ok=False, error=error, permanent=True))
                continue
            ready.append(job)
        self.executor.submit_many(ready)

    def probe(self, conn: psycopg.Connection) -> None:
        """On the maintenance thread: queues with rows committed behind the claim's cursor."""
        found = store.behind(conn, self.q.schema, self.batcher.cursor)
        if found:
            self.events.put(("behind", found))

        if not self.batcher.polls_all:
            due = store.due_queues(conn, self.q.schema, self.queues)
            if due:
                self.events.put(("due", due))

    def rescued(self, rows: list[tuple[int, str, str, str]]) -> None:
        """On the maintenance thread, inside the rescue's counted transaction."""
        self.hooks.rescued(self, rows)
        self.events.put(("notify", None))  # rescued rows are due now: claim them at once

    def cron_enqueued(self, n: int) -> None:
        with self._hooks_lock:
            self.hooks.cron_enqueued(self, n)

    # -- handlers that need the worker ---------------------------------------------------------

    def context(self, job: Job, conn: psycopg.Connection | None = None) -> Context:
        c = job.claimed
        ctx = Context(
            c.id, c.task, c.queue, c.attempt, c.max_attempts, self.id, conn, cancel_signal=job
        )
        if c.workflow_id is not None:
            ctx.workflow_id = c.workflow_id
            ctx.inputs = decode_inputs(c.inputs)
        return ctx


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


__all__ = ["Worker", "WorkerConfig", "format_error"]
