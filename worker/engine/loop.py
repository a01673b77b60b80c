"""One worker process: claim batches, hand them to runner threads, acknowledge in batches.

Four kinds of thread, each with one job and its own connection, so none can delay another:

* the main thread (this module) claims and acknowledges: one transaction per batch that
  acknowledges the finished jobs and claims the next rows, and nothing else. Its connection
  also LISTENs, and the loop sleeps on that socket and on what the others report (``engine.inbox``);
* runner threads (``engine.runners``) run handlers and report outcomes as plain values;
* the lease keeper (``engine.lease``) renews the leases of every job the process holds, and reads
cancel requests when no listener can hear them; * maintenance (``engine.maintenance``) rescues
expired rows, purges old ones and enqueues cron slots.

Each job is a small state machine (``engine.job``). A graceful stop acknowledges finished jobs as
they arrive, keeps renewing the running ones through the grace period, then hands back the rest.

Over 500 lines on purpose: the loop, its batches and its stop are one piece because they are the
only code that moves jobs between states (the rule that keeps the other threads lock-free); what
could stand apart did: engine.job, engine.batch, engine.runners, engine.lease, engine.maintenance,
engine.listener, engine.settings, coord.cancel, engine.inbox."""

from __future__ import annotations

import contextlib
import logging
import os
import queue as queue_mod
import socket
import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

import psycopg
from psycopg_pool import ConnectionPool

from .. import store
from ..coord import cancel as _cancel
from ..coord.cron import make_ticker
from ..db.connect import CLAIM, HANDLERS, Backoff, OwnConnection, pool
from ..db.migrate import require_schema
from ..db.sql import cancel_channel, notify_channel, queries
from ..errors import Cancelled, LostLease, PayloadError
from ..hooks import Hooks
from ..tasks import limits as flow
from ..tasks import results
from ..tasks.payload import from_json
from ..tasks.registry import DEFAULT_QUEUE, Context, Registry, TaskDef, registry
from .batch import Batcher, Claim, log_acknowledged
from .inbox import Inbox
from .job import Job, JobTable, Outcome, State, clean_text, decode_payload, display, format_error
from .lease import LeaseKeeper
from .listener import Listener
from .maintenance import Maintenance, MaintenanceConfig
from .runners import Executor, cancel
from .settings import WorkerConfig
from .supervisor import LIVENESS_ENV, WORKER_ID_ENV
from .vacuum import Vacuumer

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
        # Where rows of our tasks land when their producer names no queue (schema/0006).
        self._routes = {
            name: d.queue for name in self.registry.names() if (d := self.registry.get(name))
        }
        # For rows whose producer left max_attempts to the handler (see store.claim).
        self._max_attempts = {
            name: d.max_attempts for name in self.registry.names() if (d := self.registry.get(name))
        }
        results.check_config(self.config, self.registry)
        self._done_channel = results.done_channel(config.schema)
        self._stop = threading.Event()
        self._stop_now = threading.Event()
        self._events = Inbox()  # what the other threads report, and the notifications
        self.table = JobTable(_OVERDUE_MARGIN)  # every job this process holds
        self.batcher = Batcher(
            self.q,
            self.id,
            queues=self.queues,
            batch_size=config.batch_size,
            lease_seconds=config.lease_seconds,
            delete_done=config.keep_done_seconds <= 0,
            max_attempts=self._max_attempts,
            poll_interval=config.poll_interval,
            channel=notify_channel(config.schema),
            done_channel=self._done_channel,
            stores_result=self.stores_result,
        )
        self._last_claim = 0.0
        # LISTEN for new rows and for cancel requests: on the main thread's own connection, or
        # behind PgBouncer in transaction mode on the listener's (listen_dsn); neither: poll.
        self._channels = {
            notify_channel(config.schema): lambda p: self._events.put(("notify", p)),
            cancel_channel(config.schema): self._cancel_notified,
        }
        self.listener: Listener | None = None
        self._listens_here = config.listen and not config.listen_dsn  # on the claim connection
        if config.listen and config.listen_dsn:
            self.listener = Listener(config.listen_dsn, self._channels)
        # The main thread's own connection, made again after an error (no pool backoff).
        self._conn = OwnConnection(
            config.dsn,
            CLAIM,
            session=config.prepare,
            on_connect=self._listen if self._listens_here else None,
        )
        self._hooks_lock = threading.RLock()  # one counted transaction at a time (see counted)
        self.exit_code = 0
        self.pool: ConnectionPool | None = None  # for transactional handlers
        self._max_abandoned = config.max_abandoned or max(config.concurrency, 4)
        self._liveness = os.environ.get(LIVENESS_ENV)
        self._touched = 0.0
        self.executor = Executor(
            config.concurrency,
            self._events,
            context=self._context,
            transactional=self._run_transactional,
            stores_result=self.stores_result,
            max_result_bytes=config.max_result_bytes,
        )
        self.lease = LeaseKeeper(
            config.dsn,
            self.q,
            worker_id=self.id,
            lease_seconds=config.lease_seconds,
            interval=config.heartbeat_seconds,
            leased=self.table.leased,
            on_lost=lambda ids: self._events.put(("lost", ids)),
            prepare=config.prepare,
            running=self.table.running_ids,
            on_cancel=lambda ids: self._events.put(("cancel", ids)),
            polling=self._cannot_listen,
        )
        self.maintenance = Maintenance(
            config.dsn,
            self.q,
            MaintenanceConfig(
                rescue_seconds=config.rescue_seconds,
                purge_seconds=config.purge_interval,
                keep_done_seconds=config.keep_done_seconds,
                keep_failed_seconds=config.keep_failed_seconds,
                cron_keep_seconds=config.cron_keep_seconds,
            ),
            counted=self.counted,
            on_rescued=self._rescued,
            on_cron=self._cron_enqueued,
            # Never offer a slot older than cron rows are kept: a purged slot could run again.
            cron=make_ticker(config.schema, horizon_seconds=config.cron_keep_seconds),
            probe=self._probe,
            notified=lambda: self.listening,
            vacuum=Vacuumer(self.q, config.schema),
            prepare=config.prepare,
        )
        # Wall-clock marks for the benchmark: first claim, last acknowledgement, tasks done.
        self.first_claim: float | None = None
        self.last_ack: float | None = None
        self.done_count = 0

    def stores_result(self, definition: TaskDef) -> bool:
        return results.stores(definition, self.config.store_results)

    # -- lifecycle -----------------------------------------------------------------------------

    def stop(self, *, now: bool = False) -> None:
        """Ask for a graceful stop (finish or hand back in-flight tasks); ``now`` skips the wait."""
        self._stop.set()
        if now:
            self._stop_now.set()
        self._events.put(_WAKE)

    @property
    def stopping(self) -> bool:
        return self._stop.is_set()

    @property
    def listening(self) -> bool:
        """Whether notifications reach this process right now (else it polls)."""
        if self.listener is not None:
            return self.listener.connected
        return self._events.listening

    def _listen(self, conn: psycopg.Connection) -> None:
        """The main thread's connection was made: LISTEN on it. If it breaks while the loop
        sleeps, claim at once, which connects again (see engine.inbox)."""
        lost = ("notify", None)
        self._events.listen(conn, self._channels, on_lost=lambda: self._events.put(lost))

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
            conn = self._conn.get()
            if cfg.check_schema:
                require_schema(conn, cfg.schema)
            # Flow control (schema/0014): record the limits our code declares (the claims learn
            # which queues are limited, see Batcher.claim).
            flow.declare(conn, cfg.schema, self.registry.limits, by=f"worker {self.id[:8]}")
            conn.execute(
                self.q["register"],
                {
                    "worker_id": self.id,
                    "host": socket.gethostname(),
                    "pid": os.getpid(),
                    "queues": self.queues,
                    "concurrency": cfg.concurrency,
                    "tasks": list(self._routes),
                    "task_queues": list(self._routes.values()),
                },
            )
            store.wake_handed_back(conn, cfg.schema, list(self._routes))
            services: list[Any] = [self.executor, self.lease, self.maintenance]
            if self.listener is not None:
                services.append(self.listener)
            for service in services:
                service.start()
                started.append(service)
            log.info(
                "worker %s started: queues=%s concurrency=%d batch=%d",
                self.id[:8],
                ",".join(self.queues),
                cfg.concurrency,
                cfg.batch_size,
            )
            self.hooks.started(self)
            try:
                self._loop()
            except Exception:
                # A bug, not an outage: still give back what this process holds, at once.
                log.exception("the worker loop failed; handing back its tasks and stopping")
                self.exit_code = self.exit_code or 1
                self._stop_now.set()
            self._shutdown()
        finally:
            self._stop.set()
            for service in reversed(started):
                service.stop()
            self.pool.close(timeout=2)
            self._conn.close()
            self._events.close()
            self.hooks.stopped(self)
        return self.exit_code

    # -- the loop ------------------------------------------------------------------------------

    def _loop(self) -> None:
        cfg = self.config
        backoff = Backoff(0.1, _MAX_BACKOFF)
        more = True  # the last claim came back full: claim again without waiting
        while not self._stop.is_set():
            wait = 0.0 if more else self._wait_time()
            self._collect(block=wait > 0, timeout=wait, busy=not self._can_claim())
            try:
                now = time.monotonic()
                self._check_deadlines(now)
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
                    self._flush()
                more = False
                if ready:
                    claimed, more = self._claim()
                    if cfg.burst and claimed == 0 and not self.table:
                        break
                elif self._listens_here and not self._events.listening:
                    # Lost while every slot is taken: no claim would connect again for as long
                    # as the tasks run, and cancels would wait for the poll. Connect (and LISTEN).
                    self._conn.get()
                self._touch(now)
                backoff.reset()
            except (psycopg.OperationalError, psycopg.InterfaceError) as exc:
                self._conn.close()
                delay = backoff.next()
                more = False
                with self._hooks_lock:
                    self.hooks.db_error(self, exc)
                log.warning(
                    "database unavailable (%s); retrying in %.1fs",
                    str(exc).strip().splitlines()[0] if str(exc) else type(exc).__name__,
                    delay,
                )
                # Retrying is not stuck: tell the supervisor so (see engine.supervisor), or an
                # outage longer than its stuck limit gets every worker process killed.
                self._touch(time.monotonic(), force=True)
                self._stop.wait(delay)
            except psycopg.Error as exc:
                # Not an outage, and not one row's fault (rows are decoded per task, outside
                # this transaction): say so, and keep going rather than take the process down.
                self._conn.close()
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

    def _collect(self, *, block: bool, timeout: float, busy: bool = False) -> None:
        """Take what the other threads reported; block for the first report when idle.
        ``busy``: no claim could follow a notification now (see engine.inbox)."""
        try:
            item = self._events.get(timeout, busy=busy) if block else self._events.get_nowait()
        except queue_mod.Empty:
            return
        rest = self._events.more  # the rest, without looking for notifications again
        freed = False
        while True:
            if type(item) is Outcome:
                with self._hooks_lock:  # hooks hear one thread at a time (see counted)
                    self._record(item)
                freed = True
            elif item is _WAKE:
                pass  # stop() wakes the loop; the loop reads the stop flag itself
            elif item[0] == "notify":
                self.batcher.notified(item[1])
            elif item[0] == "due":
                self.batcher.mark(item[1])
            elif item[0] == "behind":
                self.batcher.reset(item[1])

            elif item[0] == "started":
                self.table.started(*item[1:])
            elif item[0] == "lost":
                with self._hooks_lock:
                    self._lost(item[1])
            elif item[0] == "cancel":
                self._cancel(item[1])
            try:
                item = rest()
            except queue_mod.Empty:
                break
        if freed:
            # A slot of ours is free: a limited queue held back may have room now, and the claim
            # that acknowledges these outcomes reads it.
            self.batcher.freed()

    def _record(self, outcome: Outcome) -> None:
        before = self.table.jobs.get(outcome.token)
        overdue = before is not None and before.state is State.OVERDUE
        job = self.table.finish(outcome)
        if job is None:
            return
        c = job.claimed
        if job.lost:
            log.warning(
                "task %d (%s) finished after its lease was lost; result discarded",
                c.id,
                display(c.task),
            )
            return
        if overdue:
            log.warning(
                "task %d (%s): its handler came back after it was written off",
                c.id,
                display(c.task),
            )
        self.hooks.finished(self, job.definition, c, outcome.ok, outcome.duration)
        if outcome.acked:
            self.hooks.acked(self, "done", [c.id])
            self.done_count += 1

    def _lost(self, pairs: list[tuple[int, int]]) -> None:
        for task_id, attempt in pairs:
            job = self.table.lose(task_id, attempt)
            if job is None:
                continue
            log.warning(
                "lost task %d (%s): its lease expired and it was rescued; "
                "this worker will not complete it",
                job.id,
                display(job.claimed.task),
            )
            self.hooks.lost(self, job.claimed)

    def _cancel(self, ids: list[int]) -> None:
        """Someone asked to cancel these tasks: stop the handlers of those still running here.
        The rows end cancelled whatever the handlers do (see complete in queries/tasks.sql)."""
        for task_id in ids:
            job = self.table.cancel(task_id)
            if job is None:
                continue  # not ours, or its handler already came back
            log.info(
                "task %d (%s): cancel requested; %s",
                job.id,
                display(job.claimed.task),
                "cancelling its handler"
                if job.definition.is_async
                else "its handler sees ctx.cancelled",
            )
            cancel(job)

    def _cancel_notified(self, payload: str | None) -> None:
        """A notification on the cancel channel (on the main thread, or the listener's). Every
        id goes to the loop, which skips those it does not hold (see coord.cancel): filtering here
        could drop a task the loop has claimed and not yet recorded (the listener's thread races
        the loop's dispatch), and its cancel would wait for a heartbeat."""
        ids = _cancel.parse_payload(payload)
        if ids is None:  # no ids (too many to list, or a reconnection): read the marks
            self.lease.check_cancels()
            return
        if ids:
            self._events.put(("cancel", ids))

    def _cannot_listen(self) -> bool:
        """Whether cancel requests must be polled for: nobody listens, or not right now."""
        return not self.listening

    def _check_deadlines(self, now: float) -> None:
        """Write off handlers past their timeout: their rows stay leased until they return."""
        for job in self.table.overdue(now):
            self.executor.retire(job.runner)
            stuck = self.executor.retired
            log.error(
                "task %d (%s) exceeded its %gs timeout; its thread is written off and its row "
                "stays leased until it returns (%d stuck)",
                job.id,
                display(job.claimed.task),
                job.definition.timeout,
                stuck,
            )
            if stuck > self._max_abandoned:
                log.error(
                    "%d handler threads are stuck; stopping this process so it can be replaced",
                    stuck,
                )
                self.exit_code = 3
                self.stop(now=True)

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

    def _flush(self) -> None:
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
        conn = self._conn.get()
        free = self.config.concurrency - self.table.active() if claim else 0
        acking = self.table.take_pending()
        got: Claim | None = None
        now = time.monotonic()
        if claim:
            self._last_claim = now
        try:
            with self.counted(conn):
                kept, states = self.batcher.acknowledge(conn, acking)
                if claim:
                    got = self.batcher.claim(conn, free, now)
                self._report_acked(acking, kept, states)
                if got is not None and got.rows:
                    self.hooks.claimed(self, got.rows)
        except BaseException:
            self.table.unack(acking)  # not acknowledged: they wait for the next transaction
            self.batcher.rolled_back(got)
            raise
        for job in acking:
            self.table.forget(job)
        completed = log_acknowledged(acking, kept, states)
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
        now = time.monotonic()
        ready: list[Job] = []
        for c in rows:
            definition = self.registry.get(c.task)
            job = self.table.add(c, definition or _UNKNOWN, now)
            if definition is None:
                # Not this worker's to fail: an older worker in a rolling deploy, or a typo. The
                # row goes back uncounted, later each time, until a worker that has it comes.
                known = ", ".join(self.registry.names()) or "none"
                why = self.registry.why_missing(c.task) or f"known: {known[:1000]}"
                name = display(c.task)
                error = (
                    f"UnknownTask: no handler named '{name}' in worker {self.id[:8]} "
                    f"({why}); handed back without counting the attempt, until "
                    "a worker that has the handler takes it"
                )
                job.state = State.RUNNING
                self._record(Outcome(job.token, ok=False, error=error, handback=True))
                continue
            try:
                # Each payload on its own, after the claim committed: one that cannot be decoded
                # (nested thousands deep, a number of thousands of digits) fails its task alone.
                # Here rather than on the runner: a batch decoded in one go costs the runners
                # no extra turns at the GIL.
                job.payload = decode_payload(c.payload)
                if definition.payload is not None:
                    job.payload = from_json(c.task, definition.payload, job.payload)
            except PayloadError as exc:
                # It does not fit the task's model, and never will: fail it now, for good.
                error = clean_text(f"PayloadError: {exc}; not retried")
                job.state = State.RUNNING
                self._record(Outcome(job.token, ok=False, error=error, permanent=True))
                continue
            except Exception as exc:
                error = clean_text(
                    f"PayloadError: the payload cannot be decoded ({type(exc).__name__}: "
                    f"{exc}); it stays in the row as written"
                )
                job.state = State.RUNNING
                self._record(Outcome(job.token, ok=False, error=error, permanent=True))
                continue
            ready.append(job)
        self.executor.submit_many(ready)

    def _probe(self, conn: psycopg.Connection) -> None:
        """On the maintenance thread: queues with rows committed behind the claim's cursor."""
        names = store.behind(conn, self.q.schema, self.batcher.cursor)
        if names:
            self._events.put(("behind", names))

        if not self.batcher.polls_all:
            due = store.due_queues(conn, self.q.schema, self.queues)
            if due:
                self._events.put(("due", due))

    def _rescued(self, rows: list[tuple[int, str, str, str]]) -> None:
        """On the maintenance thread, inside the rescue's counted transaction."""
        self.hooks.rescued(self, rows)
        self._events.put(("notify", None))  # rescued rows are due now: claim them at once

    def _cron_enqueued(self, n: int) -> None:
        with self._hooks_lock:
            self.hooks.cron_enqueued(self, n)

    # -- stopping ------------------------------------------------------------------------------

    def _shutdown(self) -> None:
        """Acknowledge finished jobs as they come, for up to the grace period (their leases are
        renewed meanwhile), then hand back the rest without counting their attempt."""
        cfg = self.config
        now_only = self._stop_now.is_set()
        deadline = time.monotonic() + (0 if now_only else cfg.grace_seconds)
        if self.table.unfinished():
            log.info(
                "stopping: waiting up to %.0fs for %d task(s)",
                cfg.grace_seconds,
                self.table.unfinished(),
            )
        delay = 0.1
        while True:
            self._collect(block=False, timeout=0)
            try:
                self._flush()
                delay = 0.1
            except psycopg.Error as exc:
                self._conn.close()
                log.warning("could not acknowledge on stop (%s); retrying", _first_line(exc))
                time.sleep(delay)
                delay = min(delay * 2, 1.0)
            left = deadline - time.monotonic()
            if not self.table.unfinished() and not self.table.pending:
                break
            if left <= 0 or self._stop_now.is_set():
                break
            self._collect(block=True, timeout=min(_MAX_ACK_DELAY * 5, left))
            self._check_deadlines(time.monotonic())
        self._hand_back()

    def _hand_back(self) -> None:
        """Release unstarted and running jobs; leave overdue ones leased (their threads still run:
        the lease lapses when this process is gone, and a rescue records the attempt)."""
        back = self.table.to_hand_back()
        for job in self.table.jobs.values():
            if (job.id, job.attempt) in back:
                job.lost = True  # a runner that frees up must not start it: it is going back
        settled = False
        for attempt in range(5):
            try:
                conn = self._conn.get()
                self._flush()
                if back:
                    returned = store.release(conn, self.q.schema, worker_id=self.id, tasks=back)
                    log.warning("handed back %d unfinished task(s)", len(returned))
                    back = []
                conn.execute(self.q["unregister"], {"worker_id": self.id})
                settled = True
                break
            except psycopg.Error as exc:
                self._conn.close()
                log.warning("could not settle tasks on stop (%s); retrying", _first_line(exc))
                time.sleep(min(0.5 * 2**attempt, 4))
        if not settled:
            # Not a clean stop: say so (a supervisor then hands the rows back itself, or their
            # leases lapse).
            log.error("could not hand back this worker's tasks; their leases will lapse")
            self.exit_code = self.exit_code or 1
        log.info("worker %s stopped", self.id[:8])

    # -- handlers that need the worker ---------------------------------------------------------

    def _context(self, job: Job, conn: psycopg.Connection | None = None) -> Context:
        c = job.claimed
        return Context(
            c.id, c.task, c.queue, c.attempt, c.max_attempts, self.id, conn, cancel_signal=job
        )

    def _run_transactional(self, job: Job) -> None:
        """Run the handler inside the transaction that marks its task done (fenced). A task
        someone asked to cancel is not done: its handler's writes roll back, and the failure
        raised here ends the row cancelled through the retry statement."""
        assert self.pool is not None
        c = job.claimed
        with self.pool.connection() as conn, conn.transaction():
            value = job.definition.fn(job.payload, self._context(job, conn))
            if self.stores_result(job.definition):
                # A result that cannot be stored raises here (a DoNotRetry), rolling back the
                # handler's writes with the completion.
                text = results.encode_result(value, self.config.max_result_bytes)
                row = [(c.id, c.attempt, text)]
                kept = store.complete_with_result(conn, self.q.schema, worker_id=self.id, done=row)
                if kept:
                    store.notify_done(conn, self.q.schema, channel=self._done_channel, ids=kept)
            else:
                kept = store.complete(
                    conn, self.q.schema, worker_id=self.id, done=[(c.id, c.attempt)]
                )
            if c.id not in kept:
                raise LostLease(
                    f"task {c.id} was rescued while its handler ran; its writes are rolled back"
                )
            if kept[c.id] == "cancelled":
                raise Cancelled(
                    f"task {c.id} was cancelled while its handler ran; its writes are rolled back"
                )


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def _unknown_handler(payload: Any) -> None:  # pragma: no cover - never called
    raise RuntimeError("unknown task")


_UNKNOWN = TaskDef(name="<unknown>", fn=_unknown_handler)


def run_worker(config: WorkerConfig, tasks: Registry | None = None, **kwargs: Any) -> int:
    return Worker(config, tasks, **kwargs).run()


__all__ = ["Worker", "WorkerConfig", "format_error", "run_worker"]
